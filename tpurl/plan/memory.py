"""Device memory of an RL run, per device and per phase, by component (`tpurl plan`).

Letters: B sequences per step, b rows per device in one micro-batch, T sequence length (prompt +
response), D hidden size, F MLP size, N query heads, K kv heads, H head_dim, V vocab, L layers,
t the tensor-parallel ways of heads/MLP, S page size, R a LoRA model's adapter rank; a
mixture-of-experts model's Ls sparse layers, E experts, X experts per token, G an expert's MLP width.

Exact components (tests compare them with the real arrays' shard bytes): the fp32 master params
and the rollout params are the layouts' placements (`tpurl.sharding.cost`); the optimizer state is
`tpurl.train.state.abstract_train_state` on an `AbstractMesh`; the KV pool is sized as the engine
sizes it (`num_pages` per replica pool, pages over the slots' data replicas, kv heads over the
layout's tensor axes). Estimated components: the update's temporaries (gradients, the optimizer's
update tree, gathered FSDP weights, activations under the model's `remat`, a chunk of logits),
within 1.5x of XLA's `memory_analysis()` at small size (test), and the scoring pass's.

A LoRA model (`ModelConfig.lora`: rank R on the targeted projections) trains its adapters alone
(`tpurl.train.state.trained_and_frozen`), so every component follows the run's split of the
parameters: `master_params`, `optimizer_state`, `gradients` and `optimizer_update` are the
adapters' (fp32, train layout; plus PPO's value head); `frozen_params` is the base in
`LoraConfig.base_dtype` in the train layout, on the train devices in every phase (never parked);
`reference_params` is 0 when the reference policy is the base (adapters that start new) and the
adapters' bytes when it is a copy of trained starting adapters (`RunSpec.reference`);
`rollout_params` is the rollout model's (`RunSpec.rollout_model`: the base when the adapters are
merged, base + adapters when not) at the sync's rollout dtype (with `SyncConfig.quantize`, the
quantized weights at one byte and their scales at four); `published_params` is what the
trainer publishes per version (the adapters at the rollout dtype, in the train layout: a merged
rollout merges them at load). The activations add the adapters' path, R elements per target per
token per layer (`x @ A`), and under `remat="dots"` also each target's low-rank output (a matmul
output kept for the sum).

A mixture-of-experts model (`ModelConfig.moe`: E experts of width G, X of them per token, on the
sparse layers; `tpurl.models.moe`) holds every expert in every component that holds weights
(master, optimizer state, gradients, reference, rollout, published: the placements of the real
parameter tree, the experts sharded as the layouts shard `experts` and `expert_mlp`). A sparse
layer's activations replace the dense MLP's by the router's float32 logits (E per token), the X
routed copies of each token's hidden state (X D) and the experts' gate, up and product (X 3 G, over
the tensor ways of `expert_mlp`); under `remat="dots"` only the router's logits are kept (the
experts' grouped matmuls are `ragged_dot`s, which that policy does not save). The gathered weights
of one layer are the largest layer's: a sparse layer's are all its experts in their compute
sharding (the FSDP layouts gather every expert at use).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from tpurl.generate import kv_cache
from tpurl.models.config import ModelConfig
from tpurl.models import quant
from tpurl.models.lora import PROJECTIONS, fans, targeted_split
from tpurl.models.moe import EXPERT_NAMES
from tpurl.models.transformer import abstract_model, stack_kind
from tpurl.plan.job import PlanJob
from tpurl.sharding.cost import layout_bytes_per_device
from tpurl.sharding.layout import entry_axes
from tpurl.sync.quantize import is_quantized
from tpurl.sync.reshard import rollout_dtype_of
from tpurl.train.logprobs import DEFAULT_CHUNK
from tpurl.train.state import abstract_train_state, trained_and_frozen

# Decode-state arrays per slot besides the pool (`Engine._slot_fields`): 8 four-byte scalars and
# one bool, the stop ids and the page table (int32).
SLOT_SCALARS = 8


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """The paged pool: `num_pages` per replica pool, `replicas` pools, `bytes_per_device` (K and V),
    `pages_per_sequence` of a whole request, and `sequences` it holds at once (every sample with
    its own pages: group sharing of full prompt pages only adds room)."""

    num_pages: int
    replicas: int
    kv_shards: int
    pages_per_sequence: int
    bytes_per_device: int
    slot_bytes: int
    sequences: int


def _ways(spec: P, sizes: dict[str, int], dim: int) -> int:
    entry = spec[dim] if len(spec) > dim else None
    return math.prod(sizes[a] for a in entry_axes(entry))


def kv_plan(job: PlanJob, hbm_bytes: float | None = None) -> KVPlan:
    """The KV pool the engine allocates for `job` (`hbm_bytes`: a device's memory, for
    `EngineConfig.kv_memory_fraction`)."""
    e, m, layout, mesh = job.engine, job.model, job.cfg.rollout_layout, job.rollout_mesh
    sizes = dict(mesh.shape)
    cache_dtype = jnp.dtype(e.cache_dtype or m.dtype)
    max_pages = -(-e.max_seq_len // e.page_size)
    spec = layout.spec(kv_cache.POOL_AXES, mesh, shape=(m.num_layers, m.num_kv_heads, 1, e.page_size, m.head_dim),
                       what="KV page pool")
    kv_shards = _ways(spec, sizes, 1)
    batch_ways = _ways(layout.spec(("batch",), mesh), sizes, 0)
    batch_axes = entry_axes(layout.spec(("batch",), mesh, shape=(e.max_slots,), what="decode slots")[0]
                            if e.max_slots % batch_ways == 0 else None)
    page_axes = batch_axes if batch_axes and not set(batch_axes) & set(entry_axes(spec[1])) else ()
    replicas = math.prod(sizes[a] for a in page_axes)
    if e.num_pages is not None:
        num_pages = e.num_pages
    elif e.kv_memory_bytes is not None or e.kv_memory_fraction is not None:
        if e.kv_memory_bytes is not None:
            budget = e.kv_memory_bytes
        elif hbm_bytes is None:
            raise ValueError("EngineConfig.kv_memory_fraction needs the device's memory size; plan on a hardware "
                             "preset with one, or set EngineConfig.num_pages or kv_memory_bytes")
        else:
            budget = int(e.kv_memory_fraction * hbm_bytes)
        num_pages = kv_cache.pages_for_budget(m, e.page_size, cache_dtype, budget, kv_shards)
    else:
        num_pages = e.max_slots // replicas * max_pages
    pool = kv_cache.bytes_per_page(m, e.page_size, cache_dtype) * num_pages  # one replica's pool, all heads
    seq_pages = -(-(job.seq_len - 1) // e.page_size)  # the last token is never cached
    slot_bytes = e.max_slots * (4 * (SLOT_SCALARS + e.max_stop_tokens + max_pages) + 1)
    return KVPlan(num_pages=num_pages, replicas=replicas, kv_shards=kv_shards, pages_per_sequence=seq_pages,
                  bytes_per_device=pool // kv_shards, slot_bytes=slot_bytes,
                  sequences=min(e.max_slots, replicas * (num_pages // seq_pages)))


def _leaf_device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=16)
def _abstract_params(model: ModelConfig) -> nnx.State:
    return nnx.state(abstract_model(model), nnx.Param)


def abstract_params(model: ModelConfig) -> nnx.State:
    """The model's abstract parameters (shapes, dtypes, logical axes): a new tree over leaves built
    once per config, as a plan reads them many times."""
    return jax.tree.map(lambda x: x, _abstract_params(model))


def model_states(job: PlanJob) -> tuple[nnx.State, nnx.State | None]:
    """The run's abstract parameters as a run splits them: `(trained, frozen)`, every parameter and
    None without LoRA, else the adapters (in `param_dtype`) and the base in `LoraConfig.base_dtype`."""
    return trained_and_frozen(abstract_params(job.model), job.model.lora)


def rollout_state(job: PlanJob) -> nnx.State:
    """The rollout engine's parameters before the sync's cast: the whole model, or a LoRA run's
    base (merged: the engine runs the base model on merged weights of the base's dtype) with the
    adapters beside it when unmerged."""
    trained, frozen = model_states(job)
    if frozen is None:
        return trained
    return frozen if job.spec.adapters == "merged" else nnx.merge_state(frozen, trained)


def synced_state(job: PlanJob) -> nnx.State:
    """What each step's sync moves (before its cast): the trained parameters, or with merged LoRA
    adapters the targeted projections of the base (each merged with its adapter as it moves)."""
    trained, frozen = model_states(job)
    if frozen is None or job.spec.adapters != "merged":
        return trained
    return targeted_split(frozen, job.model.lora)[0]


def rollout_expert_bytes(job: PlanJob) -> int:
    """Bytes per rollout device of the experts' weights (every sparse layer's `experts_*`; 0 for a
    dense model) as `rollout_bytes` counts them: the part of the rollout params that a decode step
    reads only for the experts its tokens chose."""
    if job.model.moe is None:
        return 0
    return rollout_bytes(job, EXPERT_NAMES)


def _quantized(path: str) -> bool:
    """Whether a rollout placement's path names a quantized layer weight or its scale."""
    keys = path.split(".")
    return keys[0] == "layers" and (keys[-1] in quant.INPUT_AXES or quant.weight_of(keys[-1]) is not None)


