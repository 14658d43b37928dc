"""Rollouts on the engine: continuous batching over slots and group sampling with shared prompts.

`generate(engine, params, prompts, n_samples=G, sampling=..., seed=...)` returns `[prompt][sample]`
completions. Each prompt is prefilled once and its G samples share the prompt's full KV pages
(`share_prompt=False` prefills every sample separately: the baseline the sharing is checked
against; both give the same tokens for the same seed). A request that could never fit is rejected
before any work.

`generate` runs a scheduler (`_Scheduler`) over work items (a prompt and the samples prefilled
together), in first-come order, one wave and one decode step at a time until no work is left:

* `wave`: one admission wave. `plan_wave` places the waiting samples of prompts already prefilled
  within the free slots and pages, then takes as many new work items as those allow, `prefill`s
  their prompts in one `prefill_batch` call (first tokens included) and places their samples, until
  nothing more fits; a sample that its first token ends finishes there without a slot. `insert`
  inserts the planned samples with one `insert_batch` call per prefill program they come from.
* `decode`: one decode step of every running sequence (`KVPool.step`; its results are read to
  the host one step later when pipelined, see below); `retire` appends the new tokens and
  finishes the sequences that ended, freeing their slots and pages before the next wave.

**Pipelined decode** (without an environment): `decode` dispatches step k+1 before it reads step
k's results, so the host's work on them (retire, the next round's wave, the next dispatch) runs
while the device computes step k+1; device programs run in dispatch order (each takes the decode
state the previous one returned). A sequence that step k ends is already idle on the device in step
k+1 when a stop token or the token budget ended it; one that a stop string ended (seen on the host
only) decodes one more token there, which is dropped: each step's results are taken only for the
sequences it ran (the same `_Running`, not a later occupant of its slot), and the extra key/value
lands in that sequence's own pages before any later program can hand them to another. No step is
dispatched when the step in flight is the last of every running sequence (each reaches its token
budget there). With environments (`on_turn_end`) a stopped turn's slot is detached at once, so
every step is read before the next.

With one page pool per data replica (see `EngineConfig`), a sample goes to a free slot of a replica
whose own pool has its pages, preferring a replica that already holds its prompt's pages (samples
of one prompt share pages only within a replica). A sample whose pages are not free on any replica
with a free slot waits for running sequences to finish, and later prompts wait behind it
(`engine.stats["admission_waits"]` counts the waves that did so with slots free).

Sample j of prompt i draws with `request_seed(seed, i, j)`, so results do not depend on slot
assignment, batch composition, sharing or the number of slots.

**Multi-turn** (`on_turn_end`): when a sequence's turn ends by a stop token or stop string, the
scheduler detaches it from its slot (`Engine.detach`: its pages, and so its cached positions, stay
with it) and submits `on_turn_end(prompt_index, sample_index, token_ids)` to a bounded thread pool
(`tool_workers`). The slot takes another sequence at once, so a tool's latency costs no decode
slot, only the sequence's pages. The callback returns the environment's observation token ids, or
None to end the episode. `resume` (before each wave, so episodes in progress go first) puts the
answered sequences into free slots of their replicas and appends `[last sampled token] +
observation` to their pages at their positions (`Engine.extend_batch`, one program for all of
them); the model's next turn starts from the token sampled there. With nothing left to decode,
`decode` waits for the first environment to answer. The completion holds every token after the
prompt, `model_mask` marking the ones the model sampled. `max_new_tokens` bounds all of them (model
and environment); an observation that does not fit ends the episode (`finish_reason="length"`, the
observation dropped).

**In-flight weight updates** (`params` a `WeightSlot`, see `tpurl.generate.weights`): before each
round of resume, wave and decode the scheduler polls the slot; when newer weights were published
(by a sync on another thread), every later prefill, decode step and extend uses them, and every
token they sample carries their version (`Completion.versions`). Running sequences keep their KV
pages: the keys and values computed by the old weights stay, so a token sampled after the switch
is the new weights' prediction given the old weights' KV of the positions before it (exactly: a
forward of the new weights in which each layer attends to the old weights' keys and values at
those positions). What the switch changes is recorded per token, which is what an off-policy
correction needs: the behaviour logprobs are the ones the engine reports, per token. The old
weights are released at the switch; a pipelined step still running on them keeps their memory
until it finishes (PjRt frees a deleted buffer once the programs using it are done), and its
tokens carry the version it was dispatched with.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from tpurl.generate.engine import Engine, Prefix
from tpurl.generate.extend import Detached, Resume
from tpurl.generate.pool import KVPool
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import SamplingConfig, request_seed
from tpurl.generate.weights import Weights, WeightSlot
from tpurl.sharding.host import is_writer, on_writer, to_host
from tpurl.tokenizer import decode_generated


# on_turn_end(prompt_index, sample_index, token_ids after the prompt) -> observation ids, or None: done
TurnEnd = Callable[[int, int, np.ndarray], Sequence[int] | None]


@dataclasses.dataclass
class Completion:
    """One sampled continuation. `token_ids` include the stop token when stopped by one;
    `logprobs[t]` is `log_softmax(logits / T)[token_ids[t]]` (float32, see sampling.py) for the
    tokens the model sampled (`model_mask`; the rest are environment tokens of a multi-turn
    episode, logprob 0). `turns`: model turns. `versions[t]`: the policy version of the weights
    that sampled token t (-1 for environment tokens)."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # "stop" (stop token or stop string) | "length" (max_new_tokens)
    prompt_index: int
    sample_index: int
    model_mask: np.ndarray | None = None
    turns: int = 1
    versions: np.ndarray | None = None

    def __post_init__(self):
        if self.model_mask is None:
            self.model_mask = np.ones(len(self.token_ids), bool)
        if self.versions is None:
            self.versions = np.where(self.model_mask, 0, -1).astype(np.int32)


