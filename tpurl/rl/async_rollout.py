"""Asynchronous rollout with bounded staleness: the rollout side samples the batches of later steps
while the main thread updates on the current one, on a thread of its own (`RolloutProducer`) or
on the main thread beside the update (`tpurl.rl.inline_rollout.InlineProducer`). Both follow one
protocol, `Producer`, which `tpurl.rl.async_step.AsyncSteps` drives without asking which it has:

    with RolloutProducer(rollout, sample, first_step=k, stop_step=e, cursor=c, max_staleness=s) as producer:
        for step in range(k, e):
            batch = producer.get()                        # the step's batch (re-raises the thread's error)
            producer.before_update(tl)                    # before the update is dispatched
            learn(..., while_updating=producer.beside_update(v + 1))   # the update: version v -> v + 1
            report = producer.after_update(params, v + 1, tl)          # the new weights, handed over

`after_update` hands the weights of `v + 1` to the rollout side: as a copy for the batch sampled
with them (phase `publish`, weights no later update will donate), or loaded at once (in-flight),
and after the segment's last update it stops the producer and syncs them (phase `sync`).

Schedule. The producer starts with the rollout weights of version `v0` (`rollout.version`) and
samples the batch of step `j` with the weights of version `version_for(j) = v0 + max(0, j - k - s)`:
the first `s + 1` batches with `v0`, then one version more per step. The update of step `j`
starts from version `v0 + j - k`, so a batch is at most `s` versions old. With `in_flight =
"drain"` the weights of version `v` reach the rollout side as a `RolloutSide.load` between two batches
(never during one), just before the first batch that needs them. It is the oldest version the
bound allows, not the newest that exists: which weights sample a batch must not depend on how the
two threads happen to be scheduled, or runs would not repeat, nor resume exactly from a
checkpoint. With `s = 1` it is also the newest version that can exist while the rollout side
stays busy.

In-flight (`in_flight = "continue"`): the main thread loads every new version into the rollout
side itself as soon as the update made it (`RolloutSide.load` while the producer decodes: the running
batch switches to it between two decode steps, its sequences keeping their KV, and each token
records the version that sampled it) and tells the producer (`loaded`). The producer then only
waits, before a batch, until the rollout weights are at least `version_for(step)`: batches are as
fresh as the update allows and never staler than the bound, but which tokens the new weights
sample depends on the threads' timing, so runs do not repeat exactly.

Blocking. The producer waits for the weights a batch needs (`publish`); the main thread waits for
batches (`get`). At most `s` finished batches wait in the queue.

Lifecycle. The thread starts on `start()` (or entering the `with`); the rollout window (the KV pool)
is open on that thread while it runs, and belongs to it (`tpurl.threads`). An error there ends the
thread and is raised by the next `get()` in the main thread, as the same exception. `close()`
(leaving the `with`, however) stops the producer: a batch being sampled stops at its next decode
step, and the join waits at most `timeout` seconds (a tool call or grader that hangs cannot hold
up an interrupt; the thread, a daemon, then ends by itself and delivers nothing).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, ContextManager, Protocol

import jax
import jax.numpy as jnp

from tpurl.config_types import check_types
from tpurl.generate.weights import check_in_flight
from tpurl.rl.collect import Collected
from tpurl.rl.timeline import Timeline
from tpurl.sync import SyncReport

OVERLAPS = ("thread", "dispatch")
_POLL_S = 0.05  # how often a blocked thread looks at the other side (stop requested, thread gone)
CLOSE_TIMEOUT_S = 10.0  # the longest `close()` waits for a producer thread to end


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous rollout. `max_staleness`: how many policy versions a batch may lag the update
    that trains on it (0: the synchronous loop, every batch sampled by the weights it updates;
    >= 1 needs disaggregated placement and `AlgorithmConfig.correction`, an off-policy correction).
    `in_flight`: what a sync that arrives during a rollout batch does: "drain" waits until the batch
    is done (runs repeat exactly, and resume exactly); "continue" lands at once, the batch's
    running sequences switching to the new weights (fresher batches; not repeatable).
    `overlap`: how the rollout runs beside the update. "thread": on a thread of its own, beside the
    whole train side. "dispatch": on the main thread, between dispatching the update and waiting
    for it (`tpurl.rl.inline_rollout`): the same batches and updates, less overlap, and the mode a
    multi-process run needs (one thread issues every cross-process collective); `max_staleness=1`
    only (one batch is sampled ahead); with "continue" the update's weights land at the first
    decode step after it has finished on every process."""

    max_staleness: int = 0
    in_flight: str = "drain"
    overlap: str = "thread"

    def __post_init__(self):
        check_types(self)
        if self.max_staleness < 0:
            raise ValueError(f"AsyncConfig.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        check_in_flight(self.in_flight, "AsyncConfig")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"AsyncConfig.overlap={self.overlap!r}; use one of {OVERLAPS}")
        if self.overlap == "dispatch" and self.max_staleness > 1:
            raise ValueError(f"AsyncConfig.max_staleness={self.max_staleness}: overlap='dispatch' samples one batch "
                             "ahead, so a larger bound only makes batches staler; use max_staleness=1")

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0


class RolloutBackend(Protocol):
    """What the producers use of `tpurl.rl.rollout.RolloutSide`."""

    version: int
    in_flight: str  # what a load does to a running sample call: "drain" | "continue"
    params: Any

    def load(self, train_params, *, version: int) -> SyncReport: ...
    def open(self) -> None: ...
    def close(self) -> Any: ...
    def between_steps(self, fn: Callable[[], None]) -> ContextManager[None]: ...
    def agree(self, flag: bool) -> bool: ...


# sample(step, cursor, tl) -> the step's batch from data index `cursor` (phases `rollout`, `reward` of tl)
SampleFn = Callable[[int, int, Timeline], Collected]


@dataclasses.dataclass
class Produced:
    """One batch from the producer: `step` it is for, the `version` of the weights that sampled
    it (in-flight: that started it; `token_versions` say which sampled each token), its phases on
    the rollout side (`sync` when it loaded weights first, `rollout`, `reward`), the sync's report
    (None: it synced nothing) and the wall interval `[start, end]` (`time.perf_counter`) in which
    the rollout side worked on it."""

    step: int
    version: int
    collected: Collected
    timeline: Timeline
    sync: SyncReport | None
    start: float
    end: float


def _copy(params):
    return jax.tree.map(jnp.copy, params)


class Producer:
    """The producer protocol (see the module docstring) and the state both producers share: a
    segment's steps `[first_step, stop_step)`, its bound, the data cursor, the step whose batch
    `get` returns next, the published weights not yet loaded, the rollout side's busy intervals,
    and the schedule of weights: the batch of `step` is sampled with version `version_for(step)`.
    `snapshot(params)`: the copy `after_update` publishes, one no later update donates (default:
    a plain copy on the same devices)."""

    def __init__(self, rollout: RolloutBackend, sample: SampleFn, *, first_step: int, stop_step: int, cursor: int,
                 max_staleness: int, snapshot: Callable[[Any], Any] | None = None):
        name = type(self).__name__
        if max_staleness < 1:
            raise ValueError(f"{name}: max_staleness={max_staleness} must be >= 1 (0 is the synchronous loop)")
        if stop_step <= first_step:
            raise ValueError(f"{name}: no steps in [{first_step}, {stop_step})")
        self._rollout, self._sample, self._snapshot = rollout, sample, snapshot or _copy
        self.first_step, self.stop_step, self.max_staleness = first_step, stop_step, max_staleness
        self.in_flight = rollout.in_flight  # the rollout side's own knob (`AsyncConfig.in_flight`)
        self.first_version = rollout.version
        self._cursor = cursor
        self._next = first_step  # the step whose batch `get` returns next
        self._cond = threading.Condition()  # guards `_pending`, `_busy`, `_busy_since`
        self._pending: dict[int, Any] = {}  # version -> published weights, until loaded
        self._busy: list[tuple[float, float]] = []
        self._busy_since: float | None = None

    def version_for(self, step: int) -> int:
        """The policy version of the weights that sample the batch of `step`."""
        return self.first_version + max(0, step - self.first_step - self.max_staleness)

    def wants(self, version: int) -> bool:
        """Whether a later batch is sampled with the weights of `version` (so `publish` them;
        in-flight, the producer never needs them published: never)."""
        return self.in_flight == "drain" and self.first_version < version <= self.version_for(self.stop_step - 1)

    @property
    def done(self) -> bool:
        """Whether every batch of the segment was taken (`get`)."""
        return self._next >= self.stop_step

    # -- the protocol, called by the main thread ----------------------------------------------

    def get(self) -> Produced:
        """The next step's batch, waiting for it; the producer's error, if it failed."""
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.get: every batch of steps [{self.first_step}, "
                               f"{self.stop_step}) was taken")
        batch = self._next_batch()
        self._next += 1
        return batch

    def before_update(self, tl: Timeline) -> None:
        """Work before the step's update is dispatched (its phases in `tl`); none here."""

    def beside_update(self, version: int) -> Callable[[Any], None] | None:
        """What `learn` runs beside the update that makes `version` (None: nothing)."""
        return None

    def after_update(self, params, version: int, tl: Timeline) -> SyncReport | None:
        """Hand the weights of `version` (the update's, which the next update donates) to the
        rollout side; returns the report of the loads this step ran (None: none). After the
        segment's last update: stop the producer, then sync them (phase `sync`)."""
        if not self.done:
            return self._hand_over(params, version, tl)
        if not self.close():
            raise RuntimeError(f"{type(self).__name__}: the rollout thread did not end within {CLOSE_TIMEOUT_S} s "
                               "of the segment's last batch")
        return self._sync(params, version, tl)

    def publish(self, version: int, params) -> None:
        """Hand the producer the weights of `version` (a pytree no one will donate or delete)."""
        if not self.wants(version):
            raise ValueError(f"{type(self).__name__}.publish: no batch of steps [{self.first_step}, "
                             f"{self.stop_step}) is sampled with version {version}")
        with self._cond:
            self._pending[version] = params
            self._cond.notify_all()

    def train_busy(self, start: float, end: float) -> list[tuple[float, float]]:
        """The train pool's busy intervals in a step whose train side ran from `start` to `end`."""
        return [(start, end)]

    def compile_metrics(self, batch: Produced) -> dict[str, float]:
        """The seconds the batch's sampling spent making programs on the producer's own thread
        (`compile/rollout_seconds`; the main thread's are the step timeline's `compile/seconds`)."""
        return {"compile/rollout_seconds": batch.timeline.compile_seconds}

    def busy_intervals(self, until: float) -> list[tuple[float, float]]:
        """The wall intervals the rollout side has worked in so far (the current one ends at `until`)."""
        with self._cond:
            now = [] if self._busy_since is None else [(self._busy_since, max(self._busy_since, until))]
            return list(self._busy) + now

    def forget_before(self, t: float) -> None:
        """Drop the busy intervals that ended before `t` (they are accounted for)."""
        with self._cond:
            self._busy = [(a, b) for a, b in self._busy if b >= t]

    def start(self) -> Producer:
        return self

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the producer, waiting at most `timeout` s; True once nothing of it runs."""
        raise NotImplementedError

    def __enter__(self) -> Producer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- for the producers --------------------------------------------------------------------

    def _next_batch(self) -> Produced:
        raise NotImplementedError

    def _hand_over(self, params, version: int, tl: Timeline) -> SyncReport | None:
        raise NotImplementedError

    def _sync(self, params, version: int, tl: Timeline) -> SyncReport:
        """Load the weights of `version` into the rollout side (phase `sync` of the main thread)."""
        with tl.phase("sync") as res:
            report = self._rollout.load(params, version=version)
            res.value = self._rollout.params
        return report

    def _publish_copy(self, params, version: int, tl: Timeline) -> None:
        """Publish a copy of the weights of `version` when a later batch samples with them
        (phase `publish`): the next update donates `params`."""
        if self.wants(version):
            with tl.phase("publish") as res:
                res.value = snapshot = self._snapshot(params)
                self.publish(version, snapshot)

    def _sampled(self, step: int, version: int, tl: Timeline, sync: SyncReport | None, start: float) -> Produced:
        """The batch of `step`, sampled now with the loaded weights of `version`; the rollout side
        has been busy on it since `start`."""
        collected = self._sample(step, self._cursor, tl)
        tl.finish()
        end = self._set_busy(False)
        self._cursor = collected.cursor
        return Produced(step=step, version=version, collected=collected, timeline=tl, sync=sync, start=start,
                        end=end)

    def _set_busy(self, busy: bool) -> float:
        t = time.perf_counter()
        with self._cond:
            if busy:
                self._busy_since = t
            else:
                self._busy.append((self._busy_since, t))
                self._busy_since = None
        return t


@dataclasses.dataclass
class _Failed:
    error: BaseException


class _Stopped(Exception):
    """The producer was asked to stop while it waited or sampled."""


class RolloutProducer(Producer):
    """Samples the batches of steps `[first_step, stop_step)` on its own thread, from data index
    `cursor`, each with the weights `version_for(step)` says (see the module docstring)."""

    def __init__(self, rollout: RolloutBackend, sample: SampleFn, *, first_step: int, stop_step: int, cursor: int,
                 max_staleness: int, snapshot: Callable[[Any], Any] | None = None):
        super().__init__(rollout, sample, first_step=first_step, stop_step=stop_step, cursor=cursor,
                         max_staleness=max_staleness, snapshot=snapshot)
        self._queue: queue.Queue = queue.Queue(maxsize=max_staleness)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpurl-rollout", daemon=True)

    # -- the main thread's side ---------------------------------------------------------------

    def loaded(self) -> None:
        """In-flight: the main thread has loaded newer weights into the rollout side."""
        with self._cond:
            self._cond.notify_all()

    def start(self) -> RolloutProducer:
        self._thread.start()
        return self

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the producer: a batch being sampled stops at its next decode step; join the thread
        for at most `timeout` s. True once the thread has ended (or never started)."""
        self._stop.set()
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        while not self._queue.empty():  # batches nobody will train on
            self._queue.get_nowait()
        return not self._thread.is_alive()

    def _next_batch(self) -> Produced:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("RolloutProducer.get: the rollout thread is not running (never started, "
                                       "or closed)") from None
        if isinstance(item, _Failed):
            raise item.error
        return item

    def _hand_over(self, params, version: int, tl: Timeline) -> SyncReport | None:
        """In-flight: load the weights at once, while the producer decodes (into the rollout pool's
        own devices: nothing the next update donates), and wake it; else publish a copy."""
        if self.in_flight == "continue":
            report = self._sync(params, version, tl)
            self.loaded()
            return report
        self._publish_copy(params, version, tl)
        return None

    # -- the producer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._rollout.open()
            try:
                with self._rollout.between_steps(self._stop_point):
                    for step in range(self.first_step, self.stop_step):
                        self._deliver(self._produce(step))
            finally:
                self._rollout.close()
        except _Stopped:
            pass
        except BaseException as e:  # handed to the main thread, which raises it
            try:
                self._deliver(_Failed(e))
            except _Stopped:
                pass

    def _stop_point(self) -> None:
        """Before each decode step of a batch: end it if `close` was called."""
        if self._stop.is_set():
            raise _Stopped

    def _produce(self, step: int) -> Produced:
        params, version = self._await(self.version_for(step))
        tl = Timeline()
        start = self._set_busy(True)
        report = None
        if params is not None:
            with tl.phase("sync") as res:
                report = self._rollout.load(params, version=version)
                res.value = getattr(self._rollout, "params", None)
            del params
        return self._sampled(step, version, tl, report, start)

    def _await(self, version: int) -> tuple[Any, int]:
        """`(weights to load, their version)` for a batch that needs `version`, waiting for them:
        the published weights of `version`, or None and the rollout's version when it has them
        already (in-flight: that version or a newer one, which the main thread loaded)."""
        while True:
            # Read outside the lock: the read waits for a sync the main thread may be running.
            loaded = self._rollout.version
            with self._cond:
                if self._stop.is_set():
                    raise _Stopped
                if loaded == version or (self.in_flight == "continue" and loaded > version):
                    return None, loaded
                if version in self._pending:
                    return self._pending.pop(version), version
                self._cond.wait(_POLL_S)

    def _deliver(self, item) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                pass
