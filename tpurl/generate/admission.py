"""Admission for `generate`: which waiting samples go into free slots in the next wave.

Requests are served first-come; a request may join while others run (each has its own sampling
config and seeds). A work item is a prompt and the sample indices prefilled together
(all G with prompt sharing); once prefilled it waits as a `Prefilled` until each of its samples is
placed. A wave places the waiting samples within the free slots and pages, then prefills as many
new work items as those allow (one `prefill_batch` call each round) and places theirs, until
nothing more fits.

With one page pool per data replica a sample goes to a free slot of a replica whose own pool has
its pages, preferring one that already holds its prompt's pages (samples of one prompt share pages
only within a replica). A sample that fits nowhere waits for running sequences to finish, and later
prompts wait behind it.
"""

from __future__ import annotations

import collections
import dataclasses

from tpurl.generate.engine import Engine
from tpurl.generate.records import Prefilled, Request, Running
from tpurl.generate.weights import Weights


@dataclasses.dataclass
class Wave:
    """One admission wave: the free slots and pages per replica not yet planned, the placements
    planned, the samples that ended at their first token (`finished`, no slot needed), and whether
    something waits for room (`blocked`) or moved on (`progressed`: a prompt prefilled or a sample
    finished)."""

    slots_left: list[int]
    pages_left: list[float]
    plan: list[tuple[Prefilled, int, int, int]] = dataclasses.field(default_factory=list)  # (item, k, j, replica)
    planned: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # per (item, replica)
    finished: list[Running] = dataclasses.field(default_factory=list)
    blocked: bool = False
    progressed: bool = False

    @property
    def has_slots(self) -> bool:
        return sum(self.slots_left) > 0

    def replica_for(self, engine: Engine, item: Prefilled) -> tuple[int, int] | None:
        """(replica, fresh pages) for the item's next sample: a replica with a free slot whose pool
        has the pages, preferring one that already holds (or gets) the prompt's pages, then the one
        with the most free pages, then the lowest."""
        best = None
        for r, slots in enumerate(self.slots_left):
            if not slots:
                continue
            n = self.planned[(id(item), r)]
            need = engine.pages_needed(item.prefix, n + 1, r) - engine.pages_needed(item.prefix, n, r)
            if need <= self.pages_left[r]:
                key = (need, -self.pages_left[r], r)
                if best is None or key < best[0]:
                    best = (key, r, need)
        return None if best is None else best[1:]

    def reserve(self, item: Prefilled, k: int, j: int, replica: int, need: int) -> None:
        """Plan prefix sample k (sample index j) of `item` on `replica`, taking `need` of its pages."""
        self.plan.append((item, k, j, replica))
        self.planned[(id(item), replica)] += 1
        self.slots_left[replica] -= 1
        self.pages_left[replica] -= need


class Admission:
    """The requests of a scheduler not yet running, first-come (see the module docstring), by
    request index in `requests` (the scheduler's table, shared). `finish_first`: a sample that its
    first token ends finishes at once, without a slot (off for multi-turn episodes, which go on
    after an empty turn)."""

    def __init__(self, engine: Engine, requests: dict[int, Request], *, finish_first: bool):
        self.engine, self.requests, self.finish_first = engine, requests, finish_first
        self.work: collections.deque[tuple[int, list[int]]] = collections.deque()
        self.prefilled: collections.deque[Prefilled] = collections.deque()

    def add(self, index: int, groups: list[list[int]]) -> None:
        """Queue request `index`'s samples, each group of sample indices prefilled together."""
        self.work.extend((index, g) for g in groups)

    def cancel(self, index: int) -> None:
        """Drop request `index`'s samples not yet placed (its prefixes are released in turn)."""
        self.work = collections.deque(w for w in self.work if w[0] != index)
        for item in self.prefilled:
            if item.prompt_index == index:
                item.pending.clear()

    @property
    def busy(self) -> bool:
        return bool(self.work or self.prefilled)

    def plan(self, slots_left: list[int], weights: Weights) -> Wave:
        """Plan placements in first-come order within `slots_left` (free slots per replica) and the
        free pages, prefilling new work items with `weights` while there is room."""
        engine = self.engine
        pages = [engine.free_pages(r) if engine.paged else float("inf") for r in range(engine.replicas)]
        wave = Wave(slots_left=list(slots_left), pages_left=pages)
        while True:
            self._place_waiting(wave)
            if wave.blocked or not wave.has_slots or not self.work or any(item.pending for item in self.prefilled):
                return wave
            take = self._take_work(wave)
            if not take:
                wave.blocked = True
                return wave
            self._prefill(take, weights)
            wave.progressed = True

    def drop_placed(self) -> None:
        """Release the prefixes whose samples are all placed (or cancelled)."""
        placed = [item for item in self.prefilled if not item.pending]
        for item in placed:
            self.engine.release_prefix(item.prefix)
        if placed:
            self.prefilled = collections.deque(item for item in self.prefilled if item.pending)

    def _place_waiting(self, wave: Wave) -> None:
        """Plan the waiting samples of prefilled items in order while slots are left; a later item
        waits while an earlier one has samples left."""
        for item in self.prefilled:
            while item.pending and wave.has_slots:
                k, j = item.pending[0]
                if self.finish_first and self.requests[item.prompt_index].stops.at_first_token(item, k):
                    item.pending.popleft()
                    wave.finished.append(item.running(k, j, self.requests[item.prompt_index].top_count))
                    wave.progressed = True
                    continue
                where = wave.replica_for(self.engine, item)
                if where is None:
                    wave.blocked = True  # wait for running sequences to free pages (or slots)
                    break
                item.pending.popleft()
                wave.reserve(item, k, j, *where)
            if item.pending:
                break  # later prompts wait behind this one

    def _take_work(self, wave: Wave) -> list[tuple[int, list[int]]]:
        """The next work items (at most one prefill batch) while their samples would find slots and
        pages: an estimate over all replicas, since samples that end at their first token need
        neither, a group may need its prompt on several replicas, and the next round takes more."""
        engine = self.engine
        take, est_slots, est_pages = [], sum(wave.slots_left), sum(wave.pages_left)
        most_free = max(p for p, n in zip(wave.pages_left, wave.slots_left) if n)
        while self.work and len(take) < engine.config.max_prefill_batch and est_slots > 0:
            i, samples = self.work[0]
            n = min(len(samples), est_slots)
            length, max_new = len(self.requests[i].prompt), self.requests[i].sampling.max_new_tokens
            first = engine.request_pages(length, max_new)
            if first > est_pages or first > most_free:
                break
            take.append(self.work.popleft())
            est_slots -= n
            est_pages -= engine.request_pages(length, max_new, n)
        return take

    def _prefill(self, take: list[tuple[int, list[int]]], weights: Weights) -> None:
        """Prefill the work items `take` in one `prefill_batch` call, each with its request's
        sampling; their samples wait to be placed, in `take`'s order."""
        requests = [self.requests[i] for i, _ in take]
        pairs = self.engine.prefill_batch(params=weights.params, prompts=[r.prompt for r in requests],
                                          sampling=[r.sampling for r in requests],
                                          seeds=[[r.seeds[j] for j in samples] for r, (_, samples) in zip(requests, take)])
        self.prefilled.extend(Prefilled(prefix, i, collections.deque(enumerate(samples)), weights.version)
                              for (i, samples), (prefix, _) in zip(take, pairs))