def rollout_bytes(job: PlanJob, names: tuple[str, ...] | None = None) -> int:
    """Bytes per rollout device of the rollout params (those of the layer parameters `names`, if
    given) at the sync's rollout dtype; with `SyncConfig.quantize`, the quantized weights at one
    byte and their scales at four (the rollout model's own dtypes)."""
    def keep(path: str) -> bool:
        name = path.split(".")[-1]
        return names is None or name in names or quant.weight_of(name) in names

    layout, mesh = job.cfg.rollout_layout, job.rollout_mesh
    placements = [p for p in layout.placements(rollout_state(job), mesh) if keep(p.path)]
    if job.cfg.sync.quantize is None:
        return rollout_dtype_bytes(placements, job.cfg.sync)
    own = [p for p in layout.placements(abstract_params(job.spec.rollout_model), mesh)
           if keep(p.path) and _quantized(p.path)]
    return (rollout_dtype_bytes([p for p in placements if not _quantized(p.path)], job.cfg.sync)
            + sum(p.bytes_per_device for p in own))


def published_bytes(train_placements, sync_cfg) -> int:
    """Bytes per train device of the copy an asynchronous drain-mode run publishes
    (`tpurl.rl.async_step._rollout_copy`): at the rollout dtype, but the weights the sync quantizes
    at their own (it quantizes the masters)."""
    def kept(p) -> bool:
        return sync_cfg.quantize is not None and is_quantized(tuple(p.path.split(".")))
    return (rollout_dtype_bytes([p for p in train_placements if not kept(p)], sync_cfg)
            + sum(p.bytes_per_device for p in train_placements if kept(p)))


