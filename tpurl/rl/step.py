"""One RL step as timed phases: rollout -> rewards -> logprobs -> advantages -> update -> sync.

    offload     (colocated) optimizer state (and optionally reference / master weights) to host, then
                the handover allocates the KV pool in the memory they left and accounts for it
    rollout     the engine samples G completions per prompt in the rollout layout (the KV pool
                lives from the offload to the onload)
    reward      the task scores every completion; all components kept (DAPO's dynamic sampling
                repeats rollout + reward until the batch is full of informative groups)
    onload      (colocated) KV pool verified released, parked tensors back on device
    logprobs    reference logprobs of the sampled tokens (train layout), the old policy's when the
                update is not a single on-policy pass (`AlgorithmConfig.needs_old_logprobs`; else
                the update's own forward pass is the old policy's), and the old policy's values
                when the algorithm trains a critic (PPO)
    advantages  group-relative advantages from the `[P, G]` reward matrix, after subtracting the
                KL penalty with `kl_in_reward`; GAE for PPO (`tpurl.rl.shaping`)
    update      epochs x minibatches of the jitted train step
    sync        train layout -> rollout layout (and dtype), across meshes when disaggregated; the
                previous rollout weights are freed first (except leaves a free sync passed through)

Colocated steps log the handover's per-group device bytes, `memory/<phase>/<group>_device_bytes`
(`tpurl.sync.account_metrics`), e.g. `memory/rollout/kv_pool_device_bytes` while the pool is alive.

Each phase blocks on its own device results before its clock stops (`tpurl.rl.timeline`), so the
phase seconds add up to the step. Everything random is derived from `(seed, step)`, so a run
resumed from a checkpoint repeats the uninterrupted run's steps exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from tpurl.rl.batch import Rollouts, trajectory_records
from tpurl.rl.dynamic import collect_rollouts
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.shaping import advantages_to_host
from tpurl.rl.timeline import Timeline
from tpurl.sync import account_metrics, delete_unshared, live_bytes_by_memory_kind
from tpurl.train.state import TrainState


@dataclasses.dataclass
class LoopState:
    """What a step reads and advances; together with the config this is what a checkpoint holds.

    `step`: RL steps done. `cursor`: index of the next training problem. `policy_version`: number
    of updates the rollout weights include (the version stamped on trajectories)."""

    train: TrainState
    ref_params: Any
    rollout_params: Any
    step: int
    cursor: int
    policy_version: int


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-step sampling seed derived from the run seed (no RNG state to carry or restore)."""
    return int(np.random.default_rng([seed, step, salt]).integers(0, 2**31 - 1))


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max())}


def _minibatches(rt: RLRuntime, batch: dict[str, np.ndarray], step: int):
    """`epochs x minibatches` sub-batches, rows shuffled per epoch (groups stay whole within a
    minibatch when the minibatch size is a multiple of G; it need not be)."""
    algo, b = rt.cfg.algorithm, batch["tokens"].shape[0]
    size = b // algo.minibatches
    for epoch in range(algo.epochs):
        order = np.arange(b)
        if algo.minibatches > 1:
            order = np.random.default_rng([rt.cfg.seed, step, 1000 + epoch]).permutation(b)
        for m in range(algo.minibatches):
            rows = order[m * size:(m + 1) * size]
            yield {k: v[rows] for k, v in batch.items()}


def _mean_metrics(all_metrics: list[dict]) -> dict[str, float]:
    host = jax.device_get(all_metrics)
    keys = host[0].keys()
    out = {}
    for k in keys:
        vals = np.asarray([np.asarray(m[k], np.float64) for m in host])
        out[k] = float(vals.max() if k.endswith("_max") else vals.min() if k.endswith("_min") else vals.mean())
    return out


