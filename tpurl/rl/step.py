"""One RL step as timed phases: rollout -> rewards -> logprobs -> advantages -> update -> sync.

    offload     the rollout window opens (`RolloutSide.open`): colocated, the optimizer state (and
                optionally reference / master weights) go to host memory, then the KV pool is
                allocated in the memory they left and accounted for
    rollout     the engine samples G completions per prompt in the rollout layout (the KV pool
                lives from the offload to the onload)
    reward      the task scores every completion; all components kept (DAPO's dynamic sampling
                repeats rollout + reward until the batch is full of informative groups)
    onload      the window closes (`RolloutSide.close`): the KV pool is freed (and verified gone when
                colocated) and the parked tensors come back on device
    logprobs    the step's rows go to the train mesh once, packed as the update takes them
                (`make_train_step(...).prepare`); on them, reference logprobs of the sampled tokens,
                the old policy's when the update is not a single on-policy pass
                (`AlgorithmConfig.needs_old_logprobs`; else the update's own forward pass is the
                old policy's), and the old policy's values when the algorithm trains a critic
                (PPO); all of it stays on the device for the advantages and the update
    advantages  group-relative advantages from the `[P, G]` reward matrix, after subtracting the
                KL penalty with `kl_in_reward`; GAE for PPO (`tpurl.rl.advantage_phase`)
    update      epochs x minibatches of the jitted train step
    sync        `RolloutSide.load`: train layout -> rollout layout (and dtype), across meshes when
                disaggregated; the previous rollout weights are freed first

Memory metrics name a moment, `memory/<moment>/...`, and each moment has one name: `<phase>` is the
end of that phase (the live-array account by memory kind, `memory/<phase>/<kind>_bytes`). Colocated
steps add the handover's per-group device bytes, `memory/<moment>/<group>_device_bytes`
(`tpurl.sync.account_metrics`), at the ends of `offload` (the KV pool just allocated) and `onload`
(the parked groups back) and at three moments inside them: `offload_start`, `offload_parked` and
`onload_released`. XLA's memory analysis of the phases' compiled programs adds what the live-array
account cannot see, the temporaries while a program runs: `memory/<phase>/program_temp_bytes`
and `program_peak_bytes` (per device; `tpurl.memory`): the decode step's every step, one
logprobs pass's and the update's on the steps that compiled them or met a new packed shape; backends
with allocator stats (GPU, TPU) add their high-water mark so far, `memory/<phase>/device_peak_bytes`.

The train side's phases (logprobs, advantages, update) are `learn`, which the asynchronous step
(`tpurl.rl.async_step`, `AsyncConfig.max_staleness >= 1`) runs on batches sampled ahead, by a
rollout thread or, with `overlap="dispatch"`, by the main thread between dispatching the update
and waiting for it (`learn`'s `while_updating`, phase `sample_ahead`). Each phase blocks on its
own device results before its clock stops (`tpurl.rl.timeline`), so the phase seconds add up to
the step; the live-array accounts at the phases' ends are timed apart, as
`time/memory_account_s`. Everything random is derived from `(seed, step)`, so a run
resumed from a checkpoint repeats the uninterrupted run's steps exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import numpy as np

from tpurl.memory import (device_memory_stats, device_peak_metrics, live_bytes_by_memory_kind, program_memory,
                          program_metrics)
from tpurl.rl.advantage_phase import advantages_for_update
from tpurl.rl.batch import Rollouts, trajectory_records
from tpurl.rl.collect import Collected, collect_rollouts
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.timeline import PhaseResult, Timeline
from tpurl.sharding.host import to_host
from tpurl.sync import SyncReport
from tpurl.train.packing import take_rows
from tpurl.train.state import TrainState


@dataclasses.dataclass
class LoopState:
    """What a step reads and advances; together with the config this is what a checkpoint holds.
    (The rollout weights are the rollout side's, `RLRuntime.rollout`: derived from `train.params`.)

    `step`: RL steps done. `cursor`: index of the next training problem. `policy_version`: number
    of updates the rollout weights include (the version stamped on trajectories)."""

    train: TrainState
    ref_params: Any
    step: int
    cursor: int
    policy_version: int


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-step sampling seed derived from the run seed (no RNG state to carry or restore)."""
    return int(np.random.default_rng([seed, step, salt]).integers(0, 2**31 - 1))


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max())}