def rollout_dtype_bytes(placements, sync_cfg) -> int:
    """Bytes per device of `placements` at the sync's rollout dtype (`rollout_dtype_of` each leaf)."""
    return int(sum(math.prod(p.shard_shape) * rollout_dtype_of(p, sync_cfg).itemsize for p in placements))


def state_bytes(job: PlanJob) -> dict[str, int]:
    """Per train device: `master_params` (the trained parameters and PPO's value head),
    `frozen_params` (a LoRA run's base, 0 otherwise), `optimizer_state`, `gradients`,
    `reference_params`, `published_params` (one copy of the trained params in the train layout at
    the sync's rollout dtype: what asynchronous drain mode hands the rollout side), and per rollout
    device `rollout_params` (at the sync's rollout dtype, quantized weights at their own:
    `rollout_bytes`). See the module docstring for LoRA."""
    cfg = job.cfg
    trained, frozen = model_states(job)
    train_pl = cfg.train_layout.placements(trained, job.train_mesh)
    master = layout_bytes_per_device(train_pl)
    head = None
    if cfg.algorithm.uses_critic:
        from tpurl.train.critic import init_value_head

        head = jax.eval_shape(lambda: init_value_head(job.model.hidden_size))
    state = abstract_train_state(trained, cfg.optimizer, mesh=job.train_mesh, layout=cfg.train_layout,
                                 value_head=head)
    frozen_bytes = 0 if frozen is None else layout_bytes_per_device(cfg.train_layout.placements(frozen, job.train_mesh))
    own_reference = job.spec.reference in ("copy", "adapters")
    return {"master_params": master + _leaf_device_bytes(state.value_head),
            "frozen_params": frozen_bytes,
            "optimizer_state": _leaf_device_bytes(state.opt_state),
            "gradients": master + _leaf_device_bytes(state.value_head),
            "reference_params": master if own_reference else 0,
            "published_params": published_bytes(train_pl, cfg.sync),
            "rollout_params": rollout_bytes(job)}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The dimensions the activation estimates use (per device)."""

    b: int
    T: int
    D: int
    F: int
    N: int
    K: int
    H: int
    V: int
    L: int
    t: int
    c: int
    scores: bool = True
    S: int = 0  # keys each token's attention scores span: the packed row length, else T (0: T)
    score_fraction: float = 1.0  # of the [T, S] scores that the causal query blocks compute
    A: int = 0  # a LoRA model's adapter path per token per layer: R x targets (`x @ A`)
    AO: int = 0  # a LoRA model's low-rank outputs per token per layer (each target's output width)
    Ls: int = 0  # a mixture-of-experts model's sparse layers (the other L - Ls are dense)
    E: int = 0  # experts per sparse layer
    X: int = 0  # experts per token
    G: int = 0  # an expert's MLP width
    te: int = 1  # the tensor-parallel ways of an expert's MLP (`expert_mlp`)

    def kinds(self) -> dict[str, int]:
        """Layers of each MLP kind present: `{"dense": L - Ls, "moe": Ls}` without the empty kinds."""
        return {kind: n for kind, n in (("dense", self.L - self.Ls), ("moe", self.Ls)) if n}


# Logical axes the tensor-parallel ways split in the compute sharding (heads and MLP).
TENSOR_AXES = ("heads", "kv_heads", "mlp")


def expert_parallel_ways(layout, mesh, num_experts: int) -> int:
    """How many devices split a sparse layer's experts in `layout`'s compute sharding on `mesh`
    (expert parallelism: each holds `num_experts / ways` experts whole; 1 where the experts are
    gathered at use, as in the FSDP train layouts). The experts fall back to replication where
    they do not divide, as the layout places them."""
    spec = layout.spec(("experts",), mesh, compute=True, shape=(num_experts,), what="experts")
    return _ways(spec, dict(mesh.shape), 0)


def tensor_ways(layout, mesh) -> int:
    """The tensor-parallel ways of `layout`'s compute sharding on `mesh`: how many devices split
    the heads and the MLP (`TENSOR_AXES`)."""
    return _ways(layout.spec(("mlp",), mesh, compute=True), dict(mesh.shape), 0)


def adapter_elems(m: ModelConfig, t: int) -> tuple[int, int]:
    """Per token per layer of a LoRA model (0, 0 without): the adapters' `x @ A` (R per target,
    the rank never sharded) and the targets' low-rank outputs `(x @ A) @ B` (each target's output
    width, heads and MLP over the `t` tensor-parallel ways)."""
    if m.lora is None:
        return 0, 0
    shapes, out = m.projection_shapes(), 0
    for target in m.lora.targets:
        width = fans(target, shapes[target])[1]
        out += width // t if set(PROJECTIONS[target][1]) & set(TENSOR_AXES) else width
    return m.lora.rank * len(m.lora.targets), out


def expert_shapes(job: PlanJob, layout, mesh) -> dict[str, int]:
    """The `Shapes` fields of a mixture-of-experts model (none without): sparse layers, experts,
    experts per token, an expert's width and the ways `layout` splits it (`expert_mlp`)."""
    m = job.model
    if m.moe is None:
        return {}
    te = _ways(layout.spec(("expert_mlp",), mesh, compute=True), dict(mesh.shape), 0)
    return {"Ls": m.layer_kinds.count("moe"), "E": m.moe.num_experts, "X": m.moe.experts_per_token,
            "G": m.moe.intermediate_size, "te": te}