def rl_step(rt: RLRuntime, state: LoopState) -> tuple[LoopState, dict[str, float], list[dict], Timeline]:
    """Run one step; returns the new state, the step's metrics, trajectory records and the timeline."""
    cfg = rt.cfg
    memory: dict[str, float] = {}

    def account(phase: str):
        for kind, nbytes in live_bytes_by_memory_kind().items():
            memory[f"memory/{phase}/{kind}_bytes"] = float(nbytes)

    tl = Timeline(on_phase_end=account)
    train, ref = state.train, state.ref_params

    decode_state = None
    offload_master = rt.handover is not None and rt.handover.cfg.offload_master_params
    if rt.handover is not None:
        with tl.phase("offload") as res:
            # The handover parks the update-only tensors, then allocates the KV pool in the memory they
            # left (and accounts for it while it is alive: `rt.handover.accounts`).
            decode_state = rt.handover.start_rollout(
                opt_state=train.opt_state, master_params=train.params if offload_master else None,
                reference_params=ref if rt.uses_reference else None, kv_factory=rt.engine.init_decode_state,
                # A (partly) free sync passes train params through as rollout params: those must stay.
                protect={"rollout_params": state.rollout_params})
            res.value = decode_state
    # The rollout and reward phases; DAPO's dynamic sampling repeats them (tpurl.rl.dynamic). Scoring
    # is host work, so it runs before the onload, as do the extra rounds (which need the KV pool).
    # The decode state is donated to the engine on first use; only the handover keeps track of it.
    collected = collect_rollouts(rt, state.rollout_params, seed=step_seed(cfg.seed, state.step), cursor=state.cursor,
                                 tl=tl, decode_state=decode_state)
    ro: Rollouts = collected.rollouts
    completions, cursor = collected.completions, collected.cursor
    if rt.handover is not None:
        with tl.phase("onload") as res:
            # Deletes whatever of the pool is still referenced and checks that none of it survives.
            restored = rt.handover.start_update(kv_pool=decode_state)
            decode_state = None
            if "opt_state" in restored:
                train = train.replace(opt_state=restored["opt_state"])
            if "master_params" in restored:
                train = train.replace(params=restored["master_params"])
            ref = restored.get("reference_params", ref)
            res.value = restored
        memory.update(account_metrics(rt.handover.accounts))
    with tl.phase("logprobs") as res:
        # On-policy (one epoch of one minibatch) the update's own forward pass is the old policy's
        # (`AlgorithmConfig.needs_old_logprobs`), and it also measures the rollout mismatch.
        old_lp = rt.logprob_fn(train.params, ro.tokens, ro.valid)[0] if cfg.algorithm.needs_old_logprobs else None
        ref_lp = rt.logprob_fn(ref, ro.tokens, ro.valid)[0] if rt.uses_reference else None
        old_values = None if rt.value_fn is None else rt.value_fn(train.params, train.value_head, ro.tokens, ro.valid)
        res.value = (old_lp, ref_lp, old_values)
    with tl.phase("advantages") as res:
        # After the logprobs: the KL in the reward and GAE's values need them (tpurl.rl.shaping).
        adv_batch, adv, adv_stats = advantages_to_host(
            rt.advantages_fn(ro.rewards, ro.loss_mask, old_lp, ref_lp, old_values))
        res.value = adv_batch
    with tl.phase("update") as res:
        batch = {"tokens": ro.tokens, "valid": ro.valid, "loss_mask": ro.loss_mask, **adv_batch,
                 "rollout_logprobs": ro.rollout_logprobs}
        if old_lp is not None:
            batch["old_logprobs"] = np.asarray(old_lp)
        if ref_lp is not None:
            batch["ref_logprobs"] = np.asarray(ref_lp)
        train_metrics = []
        for mb in _minibatches(rt, batch, state.step):
            train, m = rt.train_step(train, mb)
            train_metrics.append(m)
        res.value = (train, train_metrics)
    with tl.phase("sync") as res:
        # Free the previous rollout weights first, so that the sync never holds two copies of them,
        # except the leaves a (partly) free sync passed through: those are train params.
        delete_unshared(state.rollout_params, keep=(state.train.params, train.params))
        rollout_params, report = rt.sync(train.params)
        res.value = rollout_params
    wall = tl.finish()

    gen_tokens = collected.tokens_generated  # every round's, dropped groups included
    metrics: dict[str, float] = {**tl.metrics(), **memory}
    metrics.update({
        "rollout/tokens_generated": float(gen_tokens),
        "throughput/tokens_per_s": gen_tokens / max(tl.seconds["rollout"], 1e-9),
        "throughput/steps_per_hour": 3600.0 / max(wall, 1e-9),
        "rollout/stop_frac": float(np.mean([r == "stop" for r in ro.finish_reasons])),
        **_stats("reward/total", ro.rewards),
        **{k: v for name, comp in ro.components.items() for k, v in _stats(f"reward/{name}", comp).items()},
        **_stats("response_length", ro.completion_lengths),
        **{f"advantages/{k}": v for k, v in adv_stats.items()},
        "sync/bytes_moved": float(report.bytes_moved), "sync/free": float(report.free),
        "policy_version": float(state.policy_version),
        **collected.metrics,
    })
    train_means = _mean_metrics(train_metrics)
    # The rollout-engine vs trainer mismatch of the sampled tokens, measured by the update against
    # the old policy (mean over minibatches of each one's token mean; max over all tokens).
    metrics.update({"mismatch/abs_diff_mean": train_means.pop("rollout_abs_diff_mean"),
                    "mismatch/abs_diff_max": train_means.pop("rollout_abs_diff_max"),
                    "mismatch/kl": train_means.pop("rollout_kl")})
    metrics.update({f"train/{k}": v for k, v in train_means.items()})
    records = trajectory_records(ro, adv, completions, group_offset=state.cursor, group_ids=collected.group_ids)
    new_state = LoopState(train=train, ref_params=ref, rollout_params=rollout_params, step=state.step + 1,
                          cursor=cursor, policy_version=state.policy_version + 1)
    return new_state, metrics, records, tl