def _minibatches(rt: RLRuntime, batch: dict, step: int, ro: Rollouts):
    """`epochs x minibatches` sub-batches of the rows of `ro`, shuffled per epoch
    (`minibatch_order`, by its groups and episodes). Device arrays (the logprobs and advantages)
    are indexed on the device, host arrays on the host."""
    algo, b = rt.cfg.algorithm, batch["valid"].shape[0]
    size = b // algo.minibatches

    def sharding_for(ndim: int):
        return rt.train_layout.batch_sharding(rt.train_mesh, ndim)

    for epoch in range(algo.epochs):
        if algo.minibatches == 1:
            yield batch
            continue
        order = minibatch_order(b, ro.group_rows, algo.minibatches,
                                np.random.default_rng([rt.cfg.seed, step, 1000 + epoch]),
                                episode_rows=ro.rows_per_episode)
        for m in range(algo.minibatches):
            yield take_rows(batch, order[m * size:(m + 1) * size], sharding_for)


def minibatch_order(rows: int, group_size: int, minibatches: int, rng: np.random.Generator,
                    episode_rows: int = 1) -> np.ndarray:
    """An epoch's order of the step's rows (groups of `group_size` consecutive rows, episodes of
    `episode_rows`), cut into `minibatches` equal parts: whole groups shuffled when the groups
    divide into the minibatches (a group's samples then share their prompt in one minibatch's
    packed rows), else whole episodes (an episode's rows are one sequence of the loss)."""
    unit = episode_rows if rows % group_size or (rows // group_size) % minibatches else group_size
    if rows % unit or (rows // unit) % minibatches:
        raise ValueError(f"minibatch_order: {rows} rows are not {minibatches} minibatches of whole episodes of "
                         f"{episode_rows} rows")
    return (rng.permutation(rows // unit)[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)


def _mean_metrics(all_metrics: list[dict]) -> dict[str, float]:
    host = to_host(all_metrics)
    keys = host[0].keys()
    out = {}
    for k in keys:
        vals = np.asarray([np.asarray(m[k], np.float64) for m in host])
        if k.startswith("mismatch/ratio_") and np.isfinite(vals).any():
            vals = vals[np.isfinite(vals)]  # a minibatch without sampled tokens has no ratio
        out[k] = float(vals.max() if k.endswith("_max") else vals.min() if k.endswith("_min") else vals.mean())
    return out


def _rows(ro: Rollouts) -> dict[str, np.ndarray]:
    """The step's rows as the train side reads them (host arrays born in the rollout; a router
    replay's routes, which the trainer's passes then follow)."""
    rows = {"tokens": ro.tokens, "valid": ro.valid, "loss_mask": ro.loss_mask, "rollout_logprobs": ro.rollout_logprobs}
    return rows if ro.routes is None else {**rows, "routes": ro.routes}


def _logprobs(rt: RLRuntime, train: TrainState, ref, placed: dict):
    """The reference's logprobs of the sampled tokens, the old policy's when the update is not a
    single on-policy pass (else the update's own forward pass is the old policy's,
    `AlgorithmConfig.needs_old_logprobs`; in bypass mode the rollout's) and the old policy's values
    for a critic, all on the step's placed batch."""
    algo = rt.cfg.algorithm
    if algo.correction.bypass:  # the rollout's logprobs are the old policy's: no pass
        old_lp = placed["rollout_logprobs"]
    else:
        old_lp = rt.logprob_fn.on_batch(train.model_state(), placed)[0] if algo.needs_old_logprobs else None
    ref_lp = rt.reference_logprobs(train, ref, placed) if rt.uses_reference else None
    old_values = None if rt.value_fn is None else rt.value_fn.on_batch(train.model_state(), train.value_head, placed)
    return old_lp, ref_lp, old_values


def _update(rt: RLRuntime, train: TrainState, ro: Rollouts, placed: dict, adv_batch, old_lp, ref_lp, step: int):
    """`epochs x minibatches` train steps on the step's batch; returns the state, their metrics and
    the last minibatch (what the update's program is analysed with). With one minibatch the update
    takes the placed batch itself; several minibatches are row subsets of the host rows (packed
    anew) and of the device arrays (gathered on the device)."""
    rows = placed if rt.cfg.algorithm.minibatches == 1 else _rows(ro)
    batch = {**rows, **adv_batch}
    if old_lp is not None:  # device arrays: the logprobs never come to the host
        batch["old_logprobs"] = old_lp
    if ref_lp is not None:
        batch["ref_logprobs"] = ref_lp
    train_metrics = []
    for mb in _minibatches(rt, batch, step, ro):
        train, m = rt.train_step(train, mb)
        train_metrics.append(m)
    return train, train_metrics, mb


def step_metrics(tl: Timeline, collected: Collected, learned: Learned, report: SyncReport | None,
                 policy_version: int, *, rollout_s: float) -> dict[str, float]:
    """A step's metrics from its timeline, batch and update: `rollout_s` is the seconds its batch
    took to sample (a phase of `tl` when synchronous, the rollout thread's when asynchronous);
    `report` the sync's (None: the step synced nothing)."""
    ro, gen_tokens = collected.rollouts, collected.tokens_generated  # every round's, dropped groups included
    wall = tl.wall
    episodes = ro.episode_rows  # an episode's first row holds its final answer and its info
    metrics: dict[str, float] = {
        **tl.metrics(),
        "rollout/tokens_generated": float(gen_tokens),
        "throughput/tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
        "throughput/steps_per_hour": 3600.0 / max(wall, 1e-9),
        "rollout/stop_frac": float(np.mean([ro.finish_reasons[b] == "stop" for b in episodes])),
        # Episodes whose tool, environment or grader raised or timed out (their rewards are 0).
        "rollout/env_error_frac": float(np.mean(["error" in ro.infos[b] for b in episodes])),
        **_stats("reward/total", ro.rewards),
        **{k: v for name, comp in ro.components.items() for k, v in _stats(f"reward/{name}", comp).items()},
        **_stats("response_length", ro.completion_lengths[ro.used_rows]),
        **_stats("rollout/turns", ro.turns[episodes]),
        **{f"advantages/{k}": v for k, v in learned.adv_stats.items()},
        **({} if report is None else {"sync/bytes_moved": float(report.bytes_moved), "sync/free": float(report.free)}),
        "policy_version": float(policy_version),
        **collected.metrics,
    }
    train_means = _mean_metrics(learned.train_metrics)
    # The rollout-engine vs trainer mismatch of the sampled tokens and what the correction did,
    # measured by the update on each minibatch (`tpurl.train.correction`): the mean over minibatches,
    # the max and min over all of them.
    metrics.update({k: train_means.pop(k) for k in list(train_means) if k.startswith(("mismatch/", "correction/"))})
    metrics.update({f"train/{k}": v for k, v in train_means.items()})
    return metrics


def update_program_metrics(rt: RLRuntime, tl: Timeline, learned: Learned) -> dict[str, float]:
    """On a step that compiled new programs or met a new packed shape (compiled ahead,
    `tpurl.rl.compile_ahead`): what XLA says the logprobs pass and the update hold, from its
    caches; {} on other steps."""
    if not rt.train_step.shapes.take_met_new() and tl.compile_seconds <= 0:
        return {}
    scored = learned.scored_batch
    scoring = None if scored is None else program_memory(rt.logprob_fn.on_batch, learned.train.model_state(), scored)
    return {**program_metrics("logprobs", scoring),
            **program_metrics("update", program_memory(rt.train_step, learned.train, learned.last_minibatch))}


def ahead_wait_metrics(rt: RLRuntime) -> dict[str, float]:
    """`compile/wait_seconds`: how long the step's calls waited for the compile-ahead thread to
    finish a program they needed (`tpurl.rl.compile_ahead`; a compile the step paid for, so
    `steady_steps` leaves the step out); {} when they waited for none."""
    waited = sum(p.take_waited() for p in rt.packed_programs())
    return {"compile/wait_seconds": waited} if waited > 0 else {}


def memory_timeline(devices=None) -> tuple[Timeline, dict[str, float]]:
    """A timeline that records, at the end of every phase, the live bytes by memory kind and the
    backend's device peak where it reports one (`tpurl.memory.device_peak_metrics`); with
    `devices`, of those devices alone (one pool's: the other pool's arrays, e.g. a batch being
    sampled on another thread, are not this timeline's)."""
    ids = None if devices is None else {d.id for d in devices}
    names = None if devices is None else {str(d) for d in devices}
    memory: dict[str, float] = {}

    def account(phase: str):
        for kind, nbytes in live_bytes_by_memory_kind(ids).items():
            memory[f"memory/{phase}/{kind}_bytes"] = float(nbytes)
        stats = device_memory_stats()
        if stats is not None and names is not None:
            stats = {k: v for k, v in stats.items() if k in names}
        memory.update(device_peak_metrics(phase, stats))

    return Timeline(on_phase_end=account), memory


def _handover_phase(rt: RLRuntime, tl: Timeline, name: str):
    """The timeline phase of a colocated handover transition; without a handover (disaggregated),
    opening and closing the rollout window only allocates and frees the KV pool: no phase."""
    return tl.phase(name) if rt.rollout.handover is not None else contextlib.nullcontext(PhaseResult())


@dataclasses.dataclass
class Learned:
    """What the train side's phases of a step produce: the updated state, the per-sequence
    advantages `[B]` and their stats, the minibatches' train metrics, the last minibatch (what the
    update's program is analysed with) and the placed batch the logprobs phase scored (None: it
    ran no scoring pass)."""

    train: TrainState
    advantages: np.ndarray
    adv_stats: dict[str, float]
    train_metrics: list[dict]
    last_minibatch: dict
    scored_batch: dict | None


def learn(rt: RLRuntime, train: TrainState, ref, ro: Rollouts, step: int, tl: Timeline,
          while_updating: Callable[[Any], None] | None = None) -> Learned:
    """The train side of step `step` on its batch `ro`: phases `logprobs`, `advantages` and `update`
    of `tl`. `train` is the state the update starts from: its parameters are the old (proximal)
    policy, and `ro.rollout_logprobs` the behaviour policy's (`AlgorithmConfig.correction`).
    `while_updating(pending)`: work for the host once the update is dispatched, before waiting for
    it (phase `sample_ahead`; the update's phase is its dispatch plus the wait after); `pending`:
    the update's outputs, still being computed."""
    with tl.phase("logprobs") as res:
        placed = rt.train_step.prepare(_rows(ro))  # the step's rows go to the device once, packed
        res.value = old_lp, ref_lp, old_values = _logprobs(rt, train, ref, placed)
    with tl.phase("advantages") as res:
        # After the logprobs: the KL in the reward and GAE's values need them (tpurl.rl.advantage_phase).
        res.value = adv_batch, adv, adv_stats = advantages_for_update(
            rt.advantages_fn(ro.rewards, placed["loss_mask"], old_lp, ref_lp, old_values))
    with tl.phase("update", wait=while_updating is None) as res:
        res.value = train, train_metrics, last_mb = _update(rt, train, ro, placed, adv_batch, old_lp, ref_lp, step)
    if while_updating is not None:
        with tl.phase("sample_ahead", wait=False):
            while_updating((train, train_metrics))
        with tl.phase("update") as res:
            res.value = train, train_metrics
    return Learned(train=train, advantages=adv, adv_stats=adv_stats, train_metrics=train_metrics,
                   last_minibatch=last_mb,
                   scored_batch=placed if _scored(rt, old_lp, ref_lp) else None)


def _scored(rt: RLRuntime, old_lp, ref_lp) -> bool:
    """Whether the logprobs phase ran a scoring pass (bypass mode's old logprobs are the rollout's)."""
    return ref_lp is not None or (old_lp is not None and not rt.cfg.algorithm.correction.bypass)


def rl_step(rt: RLRuntime, state: LoopState) -> tuple[LoopState, dict[str, float], list[dict], Timeline]:
    """Run one step; returns the new state, the step's metrics, trajectory records and the timeline."""
    tl, memory = memory_timeline()
    with _handover_phase(rt, tl, "offload"):
        rt.rollout.open(state.train, state.ref_params)
    try:
        collected = collect_rollouts(rt, seed=step_seed(rt.cfg.seed, state.step), cursor=state.cursor, tl=tl)
    except BaseException:
        rt.rollout.close()  # frees the KV pool and ends the window (this step's state is not returned)
        raise
    ro = collected.rollouts
    with _handover_phase(rt, tl, "onload") as res:
        res.value = train, ref = rt.rollout.close()
    learned = learn(rt, train, ref, ro, state.step, tl)
    with tl.phase("sync") as res:
        report = rt.rollout.load(learned.train.params, version=state.policy_version + 1)
        res.value = rt.rollout.params
    tl.finish()
    metrics = {**step_metrics(tl, collected, learned, report, state.policy_version, rollout_s=tl.seconds["rollout"]),
               **memory, **rt.rollout.memory_metrics(), **program_metrics("rollout", rt.rollout.engine.decode_memory()),
               **update_program_metrics(rt, tl, learned), **ahead_wait_metrics(rt)}
    new_state = LoopState(train=learned.train, ref_params=ref, step=state.step + 1, cursor=collected.cursor,
                          policy_version=state.policy_version + 1)
    return new_state, metrics, trajectory_records(ro, learned.advantages), tl
