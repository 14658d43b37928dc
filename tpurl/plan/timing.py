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

A LoRA model (rank R; `tpurl.models.lora`) adds its adapters' path to every forward that runs
them, 2 R (fan_in + fan_out) FLOPs per target per token per layer (`x @ A`, then `(x @ A) @ B`:
`2 x ModelConfig.adapter_params()` per token); a side whose activations the t tensor-parallel ways
do not split (the residual stream's) runs on each of them and counts t times. It trains the
adapters alone:

    update                    base matmuls: forward + activation gradients, 2x (no weight
                              gradients of the frozen base); attention 3x (both operands of its
                              products are activations); adapters 3x; +1 forward of each with remat
    optimizer                 AdamW's bytes over the adapters (the trained parameters) only
    logprobs                  old policy (and the critic): the adapted model; reference: the base
    decode, prefill           the rollout model's (`RunSpec.rollout_model`): merged, the base model
                              on merged weights; unmerged, base + the adapters' FLOPs; bytes read =
                              the rollout params (base, + adapters when unmerged)
    sync                      what moves each step, through `sync_cost` as above: merged, the
                              targeted projections (merged inside the resharding, 2 R fan_in
                              fan_out FLOPs per target per layer in fp32, counted at the forward
                              rate, then cast and moved at the rollout dtype); unmerged, the
                              adapters. The base's other weights move once at the start (not
                              per step)

A mixture-of-experts model (`ModelConfig.moe`: Ls sparse layers of E experts of width G, X per
token) computes only the experts each token chose, and reads the weights of every expert some
token of the step chose:

    P                         per sparse layer the router D E and the X active experts' 3 D G each
                              (not all E: the other experts compute nothing for the token); the
                              dense layers' 3 D F
    decode bytes read         the rollout params less the experts no live token of the step chose:
                              with B tokens per step per replica each choosing X of E experts
                              (taken as independent, uniform picks: a balanced router), an expert
                              is untouched with probability (1 - X/E)^B, so the distinct experts
                              read are E (1 - (1 - X/E)^B): nearly all of them once B >> E / X
    expert exchange           with the experts split over e devices (expert parallelism: the
                              rollout layouts shard `experts` over the tensor axes), each token's
                              X routed copies of its hidden state (D elements, compute dtype) go to
                              the devices holding their experts and the outputs come back (a
                              dispatch and a combine all-to-all), per sparse layer; tokens and
                              experts spread evenly over the e devices, so each receives
                              2 Ls B X D c (e - 1) / e^2 bytes per decode step (B tokens) and the
                              same for the prompt tokens of a prefill, at the chip link's rate,
                              added to the step (not overlapped). The FSDP train layouts gather
                              the experts at use: no exchange in the update
    sync                      every expert's bytes (as any parameter)

A phase's work is spread evenly over the devices that run it. Tests compare the FLOPs with
XLA's `cost_analysis()` of the compiled programs at small size.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from tpurl.models.config import ModelConfig
from tpurl.models.lora import PROJECTIONS, fans
from tpurl.plan.hardware import Chip
from tpurl.plan.job import PlanJob
from tpurl.plan.memory import (TENSOR_AXES, KVPlan, expert_parallel_ways, rollout_dtype_bytes, rollout_expert_bytes,
                               synced_state, tensor_ways)
from tpurl.sharding.cost import DeviceGrid, sync_cost


def active_expert_params(m: ModelConfig) -> int:
    """A mixture-of-experts model's expert parameters that take part in a token's matmuls: the X
    experts it chose in every sparse layer, 3 D G each (0 for a dense model)."""
    if m.moe is None:
        return 0
    return m.layer_kinds.count("moe") * m.moe.experts_per_token * 3 * m.hidden_size * m.moe.intermediate_size


