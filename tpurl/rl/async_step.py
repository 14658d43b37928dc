"""RL steps with asynchronous rollout (`AsyncConfig.max_staleness >= 1`, disaggregated placement):
the rollout pool samples the batches of the next steps on its own thread
(`tpurl.rl.async_rollout.RolloutProducer`) while the train pool updates on the current one; with
`AsyncConfig.overlap = "dispatch"` the main thread samples the next batch between dispatching the
update and waiting for it (`tpurl.rl.inline_rollout.InlineProducer`, phase `sample_ahead`).

    with AsyncSteps(rt) as step:
        while state.step < cfg.steps:
            state, metrics, records, tl = step(state)      # like `rl_step(rt, state)`

A step on the main thread: `wait` for its batch, then the train side's `logprobs`, `advantages`
and `update` (`tpurl.rl.step.learn`: the update starts from the current parameters, the proximal
policy; the rollout's logprobs are the behaviour policy's and `AlgorithmConfig.correction` weighs
each token by their ratio, e.g. truncated: decoupled PPO), then `publish`: a copy of the new weights for
the producer, when a later batch of the segment is sampled with them (the next update donates
the originals). The step calls the producer's protocol (`tpurl.rl.async_rollout.Producer`:
`get`, `before_update`, `beside_update`, `after_update`) the same way in every mode.

Segments. The producer runs from a step where the rollout weights are the trainer's to the next
such step: the pipeline drains where the loop needs that, at evaluation steps (evaluation samples
with the current policy) and checkpoint steps, and at the last step. The last step of a segment
ends with the synchronous loop's `sync` instead of `publish`. Which weights sample a batch depends
only on where its segment started (`RolloutProducer.version_for`), and a resumed run starts at a
checkpoint step, where the uninterrupted run also started a segment: a resumed run repeats it
exactly. The cost is one step per segment whose rollout does not overlap an update.

Metrics beyond the synchronous step's: `time/<phase>_s` are the main thread's phases (`wait`,
`logprobs`, `advantages`, `update`, `publish` or `sync`; with `overlap="dispatch"` also `sync`
before the update, for the next batch's weights, and `sample_ahead`, the next batch sampled beside
the update; they add up to `time/step_s`; in-flight, a load that lands mid-batch is part of
`sample_ahead` and of that batch's `rollout_side/rollout_s`, and `sync/bytes_moved` sums the loads
the step ran), the rollout side's work on this step's batch is `rollout_side/<phase>_s` (`sync`
with a rollout thread, `rollout`, `reward`).
`staleness/version_min|max`: the policy versions that sampled the batch's tokens;
`staleness/max|mean`: how many versions they lag the update (over tokens). The timeline, in
seconds since the first step (one wall clock): `timeline/step_start_s|end_s` the step;
`timeline/train_start_s|end_s` the train pool's busy interval (the step but its `wait`; with
`overlap="dispatch"` the pool is idle from the update's end to the end of the batch sampled
beside it);
`timeline/rollout_start_s|end_s` the rollout pool's work on this step's batch (earlier);
`timeline/overlap_s` the seconds of the step in which both pools were busy;
`timeline/train_idle_frac` and `timeline/rollout_idle_frac` the fraction of the step each was not.
Accounts per thread and pool: `compile/seconds` counts the main thread's compiles,
`compile/rollout_seconds` those of the rollout side's work on the batch; the live-array accounts
at the main thread's phase ends (`memory/<phase>/<kind>_bytes`) count the train pool's devices
alone, not the rollout pool mid-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.memory import program_metrics
from tpurl.rl.async_rollout import Produced, Producer, RolloutProducer
from tpurl.rl.batch import Rollouts, trajectory_records
from tpurl.rl.collect import Collected, collect_rollouts
from tpurl.rl.inline_rollout import InlineProducer
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import (LoopState, ahead_wait_metrics, learn, memory_timeline, step_metrics, step_seed,
                           update_program_metrics)
from tpurl.rl.timeline import Timeline
from tpurl.sync import SyncConfig, SyncReport
from tpurl.sharding.layout import path_keys
from tpurl.sync.quantize import is_quantized
from tpurl.sync.reshard import rollout_dtype_of

log = logging.getLogger(__name__)


def segment_end(cfg, step: int) -> int:
    """The step after `step` at which the pipeline drains: the next evaluation or checkpoint step,
    or the run's last."""
    ends = [cfg.steps]
    for every in (cfg.eval.every_steps, cfg.checkpoint.every_steps):
        if every:
            ends.append((step // every + 1) * every)
    return min(ends)


def _sample(rt: RLRuntime, step: int, cursor: int, tl: Timeline) -> Collected:
    """The producer's batch of `step` (the synchronous loop's: same seed, data and rounds), with
    the decode program's memory (read on the rollout thread, which compiles it)."""
    collected = collect_rollouts(rt, seed=step_seed(rt.cfg.seed, step), cursor=cursor, tl=tl)
    decode = program_metrics("rollout", rt.rollout.engine.decode_memory())
    return dataclasses.replace(collected, metrics={**collected.metrics, **decode})


@functools.partial(jax.jit, static_argnames="sync_cfg")
def _rollout_copy(params, sync_cfg: SyncConfig):
    """A copy of `params` that no later update donates, already in the rollout dtype (still in the
    train layout): the sync that loads it casts nothing, and a bf16 rollout's copy of fp32 master
    weights takes half their bytes. Casting first gives the same rollout weights bit for bit: the
    sync casts in the train layout too, before it reshards. Weights the sync quantizes
    (`SyncConfig.quantize`) keep their own dtype: it quantizes the masters, not a rounded copy."""
    def copy(path, x):
        keep = sync_cfg.quantize is not None and is_quantized(path_keys(path))
        dtype = x.dtype if keep else rollout_dtype_of(x, sync_cfg)
        return jnp.copy(x) if dtype == x.dtype else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(copy, params)


def staleness_metrics(ro: Rollouts, policy_version: int) -> dict[str, float]:
    """The versions that sampled the batch's tokens and their lag behind `policy_version`."""
    versions = ro.token_versions[ro.sampled]
    if versions.size == 0:
        return {}
    lag = policy_version - versions.astype(np.int64)
    return {"staleness/version_min": float(versions.min()), "staleness/version_max": float(versions.max()),
            "staleness/max": float(lag.max()), "staleness/mean": float(lag.mean())}


def _measure(intervals, lo: float, hi: float) -> float:
    """Seconds of `[lo, hi]` covered by the disjoint `intervals`."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def timeline_metrics(origin: float, step: tuple[float, float], train: list[tuple[float, float]],
                     rollout_busy: list[tuple[float, float]], batch: Produced) -> dict[str, float]:
    """Both pools' busy time in the step's wall interval `step` (see the module docstring);
    `train`: the train pool's disjoint busy intervals, in order."""
    t0, t1 = step
    wall = max(t1 - t0, 1e-9)
    busy = _measure(rollout_busy, t0, t1)
    return {"timeline/step_start_s": t0 - origin, "timeline/step_end_s": t1 - origin,
            "timeline/train_start_s": train[0][0] - origin, "timeline/train_end_s": train[-1][1] - origin,
            "timeline/rollout_start_s": batch.start - origin, "timeline/rollout_end_s": batch.end - origin,
            "timeline/overlap_s": sum(_measure(rollout_busy, a, b) for a, b in train),
            "timeline/train_idle_frac": 1.0 - sum(b - a for a, b in train) / wall,
            "timeline/rollout_idle_frac": 1.0 - busy / wall}


class AsyncSteps:
    """`step(state)` runs one asynchronous RL step (see the module docstring); owns the producer
    of the current segment, which `close()` stops (always call it: the `with` block does)."""

    def __init__(self, rt: RLRuntime):
        self.rt = rt
        self._producer: Producer | None = None
        self._origin: float | None = None
        self._last_end = 0.0
        self._train_devices = list(rt.train_mesh.devices.flat)

    def _start_segment(self, state: LoopState) -> Producer:
        rt = self.rt
        if rt.rollout.version != state.policy_version:
            raise RuntimeError(f"AsyncSteps: the rollout weights are version {rt.rollout.version}, the trainer's "
                               f"{state.policy_version}; a segment starts where they are the same")
        kind = InlineProducer if rt.cfg.async_rollout.overlap == "dispatch" else RolloutProducer
        producer = kind(rt.rollout, functools.partial(_sample, rt), first_step=state.step,
                        stop_step=segment_end(rt.cfg, state.step), cursor=state.cursor,
                        max_staleness=rt.cfg.async_rollout.max_staleness,
                        snapshot=functools.partial(_rollout_copy, sync_cfg=rt.rollout.sync_cfg))
        self._producer = producer.start()
        self._last_end = time.perf_counter()
        if self._origin is None:
            self._origin = self._last_end
        return producer

    def __call__(self, state: LoopState) -> tuple[LoopState, dict[str, float], list[dict], Timeline]:
        rt = self.rt
        producer = self._producer or self._start_segment(state)
        tl, memory = memory_timeline(self._train_devices)
        with tl.phase("wait"):
            batch = producer.get()
        producer.before_update(tl)
        train_start = time.perf_counter()
        ro = batch.collected.rollouts
        version = state.policy_version + 1
        learned = learn(rt, state.train, state.ref_params, ro, state.step, tl,
                        while_updating=producer.beside_update(version))
        # Before after_update: a segment's last step stops the producer and its update watcher.
        train_busy = producer.train_busy(train_start, math.inf)
        # The batch's own load (before it was sampled) and the step's, e.g. a segment's closing sync.
        report = SyncReport.combined([batch.sync, producer.after_update(learned.train.params, version, tl)])
        if producer.done:  # the segment's last step: the producer has stopped
            self._producer = None
        tl.finish()
        end = time.perf_counter()
        busy = producer.busy_intervals(end)
        producer.forget_before(end)
        metrics = {**step_metrics(tl, batch.collected, learned, report, state.policy_version,
                                  rollout_s=batch.timeline.seconds.get("rollout", 0.0)),
                   **{f"rollout_side/{k}_s": v for k, v in batch.timeline.seconds.items()},
                   **producer.compile_metrics(batch),
                   **staleness_metrics(ro, state.policy_version),
                   **timeline_metrics(self._origin, (self._last_end, end), [(a, min(b, end)) for a, b in train_busy],
                                      busy, batch),
                   **memory, **update_program_metrics(rt, tl, learned), **ahead_wait_metrics(rt)}
        self._last_end = end
        new_state = LoopState(train=learned.train, ref_params=state.ref_params, step=state.step + 1,
                              cursor=batch.collected.cursor, policy_version=version)
        return new_state, metrics, trajectory_records(ro, learned.advantages), tl

    def close(self) -> None:
        """Stop the current segment's producer (if any); waits a bounded time for its thread."""
        producer, self._producer = self._producer, None
        if producer is not None and not producer.close():
            log.warning("AsyncSteps.close: the rollout producer's thread did not stop in time; it is left to end "
                        "with its batch")

    def __enter__(self) -> AsyncSteps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
