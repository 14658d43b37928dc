"""Predicted seconds of each phase of an RL step (`tpurl plan`), from FLOPs and bytes per device.

Letters as in `tpurl.plan.memory`; P the matmul parameters (every projection and the unembedding).

    forward FLOPs per token   2 P + 4 L N H T f          (dense attention over the padded row; f the
                                                          fraction its causal query blocks compute)
    update                    3x forward (+1 forward with remat), epochs x the whole batch
                              (with packing and an expected response length: its packed rows)
    logprobs                  1 forward per scoring pass (old policy, reference), same rows
    decode step               max(bytes read / HBM bandwidth, FLOPs / (peak x forward efficiency))
                              + launch + live sequences x per-sequence cost (measured on cpu)
                              bytes read = rollout params + the live sequences' KV
    prefill                   2 P x prompt tokens (one prefill per group) / (peak x forward efficiency)
    sync                      bytes into the busiest device / chip link + the local cast / HBM
                              + the host's work (even a free sync compares every leaf's
                              layouts and waits for it; measured on cpu)
    offload, onload           parked bytes / host link (colocated only)

A phase's work is spread evenly over the devices that run it. Tests compare the FLOPs with
XLA's `cost_analysis()` of the compiled programs at small size.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from tpurl.models.config import ModelConfig
from tpurl.plan.hardware import Chip
from tpurl.plan.job import PlanJob
from tpurl.plan.memory import KVPlan
from tpurl.sharding.cost import DeviceGrid, sync_cost


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and the unembedding."""
    d, f, n, k, h = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    return m.num_layers * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + d * m.vocab_size


def forward_flops(m: ModelConfig, rows: int, seq_len: int) -> float:
    """FLOPs of a forward pass (with the unembedding) over `rows` padded rows of `seq_len` tokens."""
    from tpurl.models.attention import causal_blocked_fraction

    tokens = rows * seq_len
    keys = seq_len * causal_blocked_fraction(seq_len, seq_len, m.attention_query_blocks)
    return 2.0 * matmul_params(m) * tokens + 4.0 * m.num_layers * m.num_heads * m.head_dim * keys * tokens


def update_flops(job: PlanJob) -> float:
    """FLOPs of one step's update (all devices): forward + backward (2x forward) over the batch per
    epoch, plus a forward recompute under remat."""
    factor = 3.0 + (1.0 if job.model.remat != "none" else 0.0)
    return job.cfg.algorithm.epochs * factor * forward_flops(job.model, job.updated_rows, job.seq_len)


def scoring_passes(job: PlanJob) -> int:
    algo = job.cfg.algorithm
    return int(algo.needs_old_logprobs) + int(algo.uses_reference) + int(algo.uses_critic)


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Seconds per phase; `detail` keeps the parts (decode, prefill, optimizer, ...)."""

    seconds: dict[str, float]
    detail: dict[str, float]


def rollout_seconds(job: PlanJob, kv: KVPlan, rollout_param_bytes: int, chip: Chip) -> dict[str, float]:
    """Decode (bytes- or compute-bound per step, plus launch) and prefill of one step's batch."""
    m, e = job.model, job.engine
    batch = job.cfg.batch_size
    live = max(1, min(kv.sequences, batch))
    waves = math.ceil(batch / live)
    devices_per_replica = job.n_rollout // kv.replicas
    per_replica = live / kv.replicas
    kv_token_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * jnp.dtype(e.cache_dtype or m.dtype).itemsize
    context = job.prompt_len + job.new_tokens / 2
    read = rollout_param_bytes + per_replica * context * kv_token_bytes / kv.kv_shards
    flops = (2.0 * matmul_params(m) + 4.0 * m.num_layers * m.num_heads * m.head_dim * context) * per_replica
    step = max(read / chip.hbm_bandwidth, flops / devices_per_replica / chip.forward_rate)
    steps = waves * job.new_tokens
    prompts = batch // job.cfg.group_size
    prefill_flops = forward_flops(m, prompts, job.prompt_len) / job.n_rollout
    prefill_calls = math.ceil(prompts / e.max_prefill_batch)
    return {"decode": steps * (step + chip.step_overhead_s + per_replica * chip.decode_slot_s),
            "prefill": prefill_flops / chip.forward_rate + prefill_calls * chip.step_overhead_s + batch * chip.sequence_s,
            "decode_steps": float(steps), "decode_step_bytes": float(read)}


def sync_seconds(job: PlanJob, chip: Chip, rollout_param_bytes: int) -> tuple[float, int]:
    """The train -> rollout resharding: `(seconds, bytes into the busiest device)`."""
    from flax import nnx

    from tpurl.models.transformer import abstract_model

    params = nnx.state(abstract_model(job.model), nnx.Param)
    src = job.cfg.train_layout.placements(params, job.train_mesh)
    dst = job.cfg.rollout_layout.placements(params, job.rollout_mesh)
    grid_dst = DeviceGrid.of(job.rollout_mesh, first_id=0 if job.colocated else job.n_train)
    cost = sync_cost(src, dst, DeviceGrid.of(job.train_mesh), grid_dst, dst_dtype=job.cfg.sync.rollout_dtype)
    # Every leaf is copied when the dtype changes; otherwise a leaf whose sharding is the same in
    # both layouts (on the same devices) is passed through, free.
    casts = job.cfg.sync.copies_every_leaf(job.model.param_dtype)
    copied = [q for p, q in zip(src, dst) if casts or not job.colocated or p.spec != q.spec]
    if not copied:
        return chip.sync_host_s, 0
    share = sum(q.bytes_per_device for q in copied) / max(1, sum(q.bytes_per_device for q in dst))
    local = 2 * share * rollout_param_bytes / chip.hbm_bandwidth  # read the source shard, write the copy
    return cost.max_device_bytes / chip.link_bandwidth + local + chip.sync_host_s, cost.max_device_bytes


def phase_times(job: PlanJob, chip: Chip, state: dict[str, int], kv: KVPlan, parked_bytes: int) -> PhaseTimes:
    """Predicted seconds of `rollout`, `logprobs`, `update`, `sync` (and `offload`/`onload` when
    colocated) on `chip`."""
    algo = job.cfg.algorithm
    rate = chip.peak_flops * chip.efficiency
    ro = rollout_seconds(job, kv, state["rollout_params"], chip)
    passes = scoring_passes(job)
    logprobs = passes * (forward_flops(job.model, job.scored_rows, job.seq_len) / job.n_train / chip.forward_rate
                         + chip.step_overhead_s)
    opt_steps = algo.epochs * algo.minibatches
    # AdamW reads params, gradients and both moments and writes params and moments.
    opt_bytes = 7 * state["master_params"] if job.cfg.optimizer.optimizer == "adamw" else 3 * state["master_params"]
    update_compute = update_flops(job) / job.n_train / rate
    update_opt = opt_steps * (opt_bytes / chip.hbm_bandwidth + chip.step_overhead_s)
    sync_s, sync_bytes = sync_seconds(job, chip, state["rollout_params"])
    seconds = {"rollout": ro["decode"] + ro["prefill"], "logprobs": logprobs, "update": update_compute + update_opt,
               "sync": sync_s}
    if job.colocated:
        seconds["offload"] = seconds["onload"] = parked_bytes / chip.host_bandwidth
    detail = {**ro, "update_compute": update_compute, "update_optimizer": update_opt,
              "update_flops": update_flops(job), "sync_bytes_max_device": float(sync_bytes)}
    return PhaseTimes(seconds=seconds, detail=detail)
