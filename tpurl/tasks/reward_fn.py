"""A user's reward function, called safely: in a bounded pool of worker threads, with a timeout,
its failures contained to the samples they concern.

    def score(prompt: str, completion: str, row: dict) -> float | dict[str, float]: ...
    async def score(prompt, completion, row): ...                         # async works the same
    def score(prompts: list, completions: list, rows: list) -> list[...]: # batched=True: one call

A call that raises, runs past `timeout_s`, or returns something that is not a finite number (or a
dict of them naming the configured components) is that sample's zero reward with the error
recorded (`Scored.error`); the run goes on. A hung call cannot be stopped (Python threads cannot
be killed): its worker is a daemon thread, left behind and replaced, so neither the pool nor the
process's exit waits for it; after `MAX_STUCK_PER_WORKER * workers` such calls the function gets
no more work (every sample's error says why).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import numbers
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from tpurl.tasks.imports import import_object

MAX_STUCK_PER_WORKER = 4


def check_reward_weights(weights: Sequence[tuple[str, float]], what: str) -> None:
    """A one-line ValueError unless `weights` (name, weight) pairs name each component once, with
    weights >= 0; `what` names the field (e.g. "CustomConfig.reward_weights")."""
    names = [n for n, _ in weights]
    if not names or len(set(names)) != len(names) or min(w for _, w in weights) < 0:
        raise ValueError(f"{what}={dict(weights)!r} must name each component once, with weights >= 0")


@dataclasses.dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    started: float | None = None
    worker: int | None = None
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class DaemonWorkers:
    """`workers` daemon threads running jobs from a queue; `run` waits for each job at most
    `timeout_s` from when it started running, and replaces a worker whose job overran."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = workers, name
        self.stuck = 0
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._retired: set[int] = set()
        self._lock = threading.Lock()
        self._threads = 0

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        me = threading.get_ident()
        while me not in self._retired:
            job = self._queue.get()
            job.worker, job.started = me, time.monotonic()
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:  # noqa: BLE001 - the user's failure, reported per sample
                job.error = e
            job.done.set()

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout_s: float) -> list[_Job]:
        """`fn(*args)` for each of `calls`; the jobs, each done or past its timeout."""
        with self._lock:
            while self._threads - len(self._retired) < self.workers:
                self._spawn()
        jobs = [_Job(fn, args) for args in calls]
        for job in jobs:
            self._queue.put(job)
        for job in jobs:
            while not job.done.wait(0.05 if job.started is None else max(0.0, job.started + timeout_s - time.monotonic())):
                if job.started is not None and time.monotonic() >= job.started + timeout_s:
                    self._abandon(job)
                    break
        return jobs

    def _abandon(self, job: _Job) -> None:
        """`job` overran: its thread is retired (it exits if the call ever returns) and replaced."""
        with self._lock:
            self.stuck += 1
            self._retired.add(job.worker)
            self._spawn()


@dataclasses.dataclass(frozen=True)
class Scored:
    """One sample's components (None when the call failed) and the error that failed it."""

    components: Mapping[str, float] | None
    error: str | None = None


def _one_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def check_value(value: Any, names: Sequence[str]) -> dict[str, float]:
    """`value` (what the function returned) as components named `names`: a number is the one
    component; a dict must name exactly `names`. ValueError (one line) for anything else."""
    if isinstance(value, Mapping):
        extra, missing = sorted(set(value) - set(names)), sorted(set(names) - set(value))
        if extra or missing:
            raise ValueError(f"returned components {sorted(value)}; CustomConfig.reward_weights names {list(names)}")
        items = [(n, value[n]) for n in names]
    elif len(names) == 1:
        items = [(names[0], value)]
    else:
        raise ValueError(f"returned {type(value).__name__} {value!r:.60}; return a dict of {list(names)}")
    out = {}
    for name, v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise ValueError(f"returned {name}={v!r:.60}, not a finite number")
        out[name] = float(v)
    return out


class RewardFunction:
    """The reward function `path` names (see the module docstring), scoring into `names`."""

    def __init__(self, path: str, names: Sequence[str], *, batched: bool, timeout_s: float, workers: int):
        self.path, self.names, self.batched, self.timeout_s = path, tuple(names), batched, timeout_s
        self.fn = import_object(path, "CustomConfig.reward_fn")
        if not callable(self.fn):
            raise ValueError(f"CustomConfig.reward_fn={path!r} names a {type(self.fn).__name__}, not a function")
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._workers = DaemonWorkers(1 if batched else workers, "tpurl-reward")

    def _call(self, *args):
        """One call of the function (an async one runs to completion on its own event loop)."""
        out = self.fn(*args)
        return asyncio.run(out) if inspect.isawaitable(out) else out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[Scored]:
        """Each sample's components, or the error that gave it none."""
        if self._workers.stuck >= MAX_STUCK_PER_WORKER * self._workers.workers:
            why = (f"{self._workers.stuck} calls of {self.path} are still running past "
                   f"CustomConfig.timeout_s={self.timeout_s}; no more are started")
            return [Scored(None, why) for _ in prompts]
        if self.batched:
            (job,) = self._workers.run(self._call, [(list(prompts), list(completions), list(rows))], self.timeout_s)
            return self._batch_result(job, len(prompts))
        jobs = self._workers.run(self._call, list(zip(prompts, completions, rows)), self.timeout_s)
        return [self._result(job) for job in jobs]

    def _result(self, job: _Job) -> Scored:
        if not job.done.is_set():
            return Scored(None, f"{self.path} timed out after {self.timeout_s:g} s")
        if job.error is not None:
            return Scored(None, f"{self.path} raised {_one_line(job.error)}")
        try:
            return Scored(check_value(job.result, self.names))
        except ValueError as e:
            return Scored(None, f"{self.path} {e}")

    def _batch_result(self, job: _Job, n: int) -> list[Scored]:
        """A batched call's list, one value per sample; a call that failed fails them all."""
        if not job.done.is_set() or job.error is not None:
            return [self._result(job)] * n
        values = job.result
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes, Mapping)) or len(values) != n:
            size = len(values) if isinstance(values, Sequence) else type(values).__name__
            return [Scored(None, f"{self.path} returned {size} values for {n} samples; return one per sample")] * n
        return [self._result(dataclasses.replace(job, result=v)) for v in values]