@dataclasses.dataclass
class _Prefilled:
    """A prefilled work item: its prefix, the (prefix sample, sample index) pairs still to place and
    the policy version of the weights that prefilled it (and sampled the first tokens)."""

    prefix: Prefix
    prompt_index: int
    pending: collections.deque
    version: int = 0

    def first(self, k: int) -> tuple[list[int], list[float], list[bool], list[int]]:
        """Prefix sample k's tokens, logprobs, model mask and versions so far: its first token,
        sampled by the prefill."""
        return [int(self.prefix.first_tokens[k])], [float(self.prefix.first_logprobs[k])], [True], [self.version]


@dataclasses.dataclass
class _Running:
    """A sequence in a decode slot and its tokens after the prompt so far (`mask`: sampled by the
    model, not the environment; `versions`: the policy version that sampled each, -1 for the
    environment's)."""

    prompt_index: int
    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    mask: list[bool]
    versions: list[int]
    turns: int = 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.mask.append(True)
        self.versions.append(version)

    def observe(self, obs: list[int]) -> None:
        """Append an environment observation (not sampled: no logprob, no version)."""
        self.tokens += obs
        self.logprobs += [0.0] * len(obs)
        self.mask += [False] * len(obs)
        self.versions += [-1] * len(obs)
        self.turns += 1


@dataclasses.dataclass
class _Wave:
    """One admission wave: the free slots and pages per replica not yet planned, the placements
    planned, and whether something waits for room (`blocked`) or moved on (`progressed`: a prompt
    prefilled or a sample finished at its first token)."""

    slots_left: list[int]
    pages_left: list[float]
    plan: list[tuple[_Prefilled, int, int, int]] = dataclasses.field(default_factory=list)  # (item, k, j, replica)
    planned: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # per (item, replica)
    blocked: bool = False
    progressed: bool = False

    @property
    def has_slots(self) -> bool:
        return sum(self.slots_left) > 0

    def replica_for(self, engine: Engine, item: _Prefilled) -> tuple[int, int] | None:
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

    def reserve(self, item: _Prefilled, k: int, j: int, replica: int, need: int) -> None:
        """Plan prefix sample k (sample index j) of `item` on `replica`, taking `need` of its pages."""
        self.plan.append((item, k, j, replica))
        self.planned[(id(item), replica)] += 1
        self.slots_left[replica] -= 1
        self.pages_left[replica] -= need