def mlp_matmul_params(m: ModelConfig) -> int:
    """The MLPs' parameters that take part in a token's matmuls: every dense layer's 3 D F, and
    every sparse layer's router (D E) and active experts (`active_expert_params`)."""
    dense = m.layer_kinds.count("dense") * 3 * m.hidden_size * m.intermediate_size
    if m.moe is None:
        return dense
    router = m.layer_kinds.count("moe") * m.hidden_size * m.moe.num_experts
    return dense + router + active_expert_params(m)


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's projections (a sparse layer's
    router and active experts: `mlp_matmul_params`) and the unembedding."""
    d, n, k, h = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    return m.num_layers * (d * (n + 2 * k) * h + n * h * d) + mlp_matmul_params(m) + d * m.vocab_size


def active_params(m: ModelConfig) -> int:
    """Parameters a token uses (`ModelConfig.num_params` for a dense model): a mixture of experts'
    without the E - X experts each sparse layer leaves out for it."""
    if m.moe is None:
        return m.num_params()
    idle = m.moe.num_experts - m.moe.experts_per_token
    return m.num_params() - m.layer_kinds.count("moe") * idle * 3 * m.hidden_size * m.moe.intermediate_size


def untouched_expert_fraction(m: ModelConfig, tokens: float) -> float:
    """The expected fraction of a sparse layer's experts that none of `tokens` tokens chose (0 for
    a dense model): each token picks X of the E experts, taken as independent uniform picks (a
    balanced router), so an expert is left untouched with probability (1 - X/E)^tokens."""
    if m.moe is None:
        return 0.0
    return (1.0 - m.moe.experts_per_token / m.moe.num_experts) ** tokens


def expert_exchange_bytes(job: PlanJob, tokens: float) -> float:
    """Bytes into each rollout device that expert parallelism moves for `tokens` tokens of one
    replica through every sparse layer (0 for a dense model, or where the rollout layout does not
    split the experts): each token's X routed copies (D elements in the compute dtype) go to the
    e devices holding their experts and come back, `2 Ls tokens X D c (e - 1) / e^2` (see the
    module docstring)."""
    m = job.spec.rollout_model
    if m.moe is None:
        return 0.0
    e = expert_parallel_ways(job.cfg.rollout_layout, job.rollout_mesh, m.moe.num_experts)
    copies = m.layer_kinds.count("moe") * tokens * m.moe.experts_per_token
    return 2.0 * copies * m.hidden_size * jnp.dtype(m.dtype).itemsize * (e - 1) / e**2


def attention_flops(m: ModelConfig, rows: int, seq_len: int) -> float:
    """FLOPs of the dense attention's two products over `rows` padded rows of `seq_len` tokens (the
    causal query blocks' fraction of the scores)."""
    from tpurl.models.attention import causal_blocked_fraction

    tokens = rows * seq_len
    keys = seq_len * causal_blocked_fraction(seq_len, seq_len, m.attention_query_blocks)
    return 4.0 * m.num_layers * m.num_heads * m.head_dim * keys * tokens


def adapter_flops(m: ModelConfig, rows: int | float, seq_len: int, t: int = 1) -> float:
    """FLOPs of a LoRA model's adapter paths in a forward pass over `rows` rows of `seq_len` tokens
    (0 without LoRA), as the devices compute them: `x @ A`, 2 R fan_in, and `(x @ A) @ B`, 2 R
    fan_out, per target per token per layer. A side whose activations the `t` tensor-parallel ways
    do not split (the residual stream: `x @ A` of q/k/v/gate/up, `(x @ A) @ B` of o/down; the rank
    is never split) is computed on each of the t devices, so it counts t times."""
    if m.lora is None:
        return 0.0
    shapes, per_token = m.projection_shapes(), 0
    for target in m.lora.targets:
        for axes, width in zip(PROJECTIONS[target], fans(target, shapes[target])):
            per_token += width * (1 if set(axes) & set(TENSOR_AXES) else t)
    return 2.0 * m.lora.rank * m.num_layers * per_token * (rows * seq_len)


def forward_flops(m: ModelConfig, rows: int, seq_len: int, t: int = 1) -> float:
    """FLOPs of a forward pass (with the unembedding, and a LoRA model's adapters on `t`
    tensor-parallel ways: `adapter_flops`) over `rows` padded rows of `seq_len` tokens."""
    tokens = rows * seq_len
    flops = 2.0 * matmul_params(m) * tokens + attention_flops(m, rows, seq_len)
    if m.lora is not None:
        flops += adapter_flops(m, rows, seq_len, t)
    return flops


