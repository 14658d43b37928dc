"""Multi-turn episodes for `generate`: sequences out of their slots, waiting for their environment.

When a model turn ends by a stop token or stop string, the scheduler detaches the sequence
(`Engine.detach`: its pages, and so its cached positions, stay with it) and `Episodes.submit`s
`on_turn_end(prompt_index, sample_index, token_ids)` to a bounded thread pool (`tool_pool`). The
callback returns the environment's observation token ids, or None to end the episode. Answered
sequences wait in `ready` for a free slot of their replica; `resumes` turns them into `Resume`
requests that append `[last sampled token] + observation` at their positions.

Across processes only process 0 runs the environments: which episodes answered, and with what,
goes to every process over the rollout devices, so that all of them resume the same sequences with
the same tokens at the same step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import jax
import numpy as np

from tpurl.generate.extend import Resume
from tpurl.generate.page_book import Detached
from tpurl.generate.records import Running, TurnEnd
from tpurl.generate.sampling import SamplingConfig, request_seed
from tpurl.sharding.host import is_writer, on_writer


class Episodes:
    """The episodes of one `generate` call between turns: `waiting` for their environment (with its
    future on process 0, None on the others) and `ready` (answered, waiting for a slot). `engine`:
    whose mesh carries process 0's answers to the other processes."""

    def __init__(self, on_turn_end: TurnEnd, tools: concurrent.futures.Executor, engine, prompts: list[np.ndarray],
                 *, sampling: SamplingConfig, seed: int):
        self.on_turn_end, self.tools, self.engine = on_turn_end, tools, engine
        self.prompts, self.sampling, self.seed = prompts, sampling, seed
        self.waiting: list[tuple[Running, Detached, concurrent.futures.Future | None]] = []
        self.ready: list[tuple[Running, Detached, list[int]]] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.ready)

    def submit(self, run: Running, seq: Detached) -> None:
        """The detached sequence `seq` of `run` waits for its environment's answer to this turn."""
        future = self.tools.submit(self.on_turn_end, run.prompt_index, run.sample_index,
                                   np.asarray(run.tokens, np.int32)) if is_writer() else None
        self.waiting.append((run, seq, future))

    def wait(self) -> None:
        """Block until the first waiting environment answers (process 0; the others wait for its
        answers in `collect`)."""
        if self.waiting and is_writer():
            concurrent.futures.wait([f for _, _, f in self.waiting], return_when=concurrent.futures.FIRST_COMPLETED)

    def collect(self) -> list[tuple[Running, Detached, str | None]]:
        """Take the answered episodes out of `waiting`: those that go on become `ready`; returns
        those that are over, each with its finish reason (None: by its last turn's end; "length":
        the observation does not fit the token budget, and is dropped)."""
        over = []
        for entry, obs in self._answered():
            self.waiting.remove(entry)
            run, seq, _ = entry
            if obs is None or self.sampling.max_new_tokens - len(run.tokens) - len(obs) < 1:
                over.append((run, seq, None if obs is None else "length"))
            else:
                self.ready.append((run, seq, [int(t) for t in obs]))
        return over

    def resumes(self, free_slots: list[list[int]]) -> tuple[list[Resume], dict[int, Running]]:
        """Resume requests for the ready episodes that find a free slot of their replica (popped
        from `free_slots`), their observations appended; and the sequence resumed in each slot."""
        requests, resumed = [], {}
        for entry in list(self.ready):
            run, seq, obs = entry
            if not free_slots[seq.replica]:
                continue
            self.ready.remove(entry)
            slot = free_slots[seq.replica].pop()
            budget = self.sampling.max_new_tokens
            requests.append(Resume(slot=slot, seq=seq, tokens=[run.tokens[-1], *obs],
                                   start=len(self.prompts[run.prompt_index]) + len(run.tokens) - 1,
                                   steps=sum(run.mask), remaining=budget - len(run.tokens) - len(obs),
                                   seed=request_seed(self.seed, run.prompt_index, run.sample_index)))
            run.observe(obs)
            resumed[slot] = run
        return requests, resumed

    def _answered(self) -> list[tuple[tuple, list[int] | None]]:
        """The waiting episodes whose environment has answered, each with its observation (None:
        the episode is over), the same on every process."""
        if not self.waiting:
            return []
        shared = self._answers() if jax.process_count() == 1 else on_writer(self._answers, mesh=self.engine.mesh)
        return [(self.waiting[i], obs) for i, obs in shared["answered"]]

    def _answers(self) -> dict[str, list]:
        """Process 0's answered episodes: their indices in `waiting` and observations."""
        return {"answered": [[i, _observation(future.result())] for i, (_, _, future) in enumerate(self.waiting)
                             if future.done()]}


def _observation(obs) -> list[int] | None:
    """An environment's answer as plain ints (None: the episode is over)."""
    return None if obs is None else [int(t) for t in obs]


@contextlib.contextmanager
def tool_pool(workers: int):
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