@dataclasses.dataclass(frozen=True)
class _Step:
    """A dispatched decode step: its device results, the version of the weights it ran with, and
    the sequence in each slot it ran (whose results it holds)."""

    result: ResultTokens
    version: int
    runs: dict[int, _Running]


def _stop_string_hit(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    if not stop_strings:
        return False
    # A stop string can only have been completed by the newest token, so decoding a tail that is
    # long enough to contain any stop string (each kept token is >= 1 character) suffices.
    tail = tokens[-(4 * max(len(s) for s in stop_strings) + 8):]
    text = decode_generated(tokenizer, tail)
    return any(s in text for s in stop_strings)


class _Scheduler:
    """The state of one `generate` call (see the module docstring): work items not yet prefilled,
    prefilled items with samples to place, running sequences by slot, free slots per replica, and
    the results `[prompt][sample]`. `wave()` then `decode()` while `busy`."""

    def __init__(self, engine: Engine, weights: Weights, pool: KVPool, prompts: list[np.ndarray], *, n_samples: int,
                 sampling: SamplingConfig, seed: int, tokenizer, share_prompt: bool,
                 on_turn_end: TurnEnd | None = None, tools: concurrent.futures.Executor | None = None,
                 pipeline: bool = True):
        self.engine, self.weights, self.pool = engine, weights, pool
        self.prompts, self.sampling, self.seed, self.tokenizer = prompts, sampling, seed, tokenizer
        self.on_turn_end, self.tools = on_turn_end, tools
        # For their environment: its future on process 0 (None on the others, which run no environment).
        self.waiting: list[tuple[_Running, Detached, concurrent.futures.Future | None]] = []
        self.ready: list[tuple[_Running, Detached, list[int]]] = []  # answered, waiting for a slot
        groups = [list(range(n_samples))] if share_prompt else [[j] for j in range(n_samples)]
        # Work items: (prompt index, sample indices prefilled together), first-come.
        self.work = collections.deque((i, g) for i in range(len(prompts)) for g in groups)
        self.prefilled: collections.deque[_Prefilled] = collections.deque()  # first-come order
        self.running: dict[int, _Running] = {}  # by slot
        # Free slots per data replica (each replica has its own page pool), lowest slot used first.
        self.free_slots = [[s for s in range(engine.max_concurrent_decodes - 1, -1, -1) if engine.replica_of(s) == r]
                           for r in range(engine.replicas)]
        self.results: list[list[Completion | None]] = [[None] * n_samples for _ in prompts]
        # The step dispatched but not read yet (pipelined decode: no environment to detach for).
        self.ahead: _Step | None = None
        self.pipelined = pipeline and on_turn_end is None

    @property
    def busy(self) -> bool:
        return bool(self.work or self.prefilled or self.running or self.waiting or self.ready or self.ahead)

    @property
    def params(self):
        return self.weights.params

    @property
    def version(self) -> int:
        return self.weights.version

    def refresh(self, slot: WeightSlot) -> None:
        """Switch to the newest weights published in `slot` (in-flight update) for every later
        prefill, decode step and extend; running sequences keep their KV pages."""
        new = slot.poll(self.weights)
        if new is not self.weights:
            self.engine.stats["weight_switches"] += 1
            self.weights = new

    def wave(self) -> None:
        """One admission wave: plan and insert; drop the prefixes whose samples are all placed."""
        wave = self.plan_wave()
        self.insert(wave.plan)
        while self.prefilled and not self.prefilled[0].pending:
            self.engine.release_prefix(self.prefilled.popleft().prefix)
        if wave.blocked and wave.has_slots:
            self.engine.stats["admission_waits"] += 1
        # Nothing runs, and nothing was prefilled, finished or inserted: no later wave can do better.
        stuck = (self.work or self.prefilled) and not (self.running or self.waiting or self.ready)
        if stuck and not wave.progressed:
            raise RuntimeError("generate: the KV pool cannot hold the next request even when idle "
                               "(check_request should have rejected it)")

    def plan_wave(self) -> _Wave:
        """Plan placements in first-come order within the free slots and pages, prefilling new work
        items while there is room."""
        engine = self.engine
        pages = [engine.free_pages(r) if engine.paged else float("inf") for r in range(engine.replicas)]
        wave = _Wave(slots_left=[len(f) for f in self.free_slots], pages_left=pages)
        while True:
            self._place_waiting(wave)
            if wave.blocked or not wave.has_slots or not self.work or any(item.pending for item in self.prefilled):
                return wave
            take = self._take_work(wave)
            if not take:
                wave.blocked = True
                return wave
            self.prefill(take)
            wave.progressed = True

    def _place_waiting(self, wave: _Wave) -> None:
        """Plan the waiting samples of prefilled items in order while slots are left; a later item
        waits while an earlier one has samples left. A sample its first token ends finishes here."""
        for item in self.prefilled:
            while item.pending and wave.has_slots:
                k, j = item.pending[0]
                if self.on_turn_end is None and self._ends_at_first_token(item, k):
                    item.pending.popleft()
                    self._finish(_Running(item.prompt_index, j, *item.first(k)))
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

    def _take_work(self, wave: _Wave) -> list[tuple[int, list[int]]]:
        """The next work items (at most one prefill batch) while their samples would find slots and
        pages: an estimate over all replicas, since samples that end at their first token need
        neither, a group may need its prompt on several replicas, and the next round takes more."""
        engine, max_new = self.engine, self.sampling.max_new_tokens
        take, est_slots, est_pages = [], sum(wave.slots_left), sum(wave.pages_left)
        most_free = max(p for p, n in zip(wave.pages_left, wave.slots_left) if n)
        while self.work and len(take) < engine.config.max_prefill_batch and est_slots > 0:
            i, samples = self.work[0]
            n = min(len(samples), est_slots)
            first = engine.request_pages(len(self.prompts[i]), max_new)
            if first > est_pages or first > most_free:
                break
            take.append(self.work.popleft())
            est_slots -= n
            est_pages -= engine.request_pages(len(self.prompts[i]), max_new, n)
        return take

    def prefill(self, take: list[tuple[int, list[int]]]) -> None:
        """Prefill the work items `take` in one `prefill_batch` call; their samples wait to be placed."""
        seeds = [[request_seed(self.seed, i, j) for j in samples] for i, samples in take]
        pairs = self.engine.prefill_batch(params=self.params, prompts=[self.prompts[i] for i, _ in take],
                                          sampling=self.sampling, seeds=seeds)
        for (i, samples), (prefix, _) in zip(take, pairs):
            self.prefilled.append(_Prefilled(prefix, i, collections.deque(enumerate(samples)), self.version))

    def insert(self, plan: list[tuple[_Prefilled, int, int, int]]) -> None:
        """Insert the planned samples into free slots of their replicas (lowest first), one
        `insert_batch` per prefill program they come from (usually one)."""
        by_call: dict[int, list[tuple[_Prefilled, int, int, int]]] = {}
        for entry in plan:
            by_call.setdefault(id(entry[0].prefix.k), []).append(entry)
        for entries in by_call.values():
            slots = [self.free_slots[r].pop() for _, _, _, r in entries]
            self.pool.insert_batch([(item.prefix, slot, k) for (item, k, _, _), slot in zip(entries, slots)])
            for (item, k, j, _), slot in zip(entries, slots):
                self.running[slot] = _Running(item.prompt_index, j, *item.first(k))
                if self.on_turn_end is not None and self._ends_at_first_token(item, k):
                    self._turn_ended(slot)  # a multi-turn episode goes on after an empty first turn

    def decode(self) -> None:
        """Dispatch one decode step of every running sequence, then read the step before it
        (pipelined) or this one; with none running, wait for the first environment to answer."""
        dispatch = bool(self.running) and not self._last_step_ahead()
        step = _Step(self.pool.step(self.params), self.version, dict(self.running)) if dispatch else None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.retire(ahead)
        if step is not None and self.pipelined:
            self.ahead = step
        elif step is not None:
            self.retire(step)
        elif self.waiting and is_writer():  # the others wait for process 0's answers in `_answered`
            concurrent.futures.wait([f for _, _, f in self.waiting], return_when=concurrent.futures.FIRST_COMPLETED)

    def _last_step_ahead(self) -> bool:
        """Whether the step in flight ran every running sequence and brings each to its token budget."""
        ahead, budget = self.ahead, self.sampling.max_new_tokens
        return ahead is not None and all(ahead.runs.get(slot) is run and len(run.tokens) + 1 >= budget
                                         for slot, run in self.running.items())

    def retire(self, step: _Step) -> None:
        """Read `step` to the host: append each new token to the sequence that the step ran, if it
        still runs; end the turns that ended (on device, or by a stop string)."""
        tokens, logprobs, valid, done = _as_lists(to_host(step.result))
        for slot, run in step.runs.items():
            if valid[slot] and self.running.get(slot) is run:
                self._take(slot, run, tokens[slot], logprobs[slot], done[slot], step.version)

    def _take(self, slot: int, run: _Running, token: int, logprob: float, done: bool, version: int) -> None:
        """Append a token that weights of `version` sampled to the sequence in `slot`; end its turn
        if it ended (on device, or by a stop string)."""
        run.append(token, logprob, version)
        if done or (self.sampling.stop_strings and self._stop_string_hit(_turn(run))):
            self._turn_ended(slot)

    def _turn_ended(self, slot: int) -> None:
        """A running sequence's turn ended: with an environment, a stopped turn is detached from its
        slot and waits for the environment in the tool pool (even one that used the last token of
        the budget: the environment still sees, and grades, that turn); otherwise the sequence is
        finished. Either way the slot is free."""
        run = self.running.pop(slot)
        if self.on_turn_end is not None and self._stopped(_turn(run)):
            seq = self.engine.detach(slot)  # also stops a turn that ended by a stop string on device
            self.free_slots[seq.replica].append(slot)
            # Across processes, process 0's environments answer for all (`_answered`).
            future = self.tools.submit(self.on_turn_end, run.prompt_index, run.sample_index,
                                       np.asarray(run.tokens, np.int32)) if is_writer() else None
            self.waiting.append((run, seq, future))
        else:
            self._finish(run)
            self.engine.free_resource(slot)
            self.free_slots[self.engine.replica_of(slot)].append(slot)

    def resume(self) -> None:
        """Collect the environments' answers; resume the answered sequences that find a free slot of
        their replica (one extend program) and finish the episodes that are over."""
        for entry, obs in self._answered():
            self.waiting.remove(entry)
            run, seq, _ = entry
            if obs is None or self.sampling.max_new_tokens - len(run.tokens) - len(obs) < 1:
                # The episode is over, or the observation does not fit the token budget.
                self._finish(run, None if obs is None else "length")
                self.engine.release_detached(seq)
            else:
                self.ready.append((run, seq, [int(t) for t in obs]))
        requests, resumed = [], {}
        for entry in list(self.ready):
            run, seq, obs = entry
            if not self.free_slots[seq.replica]:
                continue
            self.ready.remove(entry)
            slot = self.free_slots[seq.replica].pop()
            requests.append(Resume(slot=slot, seq=seq, tokens=[run.tokens[-1], *obs],
                                   start=len(self.prompts[run.prompt_index]) + len(run.tokens) - 1,
                                   steps=sum(run.mask), remaining=self.sampling.max_new_tokens - len(run.tokens) - len(obs),
                                   seed=request_seed(self.seed, run.prompt_index, run.sample_index)))
            run.observe(obs)
            resumed[slot] = run
        if requests:
            self._resumed(to_host(self.pool.extend(self.params, requests, self.sampling)), resumed)

    def _answered(self) -> list[tuple[tuple, list[int] | None]]:
        """The waiting episodes whose environment has answered, each with its observation (None:
        the episode is over). Across processes only process 0 runs the environments: which episodes
        answered, and with what, goes to every process over the rollout devices, so that all of
        them resume the same sequences with the same tokens at the same step."""
        if not self.waiting:
            return []
        shared = self._answers() if jax.process_count() == 1 else on_writer(self._answers, mesh=self.engine.mesh)
        return [(self.waiting[i], obs) for i, obs in shared["answered"]]

    def _answers(self) -> dict[str, list]:
        """Process 0's answered episodes: their indices in `waiting` and observations."""
        return {"answered": [[i, _observation(future.result())] for i, (_, _, future) in enumerate(self.waiting)
                             if future.done()]}

    def _resumed(self, result: ResultTokens, resumed: dict[int, _Running]) -> None:
        tokens, logprobs, _, done = _as_lists(result)
        for slot, run in resumed.items():
            self.running[slot] = run
            self._take(slot, run, tokens[slot], logprobs[slot], done[slot], self.version)

    def _stop_string_hit(self, tokens: list[int]) -> bool:
        return _stop_string_hit(self.tokenizer, tokens, self.sampling.stop_strings)

    def _stopped(self, tokens: list[int]) -> bool:
        return bool(tokens) and (tokens[-1] in self.sampling.stop_token_ids or self._stop_string_hit(tokens))

    def _ends_at_first_token(self, item: _Prefilled, k: int) -> bool:
        return item.prefix.finished_at_first_token(k) or self._stop_string_hit(item.first(k)[0])

    def _finish(self, run: _Running, reason: str | None = None) -> None:
        reason = reason or ("stop" if self._stopped(_turn(run)) else "length")
        self.results[run.prompt_index][run.sample_index] = Completion(
            prompt_ids=self.prompts[run.prompt_index], token_ids=np.asarray(run.tokens, np.int32),
            logprobs=np.asarray(run.logprobs, np.float32), finish_reason=reason, prompt_index=run.prompt_index,
            sample_index=run.sample_index, model_mask=np.asarray(run.mask, bool), turns=run.turns,
            versions=np.asarray(run.versions, np.int32))


def _observation(obs) -> list[int] | None:
    """An environment's answer as plain ints (None: the episode is over)."""
    return None if obs is None else [int(t) for t in obs]


def _as_lists(result: ResultTokens) -> tuple[list, list, list, list]:
    """A step's host results as Python lists (tokens, logprobs, valid, done): one conversion each,
    not one numpy scalar per slot."""
    return tuple(np.asarray(x).tolist() for x in (result.tokens, result.logprobs, result.valid, result.done))


def _turn(run: _Running) -> list[int]:
    """The tokens of the sequence's current model turn (after its last environment token)."""
    start = len(run.mask) - next((i for i, m in enumerate(reversed(run.mask)) if not m), len(run.mask))
    return run.tokens[start:]


def _checked_prompts(engine: Engine, pool: KVPool, prompts, *, n_samples: int, sampling: SamplingConfig,
                     tokenizer) -> list[np.ndarray]:
    """The prompts as int32 arrays, once the call is known to be able to run (checked before any work)."""
    if pool.engine is not engine:
        raise ValueError("generate: the KV pool belongs to another engine")
    if n_samples < 1:
        raise ValueError(f"generate: n_samples must be >= 1, got {n_samples}")
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("generate: SamplingConfig.stop_strings needs a tokenizer (pass tokenizer=...)")
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    for i, p in enumerate(prompts):
        try:
            engine.check_request(len(p), sampling.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return prompts


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], *, n_samples: int,
             sampling: SamplingConfig, seed: int, tokenizer=None, share_prompt: bool = True,
             pool: KVPool | None = None, on_turn_end: TurnEnd | None = None,
             tool_workers: int = 8, version: int | None = None,
             before_step: Callable[[], None] | None = None, pipeline: bool = True) -> list[list[Completion]]:
    """Sample `n_samples` completions of every prompt (token ids); see the module docstring.

    `params`: the weights, or a `WeightSlot` to read them (and their version) from: the call holds
    the slot's weights and switches to newer ones published there between decode steps (in-flight
    weight updates). `version`: the policy version of plain `params` (default 0), stamped on every
    sampled token (`Completion.versions`). The KV pool: pass `pool` (its owner keeps it, e.g. for
    several calls, and frees it) or let the call allocate one for itself, freed before it returns.
    `on_turn_end`: run multi-turn episodes, the callback on at most `tool_workers` threads.
    `before_step()`: runs on the calling thread before each round (the poll of the slot, extends,
    prefills and a decode step); it may publish newer weights into the slot (an in-flight sync
    from the sampling thread itself), which this round switches to. `pipeline=False` reads every
    decode step before dispatching the next (the reference the pipelined decode is tested against).
    """
    if isinstance(params, WeightSlot):
        if version is not None:
            raise ValueError("generate: the version of a WeightSlot's weights comes from the slot; drop version=")
        slot = params
    else:
        slot = WeightSlot(Weights(params, 0 if version is None else version))
    if pool is None:
        with KVPool(engine) as own:
            return generate(engine, slot, prompts, n_samples=n_samples, sampling=sampling, seed=seed,
                            tokenizer=tokenizer, share_prompt=share_prompt, pool=own, on_turn_end=on_turn_end,
                            tool_workers=tool_workers, before_step=before_step, pipeline=pipeline)
    prompts = _checked_prompts(engine, pool, prompts, n_samples=n_samples, sampling=sampling, tokenizer=tokenizer)
    if on_turn_end is not None and not engine.paged:
        raise ValueError("generate: multi-turn episodes (on_turn_end) resume sequences in their KV pages, which "
                         "needs the paged cache (EngineConfig.cache='paged')")
    with _tool_pool(tool_workers if on_turn_end else 0) as tools:
        held, scheduler = slot.hold(), None
        try:
            scheduler = _Scheduler(engine, held, pool, prompts, n_samples=n_samples, sampling=sampling,
                                   seed=seed, tokenizer=tokenizer, share_prompt=share_prompt,
                                   on_turn_end=on_turn_end, tools=tools, pipeline=pipeline)
            while scheduler.busy:
                if before_step is not None:
                    before_step()
                scheduler.refresh(slot)
                scheduler.resume()
                scheduler.wave()
                scheduler.decode()
        finally:  # the weights held now: the scheduler may have switched from the first ones
            slot.release(held if scheduler is None else scheduler.weights)
    return scheduler.results


@contextlib.contextmanager
def _tool_pool(workers: int):
    """The threads that run environment turns (None for 0 workers). When generation fails, the
    turns not yet started are cancelled rather than run to no purpose before the error shows."""
    if not workers:
        yield None
        return
    tools = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        yield tools
    except BaseException:
        tools.shutdown(wait=True, cancel_futures=True)
        raise
    tools.shutdown(wait=True)
