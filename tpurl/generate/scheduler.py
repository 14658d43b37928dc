"""The scheduler of one `generate` call: admission waves, decode steps, turn ends, resumes.

Each round (`tpurl.generate.driver.generate`): `refresh` (in-flight weights), `resume` (answered
multi-turn episodes go first), `wave` (admission, `tpurl.generate.admission`) and `decode` (one
step of every running sequence; `retire` reads its results and ends the turns that ended).
Multi-turn bookkeeping is `tpurl.generate.episodes`; the pipelining of decode steps is described
in `tpurl.generate.driver`.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from tpurl.generate.admission import Admission
from tpurl.generate.engine import Engine
from tpurl.generate.episodes import Episodes
from tpurl.generate.pool import KVPool
from tpurl.generate.records import Completion, Prefilled, Running, Step, Stops, TurnEnd, as_lists
from tpurl.generate.sampling import SamplingConfig
from tpurl.generate.weights import Weights, WeightSlot
from tpurl.sharding.host import to_host


class _Scheduler:
    """The state of one `generate` call: requests not yet running (`admission`), running sequences
    by slot, episodes between turns (`episodes`, multi-turn only), free slots per replica and the
    results `[prompt][sample]`. One round of `refresh`, `resume`, `wave`, `decode` while `busy`."""

    def __init__(self, engine: Engine, weights: Weights, pool: KVPool, prompts: list[np.ndarray], *, n_samples: int,
                 sampling: SamplingConfig, seed: int, tokenizer, share_prompt: bool,
                 on_turn_end: TurnEnd | None = None, tools: concurrent.futures.Executor | None = None,
                 pipeline: bool = True):
        self.engine, self.weights, self.pool = engine, weights, pool
        self.prompts, self.sampling = prompts, sampling
        self.stops = Stops(sampling, tokenizer)
        groups = [list(range(n_samples))] if share_prompt else [[j] for j in range(n_samples)]
        self.admission = Admission(engine, prompts, groups, sampling=sampling, seed=seed, stops=self.stops,
                                   finish_first=on_turn_end is None)
        self.episodes = None if on_turn_end is None else Episodes(on_turn_end, tools, engine, prompts,
                                                                  sampling=sampling, seed=seed)
        self.running: dict[int, Running] = {}  # by slot
        # Free slots per data replica (each replica has its own page pool), lowest slot used first.
        self.free_slots = [[s for s in range(engine.max_concurrent_decodes - 1, -1, -1) if engine.replica_of(s) == r]
                           for r in range(engine.replicas)]
        self.results: list[list[Completion | None]] = [[None] * n_samples for _ in prompts]
        # The step dispatched but not read yet (pipelined decode: no environment to detach for).
        self.ahead: Step | None = None
        self.pipelined = pipeline and on_turn_end is None

    @property
    def busy(self) -> bool:
        return bool(self.admission.busy or self.running or self._between_turns or self.ahead)

    @property
    def _between_turns(self) -> bool:
        return self.episodes is not None and self.episodes.busy

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
        wave = self.admission.plan([len(f) for f in self.free_slots], self.weights)
        for run in wave.finished:
            self._finish(run)
        self.insert(wave.plan)
        self.admission.drop_placed()
        if wave.blocked and wave.has_slots:
            self.engine.stats["admission_waits"] += 1
        # Nothing runs, and nothing was prefilled, finished or inserted: no later wave can do better.
        stuck = self.admission.busy and not (self.running or self._between_turns)
        if stuck and not wave.progressed:
            raise RuntimeError("generate: the KV pool cannot hold the next request even when idle "
                               "(check_request should have rejected it)")

    def insert(self, plan: list[tuple[Prefilled, int, int, int]]) -> None:
        """Insert the planned samples into free slots of their replicas (lowest first), one
        `insert_batch` per prefill program they come from (usually one)."""
        by_call: dict[int, list[tuple[Prefilled, int, int, int]]] = {}
        for entry in plan:
            by_call.setdefault(id(entry[0].prefix.k), []).append(entry)
        for entries in by_call.values():
            slots = [self.free_slots[r].pop() for _, _, _, r in entries]
            self.pool.insert_batch([(item.prefix, slot, k) for (item, k, _, _), slot in zip(entries, slots)])
            for (item, k, j, _), slot in zip(entries, slots):
                self.running[slot] = Running(item.prompt_index, j, *item.first(k))
                if self.episodes is not None and self.stops.at_first_token(item, k):
                    self._turn_ended(slot)  # a multi-turn episode goes on after an empty first turn

    def decode(self) -> None:
        """Dispatch one decode step of every running sequence, then read the step before it
        (pipelined) or this one; with none running, wait for the first environment to answer."""
        dispatch = bool(self.running) and not self._last_step_ahead()
        step = Step(self.pool.step(self.params), self.version, dict(self.running)) if dispatch else None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.retire(ahead)
        if step is not None and self.pipelined:
            self.ahead = step
        elif step is not None:
            self.retire(step)
        elif self.episodes is not None:
            self.episodes.wait()

    def _last_step_ahead(self) -> bool:
        """Whether the step in flight ran every running sequence and brings each to its token budget."""
        ahead, budget = self.ahead, self.sampling.max_new_tokens
        return ahead is not None and all(ahead.runs.get(slot) is run and len(run.tokens) + 1 >= budget
                                         for slot, run in self.running.items())

    def retire(self, step: Step) -> None:
        """Read `step` to the host: append each new token to the sequence that the step ran, if it
        still runs; end the turns that ended (on device, or by a stop string)."""
        tokens, logprobs, valid, done = as_lists(to_host(step.result))
        for slot, run in step.runs.items():
            if valid[slot] and self.running.get(slot) is run:
                self._take(slot, run, tokens[slot], logprobs[slot], done[slot], step.version)

    def _take(self, slot: int, run: Running, token: int, logprob: float, done: bool, version: int) -> None:
        """Append a token that weights of `version` sampled to the sequence in `slot`; end its turn
        if it ended (on device, or by a stop string)."""
        run.append(token, logprob, version)
        if done or (self.sampling.stop_strings and self.stops.string_hit(run.turn())):
            self._turn_ended(slot)

    def _turn_ended(self, slot: int) -> None:
        """A running sequence's turn ended: with an environment, a stopped turn is detached from its
        slot and waits for the environment (even one that used the last token of the budget: the
        environment still sees, and grades, that turn); otherwise the sequence is finished. Either
        way the slot is free."""
        run = self.running.pop(slot)
        if self.episodes is not None and self.stops.stopped(run.turn()):
            seq = self.engine.detach(slot)  # also stops a turn that ended by a stop string on device
            self.free_slots[seq.replica].append(slot)
            self.episodes.submit(run, seq)
        else:
            self._finish(run)
            self.engine.free_resource(slot)
            self.free_slots[self.engine.replica_of(slot)].append(slot)

    def resume(self) -> None:
        """Finish the episodes that are over; resume the answered sequences that find a free slot of
        their replica (one extend program)."""
        if self.episodes is None:
            return
        for run, seq, reason in self.episodes.collect():
            self._finish(run, reason)
            self.engine.release_detached(seq)
        requests, resumed = self.episodes.resumes(self.free_slots)
        if not requests:
            return
        tokens, logprobs, _, done = as_lists(to_host(self.pool.extend(self.params, requests, self.sampling)))
        for slot, run in resumed.items():
            self.running[slot] = run
            self._take(slot, run, tokens[slot], logprobs[slot], done[slot], self.version)

    def _finish(self, run: Running, reason: str | None = None) -> None:
        reason = reason or ("stop" if self.stops.stopped(run.turn()) else "length")
        self.results[run.prompt_index][run.sample_index] = run.completion(self.prompts[run.prompt_index], reason)
