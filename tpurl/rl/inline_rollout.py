"""Asynchronous rollout without a second thread (`AsyncConfig.overlap = "dispatch"`): the main
thread dispatches the update of step k, samples the batch of step k+1 on the rollout pool while
the train pool computes, then waits for the update.

    producer = InlineProducer(rollout, sample, first_step=k, stop_step=e, cursor=c, max_staleness=s)
    batch = producer.get()          # the step's batch (sampled now when nobody sampled it ahead)
    producer.before_update(tl)      # `load_next`: the next batch's weights, before the update is queued
    ...                             # dispatch the update (JAX returns before the devices finish)
    producer.sample_ahead(pending)  # `beside_update`: the next step's batch, on the rollout pool meanwhile
    ...                             # wait for the update; `after_update` publishes what a later batch needs

Why: every cross-process collective (a program spanning both processes, a host read gathered
over them, the weight sync) must then come from one thread. Two threads that issue them at once
deadlock on XLA:CPU with gloo, even over disjoint devices, while one thread that dispatches a
program on one pool and then works on the other does not. So this is the asynchronous mode a
multi-process run uses; in one process it gives the same batches and updates as the thread
(`tpurl.rl.async_rollout.RolloutProducer`, whose protocol this one follows), and less overlap: the
logprobs and advantages of step k wait for nothing but do not overlap the rollout either.

The schedule is the thread's (`version_for`), and so is the hand-over of weights: `publish`
leaves the weights of a version for the batch that needs them, and `load_next` loads them before
the update is dispatched (a load beside it would queue behind it on the train devices). One batch
is sampled ahead, so `max_staleness` above 1 would only make batches staler (`AsyncConfig`
refuses it).

In-flight (`in_flight="continue"`): `sample_ahead(pending, land=(params, version))` gets the
update's new weights, still being computed. Before each decode step of the batch it samples, the
main thread asks whether the update has finished (`jax.Array.is_ready`, agreed by every process
on the rollout devices, `RolloutSide.agree`, so that all of them land at the same step); once it has,
it loads them there (`RolloutSide.load`, the running batch switching to them, its sequences keeping
their KV). An update that finishes after the batch is loaded by `load_next`, as with "drain". So
a batch starts on the weights the schedule says and its later tokens may be one version newer;
which ones depends on timing, so runs do not repeat exactly. No copy is published: the load
comes before the next update donates the weights.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax

from tpurl.rl.async_rollout import CLOSE_TIMEOUT_S, Produced, Producer, RolloutBackend, SampleFn
from tpurl.rl.timeline import Timeline
from tpurl.sync import SyncReport


class InlineProducer(Producer):
    """Samples the batches of steps `[first_step, stop_step)` on the calling thread, from data
    index `cursor`, each with the weights `version_for(step)` says (see the module docstring)."""

    def __init__(self, rollout: RolloutBackend, sample: SampleFn, *, first_step: int, stop_step: int, cursor: int,
                 max_staleness: int, snapshot: Callable[[Any], Any] | None = None):
        super().__init__(rollout, sample, first_step=first_step, stop_step=stop_step, cursor=cursor,
                         max_staleness=max_staleness, snapshot=snapshot)
        if self.in_flight == "continue" and max_staleness != 1:
            raise ValueError(f"InlineProducer: in-flight, the update beside a batch makes the version after the one "
                             f"it starts with, so max_staleness must be 1, not {max_staleness}")
        self._ahead: Produced | None = None
        self._open = False
        self._watch: tuple[threading.Thread, list[float]] | None = None  # the update's watcher, its end
        self._ahead_end = 0.0
        self._next_sync: SyncReport | None = None
        self._landing: tuple[Any, int] | None = None  # in-flight: the update's weights and version, until loaded
        self._landed: list[SyncReport] = []  # in-flight: the loads since `take_landed`

    # -- the protocol -------------------------------------------------------------------------

    def before_update(self, tl: Timeline) -> None:
        """Phase `sync`: `load_next`, before the update is queued on the train devices, where the
        load's staging runs."""
        with tl.phase("sync") as res:
            self.load_next()
            res.value = self._rollout.params

    def beside_update(self, version: int) -> Callable[[Any], None]:
        """`learn`'s `while_updating` for the update that makes `version`: given its outputs
        (the new train state and metrics, still being computed), sample the next batch; in-flight,
        the new weights land mid-batch."""
        return lambda pending: self.sample_ahead(pending, land=(pending[0].params, version))

    def _hand_over(self, params, version: int, tl: Timeline) -> SyncReport | None:
        """In-flight: the loads this step ran (before the update, or mid-batch), as its report;
        else a copy of the weights when a later batch samples with them."""
        landed = self.take_landed()
        if landed is None:
            self._publish_copy(params, version, tl)
        return landed

    # -- sampling on the main thread ----------------------------------------------------------

    def _next_batch(self) -> Produced:
        """The batch `sample_ahead` made, else one sampled now."""
        batch, self._ahead = self._ahead or self._produce(self._next), None
        return batch

    def load_next(self) -> SyncReport | None:
        """Load the weights the next batch needs, if they are not loaded yet; call it before the
        update is dispatched. Loading beside the update would wait for it: the load's first program
        (cast and relayout) runs on the train devices, behind the update. Its report goes with
        that batch (`Produced.sync`); in-flight, with this step (`take_landed`)."""
        if self.done:
            self._landing = None  # in-flight: no batch is left to sample with them
            return None
        if self._landing is not None:
            return self._land()
        version = self.version_for(self._next)
        if self._rollout.version == version:
            return None
        with self._cond:
            params = self._pending.pop(version)
        self._next_sync = self._rollout.load(params, version=version)
        return self._next_sync

    def sample_ahead(self, pending: Any = None, *, land: tuple[Any, int] | None = None) -> None:
        """Sample the batch `get` returns next, if the segment has one (call it while the update
        runs). `pending`: the update's outputs; a watcher thread notes when they are ready
        (`train_busy`), without issuing any program or collective. `land`: the update's new
        weights and their version, loaded mid-batch once ready (in-flight, else ignored)."""
        self._watch = None
        if self.in_flight == "continue" and land is not None:
            self._landing = land
        if pending is not None:
            done: list[float] = []

            def watch():
                jax.block_until_ready(pending)
                done.append(time.perf_counter())
            thread = threading.Thread(target=watch, name="tpurl-update-watch", daemon=True)
            thread.start()
            self._watch = (thread, done)
        if self._ahead is None and not self.done:
            with self._rollout.between_steps(self._land_if_done):
                self._ahead = self._produce(self._next)
        self._ahead_end = time.perf_counter()

    def _land_if_done(self) -> None:
        """Before a decode step: load the update's weights if every process has them."""
        if self._landing is not None and self._update_done(self._landing[0]):
            self._land()

    def _update_done(self, params) -> bool:
        """Whether the update that makes `params` has finished on every process (a collective on
        the rollout devices, which every process calls at the same decode step)."""
        return self._rollout.agree(all(x.is_ready() for x in jax.tree.leaves(params)))

    def _land(self) -> SyncReport:
        (params, version), self._landing = self._landing, None
        report = self._rollout.load(params, version=version)
        self._landed.append(report)
        return report

    def take_landed(self) -> SyncReport | None:
        """In-flight: the loads since the last call as one report (`SyncReport.combined`), for the
        step that ran them; None if there were none."""
        landed, self._landed = self._landed, []
        return SyncReport.combined(landed)

    def compile_metrics(self, batch: Produced) -> dict[str, float]:
        """None of its own: it samples on the main thread, inside the step's timeline, whose
        `compile/seconds` counts those compiles already."""
        return {}

    def train_busy(self, start: float, end: float) -> list[tuple[float, float]]:
        """The train pool's busy intervals in a step whose train side ran from `start` to `end`:
        idle from the end of its update (noted by the watcher) to the end of the batch sampled
        beside it, if the update finished first. Call it once the main thread has waited for the
        update."""
        if self._watch is None:
            return [(start, end)]
        (thread, done), self._watch = self._watch, None
        thread.join()
        if not done or done[0] >= self._ahead_end:
            return [(start, end)]
        return [(start, done[0]), (self._ahead_end, end)]

    def _produce(self, step: int) -> Produced:
        version = self.version_for(step)
        if self._rollout.version != version:
            raise RuntimeError(f"InlineProducer: the batch of step {step} needs version {version}, the rollout holds "
                               f"{self._rollout.version}; call load_next before the update")
        if not self._open:
            self._rollout.open()
            self._open = True
        report, self._next_sync = self._next_sync, None
        return self._sampled(step, version, Timeline(), report, self._set_busy(True))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """End the rollout window (if open) and drop what nobody will use; wait at most `timeout` s
        for the update's watcher. True once the watcher has ended."""
        with self._cond:
            self._pending.clear()
        self._ahead = None
        self._landing = None
        self._landed.clear()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch[0].join(timeout)
        if self._open:
            self._open = False
            self._rollout.close()
        return watch is None or not watch[0].is_alive()