def update_flops(job: PlanJob) -> float:
    """FLOPs of one step's update (all devices): forward + backward (2x forward) over the batch per
    epoch, plus a forward recompute under remat. A LoRA model's frozen base has no weight
    gradients: its matmuls cost forward + activation gradients (2x), its attention and adapters 3x
    (see the module docstring)."""
    m, remat = job.model, (1.0 if job.model.remat != "none" else 0.0)
    rows, seq_len = job.updated_rows, job.seq_len
    if m.lora is None:
        return job.cfg.algorithm.epochs * (3.0 + remat) * forward_flops(m, rows, seq_len)
    matmuls = 2.0 * matmul_params(m) * (rows * seq_len)
    trained = attention_flops(m, rows, seq_len) + adapter_flops(m, rows, seq_len, train_tensor_ways(job))
    return job.cfg.algorithm.epochs * ((2.0 + remat) * matmuls + (3.0 + remat) * trained)


def train_tensor_ways(job: PlanJob) -> int:
    """The train layout's tensor-parallel ways (`tpurl.plan.memory.tensor_ways`)."""
    return tensor_ways(job.cfg.train_layout, job.train_mesh)


def rollout_tensor_ways(job: PlanJob) -> int:
    """The rollout layout's tensor-parallel ways."""
    return tensor_ways(job.cfg.rollout_layout, job.rollout_mesh)


def scoring_models(job: PlanJob) -> list[ModelConfig]:
    """The model each scoring pass runs: the trained one for the old policy's logprobs and the
    critic's values, and for the reference the trained one at its start (a LoRA run's: the base)."""
    algo, m = job.cfg.algorithm, job.model
    reference = m.replace(lora=None) if job.spec.reference == "base" else m
    return ([m] * int(algo.needs_old_logprobs) + [reference] * int(algo.uses_reference)
            + [m] * int(algo.uses_critic))


