"""The scheduler of a continuous batch: admission waves, decode steps, turn ends, resumes.

It runs one `generate` call (`tpurl.generate.driver`) or a long-lived service that requests join
while others run (`tpurl.generate.service`); each request has its own sampling config and seeds.

Each round (`tpurl.generate.driver.generate`): `refresh` (in-flight weights), `resume` (answered
multi-turn episodes, and requests that continue their session's parked sequence, go first), `wave`
(admission, `tpurl.generate.admission`) and `decode` (one step of every running sequence; `retire`
reads its results and ends the turns that ended). Multi-turn bookkeeping is
`tpurl.generate.episodes`, session reuse `tpurl.generate.session_cache`; the pipelining of decode
steps is described in `tpurl.generate.driver`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tpurl.generate.admission import Admission
from tpurl.generate.engine import Engine
from tpurl.generate.episodes import Episodes
from tpurl.generate.pool import KVPool
from tpurl.generate.records import Completion, Prefilled, Request, Running, Step, Stops, as_lists
from tpurl.generate.sampling import SamplingConfig
from tpurl.generate.session_cache import SessionCache
from tpurl.generate.weights import Weights, WeightSlot
from tpurl.sharding.host import to_host


class _Scheduler:
    """The state of a continuous batch on one engine: requests by index (`requests`; each with its
    own sampling, seeds and result callbacks; `add` may join one at any time between rounds), those
    not yet running (`admission`), running sequences by slot, episodes between turns (`episodes`,
    multi-turn only), parked session sequences (`sessions`: with `sessions=True` on an engine that
    supports them, else None) and free slots per replica. One round of `refresh`, `resume`, `wave`,
    `decode` while `busy`."""

    def __init__(self, engine: Engine, weights: Weights, pool: KVPool, *, tokenizer,
                 episodes: Episodes | None = None, pipeline: bool = True, sessions: bool = False):
        self.engine, self.weights, self.pool, self.tokenizer = engine, weights, pool, tokenizer
        self.requests: dict[int, Request] = {}
        self._next_index = 0
        self.admission = Admission(engine, self.requests, finish_first=episodes is None)
        self.episodes = episodes
        self.sessions = SessionCache(engine) if sessions and SessionCache.supported(engine) else None
        self.running: dict[int, Running] = {}  # by slot
        # Free slots per data replica (each replica has its own page pool), lowest slot used first.
        self.free_slots = [[s for s in range(engine.max_concurrent_decodes - 1, -1, -1) if engine.replica_of(s) == r]
                           for r in range(engine.replicas)]
        # The step dispatched but not read yet (pipelined decode: no environment to detach for).
        self.ahead: Step | None = None
        # Session resumes dispatched this round, read after `ahead` (before the step dispatched next).
        self.extended: list[Step] = []
        self.pipelined = pipeline and episodes is None

    def add(self, prompt: np.ndarray, *, sampling: SamplingConfig, seeds: list[int], share_prompt: bool = True,
            on_finish: Callable[[Completion], None], on_token: Callable[[int, int, float, Any], None] | None = None,
            session: str | None = None) -> int:
        """Queue a request (checked by the caller: `Engine.check_request` and the token ids) behind
        those waiting; returns its index. Sample j draws with `seeds[j]`; with `share_prompt` all
        samples share one prefill and the prompt's full pages. A request of a `session` whose
        prompt extends the session's parked sequence resumes it instead (`self.sessions`)."""
        index, self._next_index = self._next_index, self._next_index + 1
        samples = list(range(len(seeds)))
        self.requests[index] = request = Request(np.asarray(prompt, np.int32), sampling, list(seeds),
                                                 Stops(sampling, self.tokenizer), on_finish, on_token, session,
                                                 top_count=self.engine.reports_top(sampling))
        if session is None or self.sessions is None or not self.sessions.match(index, session, request):
            self.admission.add(index, [samples] if share_prompt else [[j] for j in samples])
        return index

    def cancel(self, index: int) -> None:
        """Drop request `index` (between rounds): its waiting samples, and its running sequences'
        slots and pages, which later requests take. A step in flight still computes them once;
        its results for them are dropped (`retire` takes only sequences still running)."""
        if self.episodes is not None:
            raise ValueError("cancel: a multi-turn generate call cannot cancel a request")
        if self.requests.pop(index, None) is None:
            return
        self.admission.cancel(index)
        self.admission.drop_placed()
        if self.sessions is not None:
            self.sessions.cancel(index)
        for slot in [s for s, run in self.running.items() if run.prompt_index == index]:
            del self.running[slot]
            self.engine.free_resource(slot)
            self.free_slots[self.engine.replica_of(slot)].append(slot)

    @property
    def busy(self) -> bool:
        return bool(self.admission.busy or self.running or self._between_turns or self.ahead or self.extended
                    or (self.sessions is not None and self.sessions.waiting))

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
        """One admission wave: plan and insert; drop the prefixes whose samples are all placed. A
        wave that waits for pages releases parked session sequences, oldest first, and goes on."""
        wave = self._plan_and_insert()
        while wave.blocked and self.sessions is not None and self.sessions.evict():
            wave = self._plan_and_insert()
        if wave.blocked and wave.has_slots:
            self.engine.stats["admission_waits"] += 1
        # Nothing runs, and nothing was prefilled, finished or inserted: no later wave can do better.
        stuck = self.admission.busy and not (self.running or self._between_turns)
        if stuck and not wave.progressed:
            raise RuntimeError("generate: the KV pool cannot hold the next request even when idle "
                               "(check_request should have rejected it)")

    def _plan_and_insert(self):
        wave = self.admission.plan([len(f) for f in self.free_slots], self.weights)
        for run in wave.finished:
            self._streamed(run)
            self._finish(run)
        self.insert(wave.plan)
        self.admission.drop_placed()
        return wave

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
                self.running[slot] = run = item.running(k, j, self.requests[item.prompt_index].top_count)
                self._streamed(run)
                if self.episodes is not None and self.requests[item.prompt_index].stops.at_first_token(item, k):
                    self._turn_ended(slot)  # a multi-turn episode goes on after an empty first turn

    def decode(self) -> None:
        """Dispatch one decode step of every running sequence, then read the step before it
        (pipelined) and this round's session resumes, or this step; with none running, wait for
        the first environment to answer."""
        step = None
        if self.running and not self._last_step_ahead():
            top = any(run.top_count for run in self.running.values())  # else a program without top logprobs
            step = Step(self.pool.step(self.params, top=top), self.version, dict(self.running))
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.retire(ahead)
        extended, self.extended = self.extended, []
        for resumed in extended:
            self.retire(resumed)
        if step is not None and self.pipelined:
            self.ahead = step
        elif step is not None:
            self.retire(step)
        elif self.episodes is not None:
            self.episodes.wait()

    def _last_step_ahead(self) -> bool:
        """Whether the step in flight ran every running sequence and brings each to its token budget."""
        ahead = self.ahead
        return ahead is not None and all(
            ahead.runs.get(slot) is run and len(run.tokens) + 1 >= self.requests[run.prompt_index].sampling.max_new_tokens
            for slot, run in self.running.items())

    def retire(self, step: Step) -> None:
        """Read `step` to the host: append each new token to the sequence that the step ran, if it
        still runs; end the turns that ended (on device, or by a stop string)."""
        host = to_host(step.result)
        tokens, logprobs, valid, done, top = as_lists(host)
        for slot, run in step.runs.items():
            if valid[slot] and self.running.get(slot) is run:
                if host.routes is not None:  # the step consumed the token its predecessor sampled
                    run.consumed(host.routes[slot])
                self._take(slot, run, tokens[slot], logprobs[slot], done[slot], step.version, top[slot])

    def _take(self, slot: int, run: Running, token: int, logprob: float, done: bool, version: int,
              top=None) -> None:
        """Append a token that weights of `version` sampled to the sequence in `slot` (with its top
        logprobs, when the engine reports them); end its turn if it ended (on device, or by a stop
        string)."""
        run.append(token, logprob, version, top)
        self._streamed(run)
        stops = self.requests[run.prompt_index].stops
        if done or (stops.sampling.stop_strings and stops.string_hit(run.turn())):
            self._turn_ended(slot)

    def _streamed(self, run: Running) -> None:
        """Pass the newest token of `run` to its request's `on_token` (streaming), if asked."""
        on_token = self.requests[run.prompt_index].on_token
        if on_token is not None:
            on_token(run.sample_index, run.tokens[-1], run.logprobs[-1], run.top[-1] if run.top else None)

    def _turn_ended(self, slot: int) -> None:
        """A running sequence's turn ended: with an environment, a stopped turn is detached from its
        slot and waits for the environment (even one that used the last token of the budget: the
        environment still sees, and grades, that turn); otherwise the sequence is finished, and
        sample 0 of a session's request is parked for the session's next request. Either way the
        slot is free."""
        run = self.running.pop(slot)
        request = self.requests[run.prompt_index]
        if self.episodes is not None and request.stops.stopped(run.turn()):
            self.episodes.submit(run, self.engine.detach(slot))  # also stops a turn that a stop string ended
        elif self.sessions is not None and request.session is not None and run.sample_index == 0:
            self._finish(run)
            ids = np.concatenate([request.prompt, np.asarray(run.tokens, np.int32)])
            self.sessions.park(request.session, ids, self.engine.detach(slot))
        else:
            self._finish(run)
            self.engine.free_resource(slot)
        self.free_slots[self.engine.replica_of(slot)].append(slot)

    def resume(self) -> None:
        """Resume what waits for a slot: answered episodes, and session requests that continue a
        parked sequence."""
        if self.episodes is not None:
            self._resume_episodes()
        if self.sessions is not None:
            self._resume_sessions()

    def _resume_sessions(self) -> None:
        """Resume the session requests that find a slot and pages (one extend program for all of
        them, each with its request's sampling, read by `decode` after the step in flight, so that
        the host does not wait for it); queue for a prefill those that cannot get pages."""
        resumes, prefill = self.sessions.resumes(self.free_slots, self.requests, busy=bool(self.running or self.ahead))
        for index in prefill:
            self.admission.add(index, [[0]])
        if not resumes:
            return
        result = self.pool.extend(self.params, [r for _, r in resumes],
                                  [self.requests[index].sampling for index, _ in resumes])
        runs = {r.slot: Running(index, 0, [], [], [], [], top_count=self.requests[index].top_count)
                for index, r in resumes}
        self.running.update(runs)
        self.extended.append(Step(result, self.version, runs))

    def _resume_episodes(self) -> None:
        """Finish the episodes that are over; resume the answered sequences that find a free slot of
        their replica (one extend program)."""
        for run, seq, reason in self.episodes.collect():
            self._finish(run, reason)
            self.engine.release_detached(seq)
        requests, resumed = self.episodes.resumes(self.free_slots)
        if not requests:
            return
        host = to_host(self.pool.extend(self.params, requests, self.episodes.sampling))
        tokens, logprobs, _, done, top = as_lists(host)
        appended = {r.slot: len(r.tokens) for r in requests}
        for slot, run in resumed.items():
            self.running[slot] = run
            if host.routes is not None:  # the resume consumed the model's last token and the observation
                run.consumed(host.routes[slot][:appended[slot]])
            self._take(slot, run, tokens[slot], logprobs[slot], done[slot], self.version, top[slot])

    def _finish(self, run: Running, reason: str | None = None) -> None:
        """Hand sample `run` to its request's `on_finish`; a request whose samples are all done leaves."""
        request = self.requests[run.prompt_index]
        reason = reason or ("stop" if request.stops.stopped(run.turn()) else "length")
        request.done += 1
        if request.done == request.n_samples:
            del self.requests[run.prompt_index]
        request.on_finish(run.completion(request.prompt, reason))