def update_shapes(job: PlanJob, rows: int, backend: str = "cpu") -> Shapes:
    """Shapes of one micro-batch of `rows` sequences on a train device; `scores`: whether the
    attention materializes its `[N, T, T]` scores (XLA's dense attention does, cuDNN's fused
    attention on a GPU backend does not)."""
    from tpurl.models.attention import causal_blocked_fraction, resolve_attention_impl

    m, layout, mesh = job.model, job.cfg.train_layout, job.train_mesh
    sizes = dict(mesh.shape)
    batch = _ways(layout.spec(("batch",), mesh), sizes, 0)
    t = tensor_ways(layout, mesh)
    packing = job.cfg.packing
    b = max(1, -(-rows // batch))
    keys = packing.row_length(job.seq_len, b) if packing.enabled else job.seq_len
    a, ao = adapter_elems(m, t)
    return Shapes(b=b, T=job.seq_len, S=keys, D=m.hidden_size, F=m.intermediate_size,
                  N=m.num_heads, K=m.num_kv_heads, H=m.head_dim, V=m.vocab_size, L=m.num_layers, t=t,
                  c=jnp.dtype(m.dtype).itemsize,
                  scores=resolve_attention_impl(m.attention_impl, m.dtype, head_dim=m.head_dim,
                                                backend=backend) == "xla",
                  score_fraction=causal_blocked_fraction(keys, keys, m.attention_query_blocks), A=a, AO=ao,
                  **expert_shapes(job, layout, mesh))


def mlp_activation_elems(s: Shapes, kind: str) -> int:
    """Elements a layer's MLP keeps per token for its backward pass without remat: the dense MLP's
    gate, up and product (3 F / t), or a sparse layer's router logits (E, float32: counted at
    `4 / c` elements each), the X routed copies of the token's hidden state (X D) and the experts'
    gate, up and product (X 3 G / te)."""
    if kind == "dense":
        return 3 * s.F // s.t
    return s.E * 4 // s.c + s.X * s.D + s.X * 3 * s.G // s.te


def layer_activation_elems(s: Shapes, kind: str = "dense") -> int:
    """Elements one layer (its MLP of `kind`: "dense" or "moe") keeps per token for its backward
    pass without remat: the residual stream and norms (4 D), q, k, v and the attention output
    ((2 N + 2 K) H / t), the MLP's (`mlp_activation_elems`), the attention scores and probabilities
    (2 N S / t over the S keys of its row, unless fused: packed rows are longer than T,
    `PackingConfig.row_length`; the fraction of them that the causal query blocks compute), and a
    LoRA model's `x @ A` (R per target)."""
    scores = int(2 * s.N * (s.S or s.T) * s.score_fraction) // s.t if s.scores else 0
    return 4 * s.D + (2 * s.N + 2 * s.K) * s.H // s.t + mlp_activation_elems(s, kind) + scores + s.A


def saved_elems(s: Shapes, remat: str, kind: str = "dense") -> int:
    """Elements per token per layer (its MLP of `kind`) kept across the layer scan for the backward
    pass."""
    if remat == "full":
        return s.D  # the layer input; everything else is recomputed
    if remat == "dots":  # matmul outputs without batch dims: projections and MLP (a LoRA model's
        # x @ A and low-rank outputs too; a sparse layer's router logits, not its ragged_dots), not the scores
        mlp = 2 * s.F // s.t if kind == "dense" else s.E * 4 // s.c
        return 3 * s.D + (2 * s.N + 2 * s.K) * s.H // s.t + mlp + s.A + s.AO
    return layer_activation_elems(s, kind)


def activation_bytes(s: Shapes, remat: str) -> int:
    """Bytes of the update's activations per device: every layer's saved elements (by its MLP
    kind) plus two layers' working set (the largest kind's), per token of one micro-batch."""
    saved = sum(n * saved_elems(s, remat, kind) for kind, n in s.kinds().items())
    working = max(layer_activation_elems(s, kind) for kind in s.kinds())
    return s.b * s.T * s.c * (saved + 2 * working)


def _gathered_by_stack(job: PlanJob, trained_only: bool) -> dict[str | None, int]:
    """Bytes of the weights in their compute sharding (after the FSDP all-gather) on one device, in
    the compute dtype, by what they are stacked over (`transformer.stack_kind`: None for every
    layer's and the model's top-level weights, "dense" or "moe" for a kind's MLP)."""
    params = model_states(job)[0] if trained_only else abstract_params(job.model)
    layout, mesh = job.cfg.train_layout, job.train_mesh
    sizes, out = dict(mesh.shape), {}
    for p in layout.placements(params, mesh):
        spec = layout.spec(p.logical, mesh, compute=True)
        ways = math.prod(_ways(spec, sizes, i) for i in range(len(p.shape)))
        keys = p.path.split(".")
        kind = stack_kind(keys[-1]) if keys[0] == "layers" else None
        out[kind] = out.get(kind, 0) + math.prod(p.shape) // ways * jnp.dtype(job.model.dtype).itemsize
    return out


def gathered_weight_bytes(job: PlanJob) -> int:
    """Bytes of every layer's weights in their compute sharding (after the FSDP all-gather) on one
    device, in the compute dtype."""
    return sum(_gathered_by_stack(job, False).values())


def gathered_layer_bytes(job: PlanJob, *parts: bool) -> int:
    """One layer's gathered weights (`_gathered_by_stack` of each `trained_only` in `parts`,
    summed): the weights stacked over every layer and the top-level ones spread over the L layers,
    plus the largest kind's MLP (a sparse layer's: all its experts). For a dense model, the whole
    model's gathered bytes over L."""
    by_stack: dict[str | None, int] = {}
    for trained_only in parts:
        for kind, n in _gathered_by_stack(job, trained_only).items():
            by_stack[kind] = by_stack.get(kind, 0) + n
    counts = {kind: n for kind in ("dense", "moe") if (n := job.model.layer_kinds.count(kind))}
    layers, common = job.model.num_layers, by_stack.get(None, 0)
    return max((common * n + by_stack.get(kind, 0) * layers) // (layers * n) for kind, n in counts.items())


def update_temporaries(job: PlanJob, state: dict[str, int], backend: str = "cpu") -> dict[str, int]:
    """The update's temporaries per train device, by part (see the module docstring); `backend`:
    the platform ("cpu", "gpu", "tpu"), which decides the attention kernel."""
    algo = job.cfg.algorithm
    s = update_shapes(job, job.spec.train_rows // (algo.minibatches * algo.micro_batches), backend)
    # Without remat the scan keeps each layer's gathered weights for its backward pass; with remat
    # they are gathered again, one layer at a time; a layer's weight gradient (a LoRA model's:
    # its adapters' alone) exists gathered until it is reduce-scattered.
    if job.model.remat == "none":
        weights = gathered_weight_bytes(job) + gathered_layer_bytes(job, True)
    else:
        weights = gathered_layer_bytes(job, False, True)
    chunk = min(DEFAULT_CHUNK, s.T)
    return {"gradients": state["gradients"],
            "optimizer_update": state["master_params"],
            "gathered_weights": weights,
            "activations": activation_bytes(s, job.model.remat),
            "logits": 3 * s.b * chunk * s.V * 4}


def scoring_temporaries(job: PlanJob, backend: str = "cpu") -> int:
    """A scoring (logprobs) pass's temporaries per train device: one layer's activations of one
    micro-batch of the step's batch (the pass scores `micro_batches` chunks one after another),
    one layer's gathered weights (the largest layer's) and a chunk of logits."""
    s = update_shapes(job, job.spec.train_rows // job.cfg.algorithm.micro_batches, backend)
    layer = max(layer_activation_elems(s, kind) for kind in s.kinds())
    return s.b * s.T * s.c * layer + gathered_layer_bytes(job, False) + 2 * s.b * min(DEFAULT_CHUNK, s.T) * s.V * 4