def scoring_passes(job: PlanJob) -> int:
    return len(scoring_models(job))


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Seconds per phase; `detail` keeps the parts (decode, prefill, optimizer, ...)."""

    seconds: dict[str, float]
    detail: dict[str, float]


def rollout_seconds(job: PlanJob, kv: KVPlan, rollout_param_bytes: int, chip: Chip) -> dict[str, float]:
    """Decode (bytes- or compute-bound per step, plus launch and a mixture of experts' exchange)
    and prefill of one step's batch, on the rollout model (`RunSpec.rollout_model`: a LoRA model's
    base when its adapters are merged); a decode step reads only the experts its tokens chose."""
    m, e, rm = job.model, job.engine, job.spec.rollout_model
    batch = job.cfg.batch_size
    live = max(1, min(kv.sequences, batch))
    waves = math.ceil(batch / live)
    devices_per_replica = job.n_rollout // kv.replicas
    per_replica = live / kv.replicas
    kv_token_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * jnp.dtype(e.cache_dtype or m.dtype).itemsize
    context = job.prompt_len + job.new_tokens / 2
    untouched = rollout_expert_bytes(job) * untouched_expert_fraction(rm, per_replica)
    read = rollout_param_bytes - untouched + per_replica * context * kv_token_bytes / kv.kv_shards
    flops = (2.0 * matmul_params(rm) + 4.0 * m.num_layers * m.num_heads * m.head_dim * context) * per_replica
    if rm.lora is not None:  # unmerged adapters: their path on every decoded token
        flops += adapter_flops(rm, per_replica, 1, rollout_tensor_ways(job))
    exchange = expert_exchange_bytes(job, per_replica)
    step = max(read / chip.hbm_bandwidth, flops / devices_per_replica / chip.forward_rate)
    step += exchange / chip.link_bandwidth
    steps = waves * job.new_tokens
    prompts = batch // job.cfg.group_size
    prefill_flops = forward_flops(rm, prompts, job.prompt_len, rollout_tensor_ways(job)) / job.n_rollout
    prefill_calls = math.ceil(prompts / e.max_prefill_batch)
    prefill_exchange = expert_exchange_bytes(job, prompts * job.prompt_len / kv.replicas) / chip.link_bandwidth
    return {"decode": steps * (step + chip.step_overhead_s + per_replica * chip.decode_slot_s),
            "prefill": (prefill_flops / chip.forward_rate + prefill_exchange + prefill_calls * chip.step_overhead_s
                        + batch * chip.sequence_s),
            "decode_steps": float(steps), "decode_step_bytes": float(read),
            "decode_step_exchange_bytes": exchange,
            "decode_experts_read": 1.0 - untouched_expert_fraction(rm, per_replica)}


def merge_flops(job: PlanJob) -> float:
    """FLOPs of one sync's merges with merged LoRA adapters (all devices): `A @ B`, 2 R fan_in fan_out
    per target per layer; 0 otherwise."""
    m = job.model
    if job.spec.adapters != "merged":
        return 0.0
    shapes = m.projection_shapes()
    return 2.0 * m.lora.rank * m.num_layers * sum(math.prod(shapes[t]) for t in m.lora.targets)


def sync_seconds(job: PlanJob, chip: Chip) -> tuple[float, int]:
    """The train -> rollout resharding of what each step's sync moves (`tpurl.plan.memory.synced_state`:
    every trained parameter, or a LoRA run's merged projections or adapters): `(seconds, bytes into the
    busiest device)`."""
    moving = synced_state(job)
    src = job.cfg.train_layout.placements(moving, job.train_mesh)
    dst = job.cfg.rollout_layout.placements(moving, job.rollout_mesh)
    grid_dst = DeviceGrid.of(job.rollout_mesh, first_id=0 if job.colocated else job.n_train)
    cost = sync_cost(src, dst, DeviceGrid.of(job.train_mesh), grid_dst, dst_dtype=job.cfg.sync.rollout_dtype)
    # Every leaf is copied when the dtype changes, or when it is computed (a merged LoRA weight);
    # otherwise a leaf whose sharding is the same in both layouts (on the same devices) is passed
    # through, free.
    merged = job.spec.adapters == "merged"
    casts = merged or job.cfg.sync.quantize is not None or job.cfg.sync.copies_every_leaf(job.model.param_dtype)
    copied = [q for p, q in zip(src, dst) if casts or not job.colocated or p.spec != q.spec]
    if not copied:
        return chip.sync_host_s, 0
    share = sum(q.bytes_per_device for q in copied) / max(1, sum(q.bytes_per_device for q in dst))
    # Read the source shard, write the copy.
    local = 2 * share * rollout_dtype_bytes(dst, job.cfg.sync) / chip.hbm_bandwidth
    seconds = cost.max_device_bytes / chip.link_bandwidth + local + chip.sync_host_s
    if merged:
        seconds += merge_flops(job) / job.n_train / chip.forward_rate
    return seconds, cost.max_device_bytes


def phase_times(job: PlanJob, chip: Chip, state: dict[str, int], kv: KVPlan, parked_bytes: int) -> PhaseTimes:
    """Predicted seconds of `rollout`, `logprobs`, `update`, `sync` (and `offload`/`onload` when
    colocated) on `chip`."""
    algo = job.cfg.algorithm
    rate = chip.peak_flops * chip.efficiency
    ro = rollout_seconds(job, kv, state["rollout_params"], chip)
    t = train_tensor_ways(job)
    logprobs = sum((forward_flops(m, job.scored_rows, job.seq_len, t) / job.n_train / chip.forward_rate
                    + chip.step_overhead_s for m in scoring_models(job)), 0.0)
    opt_steps = algo.epochs * algo.minibatches
    # AdamW reads params, gradients and both moments and writes params and moments (the trained
    # parameters': a LoRA run's adapters).
    opt_bytes = 7 * state["master_params"] if job.cfg.optimizer.optimizer == "adamw" else 3 * state["master_params"]
    update_compute = update_flops(job) / job.n_train / rate
    update_opt = opt_steps * (opt_bytes / chip.hbm_bandwidth + chip.step_overhead_s)
    sync_s, sync_bytes = sync_seconds(job, chip)
    seconds = {"rollout": ro["decode"] + ro["prefill"], "logprobs": logprobs, "update": update_compute + update_opt,
               "sync": sync_s}
    if job.colocated:
        seconds["offload"] = seconds["onload"] = parked_bytes / chip.host_bandwidth
    detail = {**ro, "update_compute": update_compute, "update_optimizer": update_opt,
              "update_flops": update_flops(job), "sync_bytes_max_device": float(sync_bytes)}
    return PhaseTimes(seconds=seconds, detail=detail)
