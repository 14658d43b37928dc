"""The jitted policy-update step (RL and SFT): micro-batched gradients, a non-finite guard, optax.

`make_train_step(...)` returns `step(state, batch) -> (state, metrics)`, jitted once with the
layout's shardings and the state donated (the old parameters and optimizer moments are dead once
the new ones exist; donation lets XLA update them in place, halving the step's peak memory).

A batch is a dict of `[B, ...]` arrays:

    tokens [B, T] int32, valid [B, T] bool, loss_mask [B, T] (1 on completion tokens),
    advantages [B] or [B, T], and optionally old_logprobs [B, T] (absent: on-policy, ratio 1),
    ref_logprobs [B, T] (KL), rollout_logprobs [B, T] (the corrections and the mismatch metrics),
    old_values [B, T] and returns [B, T] (PPO critic).

Packing (`tpurl.train.packing`): with a `PackingConfig` enabled, the step replaces `tokens` by
their packed form (per micro-batch and batch shard) on the host as it is called; the forward runs
on the packed rows and its per-token outputs are gathered back to `[B, T]` before the loss.

Micro-batching: the loss is a weighted *sum* over tokens whose weights are computed once on the
whole batch (`losses.aggregation_weights`), so the gradient of the batch is the sum of the
micro-batches' gradients, accumulated in a `jax.lax.scan` inside the one jitted step. Micro-batch
m takes the m-th contiguous chunk of every batch shard's rows (`packing.micro_batch_split`): with
the batch sharded in contiguous blocks over the data axes, every device keeps its own rows and no
data moves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.sharding.host import to_mesh
from tpurl.train.config import AlgorithmConfig, OptimizerConfig
from tpurl.train.critic import values_from_prev
from tpurl.train.logprobs import DEFAULT_CHUNK, batch_prev_hidden, next_token_logprobs, with_compute_dtype
from tpurl.train.losses import aggregation_weights, batch_metrics, rl_objective, sft_objective
from tpurl.train.moe_losses import router_aux
from tpurl.train.packed_shapes import PackedShapes
from tpurl.train.packing import (FORMAT_KEY, PackingConfig, batch_shards, check_micro_batches, micro_batch_merge,
                                 micro_batch_split, packed_batch, to_padded)
from tpurl.train.state import TrainState, make_optimizer, make_schedule, state_shardings

Batch = Mapping[str, jax.Array]
# objective(logprobs_BT, entropy_BT, batch, weights_BT, token_weights_BT, values_BT)
#   -> (loss, sums, maxes, tokens): `tokens` per-token [B, T] outputs for metrics of the whole batch
Objective = Callable[..., tuple[jax.Array, dict, dict, dict]]
# batch_metrics(tokens, batch) -> metrics computed on the whole batch's per-token outputs
BatchMetrics = Callable[[dict, Batch], dict]


@dataclasses.dataclass(frozen=True)
class _Setup:
    graphdef: Any
    objective: Objective
    batch_metrics: BatchMetrics
    loss_agg: str
    loss_norm_len: int | None
    rows_per_sequence: int
    temperature: float
    micro_batches: int
    compute_dtype: Any
    chunk_size: int
    vocab_chunk_size: int | None
    mesh: Mesh | None
    layout: Any
    packing: PackingConfig | None
    fast: bool = False  # compute in fast mode even for a bitwise model (the warm start: no rollout to agree with)

    @property
    def sharded(self) -> bool:
        return self.mesh is not None and self.layout is not None

    @property
    def shards(self) -> int:
        return batch_shards(self.layout, self.mesh)

    def device_batch(self, batch: Batch) -> dict:
        """The host boundary of the step: the padded host batch, packed per micro-batch and shard
        when packing is enabled (`tpurl.train.packing`), then (with a mesh) placed on it sharded
        over the layout's batch axes, each process placing its own shards (`to_mesh`). A batch
        packed already is checked to be packed in this step's blocks."""
        return self._place(packed_batch(batch, self.packing, shards=self.shards, micro_batches=self.micro_batches))

    def step_batch(self, batch: Batch) -> dict:
        """`device_batch(batch)` as the jitted step takes it: without the packing format, whose
        shape has been checked (`packing.check_packed_format`), so never placed."""
        packed = packed_batch(batch, self.packing, shards=self.shards, micro_batches=self.micro_batches)
        return self._place({k: v for k, v in packed.items() if k != FORMAT_KEY})

    def _place(self, batch: dict) -> dict:
        if not self.sharded:
            return jax.device_put(batch)
        return to_mesh(batch, {k: self.layout.batch_sharding(self.mesh, np.ndim(v)) for k, v in batch.items()})


def _grads_fn(setup: _Setup):
    """`(trainable, frozen, batch, dropout_key) -> (grads, sums, maxes, tokens)` for the whole
    batch, micro-batched (`tokens`: the objective's per-token outputs, `[B, T]` in the batch's row
    order); `frozen`: a LoRA model's base (None: `trainable` holds every parameter)."""
    constrain = setup.layout.compute_constrain(setup.mesh) if setup.sharded else None
    shards = setup.shards

    def loss_fn(trainable, mb, frozen, key):
        params, value_head = trainable
        states = (params,) if frozen is None else (params, frozen)
        model = with_compute_dtype(nnx.merge(setup.graphdef, *states), setup.compute_dtype)
        if setup.fast and model.config.bitwise:
            model.config = dataclasses.replace(model.config, consistency="fast")
        # Padded or packed rows; either way the objective sees [B, T] outputs.
        prev, tokens, scored, routing = batch_prev_hidden(model, mb, constrain, dropout_key=key)
        lp, ent = next_token_logprobs(prev, model.unembedding(constrain), tokens, scored,
                                      temperature=setup.temperature, chunk_size=setup.chunk_size,
                                      vocab_chunk_size=setup.vocab_chunk_size, bitwise=model.config.bitwise)
        lp, ent = to_padded(lp, mb, shards), to_padded(ent, mb, shards)
        values = None if value_head is None else to_padded(values_from_prev(prev, value_head, scored), mb, shards)
        loss, sums, maxes, tokens = setup.objective(lp, ent, mb, mb["_weights"], mb["_token_weights"], values)
        if routing is not None:  # a mixture-of-experts model's router losses and metrics
            aux, aux_sums = router_aux(model.config.moe, routing.stats, jnp.sum(mb["_token_weights"]),
                                       model.config.layers_of("moe"))
            loss, sums = loss + aux, {**sums, **aux_sums}
        return loss, (sums, maxes, tokens)

    grad = jax.grad(loss_fn, has_aux=True)

    def constrain_batch(mb):
        return setup.layout.constrain_batch(setup.mesh, mb) if setup.sharded else mb

    def constrain_grads(g, params):
        # Gradients (and the micro-batch accumulators) live in the parameters' storage sharding:
        # each micro-batch's gradient is reduce-scattered, never held replicated (ZeRO-style).
        if not setup.sharded:
            return g
        return (jax.lax.with_sharding_constraint(g[0], setup.layout.param_shardings(params, setup.mesh)), g[1])

    def grads(trainable, frozen, batch, key=None):
        batch = dict(batch)
        mask = jnp.asarray(batch["loss_mask"], jnp.float32)
        batch["loss_mask"] = mask
        batch["_weights"] = aggregation_weights(mask, setup.loss_agg, norm_len=setup.loss_norm_len,
                                                rows_per_sequence=setup.rows_per_sequence)
        batch["_token_weights"] = mask / jnp.maximum(mask.sum(), 1.0)
        m = setup.micro_batches
        b = batch["loss_mask"].shape[0]
        check_micro_batches(b, shards, m)
        if (b // (shards * m)) % setup.rows_per_sequence:
            raise ValueError(f"train step: {b} rows in {shards} batch shards x {m} micro-batches do not keep every "
                             f"sequence of {setup.rows_per_sequence} rows in one block; use a batch of whole sequences "
                             "per block")
        one = functools.partial(grad, frozen=frozen)
        if m == 1:
            g, (sums, maxes, tokens) = one(trainable, constrain_batch(batch), key=key)
            return constrain_grads(g, trainable[0]), sums, maxes, tokens
        return _accumulated(one, trainable, batch, key, m, shards, constrain_batch, constrain_grads)

    return grads


def _accumulated(grad, trainable, batch, key, m: int, shards: int, constrain_batch, constrain_grads):
    """`(grads, sums, maxes, tokens)` of `batch` as `m` micro-batches in a scan: gradients and sums
    added up (in float32), maxima kept, per-token outputs put back in row order; micro-batches as
    `packing.micro_batch_split` (packed rows alike), each with its own dropout key."""
    mbs = jax.tree.map(lambda x: micro_batch_split(x, shards, m), batch)
    keys = None if key is None else jax.random.split(key, m)
    g0, (s0, x0, _) = jax.eval_shape(lambda t, b: grad(t, b, key=None), trainable,
                                     jax.tree.map(lambda x: x[0], mbs))
    g_zeros, s_zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, jnp.float32 if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype), (g0, s0))
    zeros = (constrain_grads(g_zeros, trainable[0]), s_zeros)
    neg_inf = jax.tree.map(lambda s: jnp.full(s.shape, -jnp.inf, s.dtype), x0)

    def body(carry, xs):
        (g_acc, s_acc), x_acc = carry
        mb, k = xs
        g, (s, x, tok) = grad(trainable, constrain_batch(mb), key=k)
        g_acc = jax.tree.map(lambda a, b_: a + b_.astype(a.dtype), g_acc, constrain_grads(g, trainable[0]))
        s_acc = jax.tree.map(jnp.add, s_acc, s)
        return ((g_acc, s_acc), jax.tree.map(jnp.maximum, x_acc, x)), tok

    ((g, sums), maxes), tokens = jax.lax.scan(body, (zeros, neg_inf), (mbs, keys))
    g = jax.tree.map(lambda a, t: a.astype(t.dtype), g, g0)
    tokens = jax.tree.map(lambda x: micro_batch_merge(x, shards), tokens)
    return constrain_grads(g, trainable[0]), sums, maxes, tokens


def _finish_metrics(setup: _Setup, sums, maxes, tokens, batch):
    metrics = dict(sums)
    metrics.update(setup.batch_metrics(tokens, batch))
    for k, v in maxes.items():  # "neg_x_min" carries a minimum as the max of its negation
        if k.startswith("neg_"):
            metrics[k[len("neg_"):]] = -v
        else:
            metrics[k] = v
    metrics["tokens"] = jnp.sum(jnp.asarray(batch["loss_mask"], jnp.float32))
    return metrics


def make_grad_fn(graphdef, algo_cfg: AlgorithmConfig | None, *, mesh: Mesh | None = None, layout=None,
                 micro_batches: int | None = None, compute_dtype=None, chunk_size: int = DEFAULT_CHUNK,
                 vocab_chunk_size: int | None = None, sft: bool = False, packing: PackingConfig | None = None,
                 rows_per_sequence: int = 1):
    """`fn(params, batch, value_head=None, frozen=None) -> (grads, metrics)`, jitted: the step's
    gradients without the optimizer (for tests, diagnostics and custom loops; `frozen`: a LoRA
    model's base, `params` its adapters). `sft=True` uses the SFT loss (token-mean
    cross-entropy); `algo_cfg` may then be None. A LoRA model's adapters drop nothing here
    (dropout is the optimizer step's). `rows_per_sequence`: as `make_train_step`'s."""
    setup = _setup(graphdef, algo_cfg, mesh, layout, micro_batches, compute_dtype, chunk_size, vocab_chunk_size, sft,
                   packing, rows_per_sequence)
    grads = _grads_fn(setup)

    @jax.jit
    def jitted(params, batch, value_head=None, frozen=None):
        g, sums, maxes, tokens = grads((params, value_head), frozen, batch)
        metrics = _finish_metrics(setup, sums, maxes, tokens, batch)
        metrics["grad_norm"] = optax.global_norm(g)
        return g, metrics

    def fn(params, batch, value_head=None, frozen=None):
        return jitted(params, setup.step_batch(batch), value_head, frozen)

    return fn


def _setup(graphdef, algo_cfg, mesh, layout, micro_batches, compute_dtype, chunk_size, vocab_chunk_size, sft,
           packing=None, rows_per_sequence: int = 1):
    if (mesh is None) != (layout is None):
        raise ValueError("pass both mesh and layout (sharded step) or neither (single device)")
    if sft:
        def objective(lp, ent, mb, w, tw, values):
            return sft_objective(lp, ent, mb, w, tw)

        def metrics_of_batch(tokens, batch):
            return {}
        agg, norm_len, temperature = "token-mean", None, 1.0
        m = micro_batches or 1
    else:
        if algo_cfg is None:
            raise ValueError("make_train_step: algo_cfg is required for the RL step (or use make_sft_step)")

        def objective(lp, ent, mb, w, tw, values):
            return rl_objective(algo_cfg, lp, ent, mb, w, tw, values, rows_per_sequence=rows_per_sequence)

        def metrics_of_batch(tokens, batch):
            return batch_metrics(algo_cfg, tokens, batch, rows_per_sequence=rows_per_sequence)
        agg, norm_len, temperature = algo_cfg.loss_agg, algo_cfg.loss_norm_len, algo_cfg.temperature
        if agg == "seq-mean-token-sum-norm" and norm_len is None:
            raise ValueError("make_train_step: loss_agg='seq-mean-token-sum-norm' needs AlgorithmConfig.loss_norm_len "
                             "(the rollout's max_new_tokens; an RL run derives it when None)")
        m = micro_batches or algo_cfg.micro_batches
    if m < 1:
        raise ValueError(f"micro_batches={m} must be >= 1")
    if rows_per_sequence < 1:
        raise ValueError(f"rows_per_sequence={rows_per_sequence} must be >= 1")
    return _Setup(graphdef=graphdef, objective=objective, batch_metrics=metrics_of_batch, loss_agg=agg,
                  loss_norm_len=norm_len, rows_per_sequence=rows_per_sequence, temperature=temperature, micro_batches=m, compute_dtype=compute_dtype, chunk_size=chunk_size,
                  vocab_chunk_size=vocab_chunk_size, mesh=mesh, layout=layout, packing=packing, fast=sft)


def _step_fn(setup: _Setup, opt_cfg: OptimizerConfig, dropout_seed: tuple[int, int]):
    """`(state, frozen, device batch) -> (new state, metrics)`: one optimizer step (not jitted);
    `frozen` is the LoRA base (`state.frozen`, passed apart so that the step never donates it).
    The adapters' dropout masks (`LoraConfig.dropout`) are drawn from `dropout_seed` (the run's
    seed, and 0 for RL or 1 for the warm start) and the state's step, one key per micro-batch."""
    tx = make_optimizer(opt_cfg)
    schedule = make_schedule(opt_cfg)
    grads_fn = _grads_fn(setup)
    seed_key = jax.random.fold_in(jax.random.key(dropout_seed[0]), dropout_seed[1])

    def step(state: TrainState, frozen, batch: Batch):
        trainable = state.trainable()
        key = jax.random.fold_in(seed_key, state.step)
        g, sums, maxes, tokens = grads_fn(trainable, frozen, batch, key)
        grad_norm = optax.global_norm(g)
        # Skip the whole update (parameters and optimizer moments) if any gradient is inf/nan:
        # one bad batch must not poison Adam's second moment for thousands of steps.
        ok = jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(g, state.opt_state, trainable)
        new_trainable = optax.apply_updates(trainable, updates)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

        params, value_head = keep(new_trainable, trainable)
        skipped = state.skipped + (~ok).astype(jnp.int32)
        metrics = _finish_metrics(setup, sums, maxes, tokens, batch)
        metrics.update(grad_norm=grad_norm, lr=schedule(state.step - state.skipped),
                       skipped=(~ok).astype(jnp.int32), skipped_steps=skipped, step=state.step + 1)
        new_state = TrainState(params=params, opt_state=keep(opt_state, state.opt_state), step=state.step + 1,
                               skipped=skipped, value_head=value_head)
        return new_state, metrics

    return step


def _make_step(setup: _Setup, opt_cfg: OptimizerConfig, dropout_seed: tuple[int, int]):
    """The jitted step, taking host or device batches; `.lower(state, batch)` as on a jitted
    function (the compiled program's cost and memory analyses: `tpurl plan`'s tests);
    `.prepare(batch)`: the batch packed and placed as the step takes it, so that a caller places it
    once and passes it to the step (and to the scoring passes, `make_logprob_fn(...).on_batch`);
    `.shapes`: the packed shapes it has met (`tpurl.train.packed_shapes`)."""
    step = _step_fn(setup, opt_cfg, dropout_seed)
    if not setup.sharded:
        single = jax.jit(step, donate_argnums=(0,))
        program = lambda state, batch: single  # noqa: E731
    else:
        program = _sharded_jit(setup, step)

    shapes = PackedShapes(setup.shards * setup.micro_batches, setup.packing.row_buckets if setup.packing else 1)

    def run(state: TrainState, batch: Batch):
        batch = setup.step_batch(batch)
        fn, args = program(state, batch), (state.replace(frozen=None), state.frozen, batch)
        shapes.record(fn.lower, *args)
        new, metrics = fn(*args)
        return new.replace(frozen=state.frozen), metrics

    def lower(state: TrainState, batch: Batch):
        batch = setup.step_batch(batch)
        return program(state, batch).lower(state.replace(frozen=None), state.frozen, batch)

    run.lower, run.prepare, run.shapes = lower, setup.device_batch, shapes
    return run


def _sharded_jit(setup: _Setup, step):
    """`(state, device batch) -> the jitted step` over the layout's shardings, compiled on first
    use for that batch format (and refusing another format later)."""
    compiled = {}

    def jitted(state: TrainState, batch: Batch):
        # Shardings come from the layout applied to this state's tree (built once, on first use).
        if "fn" not in compiled:
            st_sh = state_shardings(state, setup.mesh, setup.layout)
            batch_sh = {k: setup.layout.batch_sharding(setup.mesh, jnp.ndim(v)) for k, v in batch.items()}
            in_sh = (st_sh.replace(frozen=None), st_sh.frozen, batch_sh)
            compiled["fn"] = jax.jit(step, in_shardings=in_sh, out_shardings=(in_sh[0], NamedSharding(setup.mesh, P())),
                                     donate_argnums=(0,))
            compiled["keys"] = tuple(sorted(batch))
        if tuple(sorted(batch)) != compiled["keys"]:
            raise ValueError(f"batch keys {sorted(batch)} differ from the first call's {list(compiled['keys'])}; "
                             "build one step per batch format")
        return compiled["fn"]

    return jitted


def make_train_step(graphdef, algo_cfg: AlgorithmConfig, opt_cfg: OptimizerConfig, *, mesh: Mesh | None = None,
                    layout=None, compute_dtype=None,
                    chunk_size: int = DEFAULT_CHUNK, vocab_chunk_size: int | None = None,
                    packing: PackingConfig | None = None, seed: int = 0, rows_per_sequence: int = 1):
    """The RL update: `step(state, batch) -> (state, metrics)`, jitted once, state donated.

    `algo_cfg.micro_batches` splits the batch for gradient accumulation;
    `compute_dtype` (e.g. "bfloat16") runs the model in that dtype on the fp32 master weights;
    `chunk_size`/`vocab_chunk_size` bound the logits memory (see logprobs.py). With `mesh` and
    `layout`, state and batch are sharded by the layout and the model pins every weight to its
    compute sharding (`layout.compute_constrain`), which keeps FSDP gradients correct on CPU.
    With `packing` enabled, each micro-batch's model forward runs on its sequences packed into
    fewer rows (`tpurl.train.packing`; a host batch is packed as the step is called, a batch from
    `.prepare` was packed already); the loss, its gradients and the metrics are those of the padded
    batch. `seed`: the run's, for a LoRA model's dropout masks. `rows_per_sequence` = S: each S
    consecutive rows of a batch are one sequence to the loss (an agent episode's rows: its
    aggregation, GSPO's ratio, sequence-level corrections; `losses.rl_objective`).

    Metrics: loss, pg_loss, kl/kl_loss (with ref_logprobs), entropy, clip_frac_low/high,
    dual_clip_frac, ratio_mean/min/max, value_loss, grad_norm, lr, tokens, skipped (this step),
    skipped_steps (total), step; with rollout_logprobs, the rollout/trainer mismatch and the
    correction's effect over the whole batch (`mismatch/*`, `correction/*`:
    `tpurl.train.correction.mismatch_metrics`).
    """
    setup = _setup(graphdef, algo_cfg, mesh, layout, None, compute_dtype, chunk_size, vocab_chunk_size,
                   sft=False, packing=packing, rows_per_sequence=rows_per_sequence)
    return _make_step(setup, opt_cfg, (seed, 0))


def make_sft_step(graphdef, opt_cfg: OptimizerConfig, *, mesh: Mesh | None = None, layout=None,
                  micro_batches: int = 1, compute_dtype=None, chunk_size: int = DEFAULT_CHUNK,
                  vocab_chunk_size: int | None = None, seed: int = 0):
    """Supervised fine-tuning with the same machinery: token-mean cross-entropy on the
    `loss_mask` tokens only (`seed`: the run's, for a LoRA model's dropout masks). A bitwise model
    (`ModelConfig.consistency`) trains here in fast mode: no rollout has to agree with it. Batch: tokens,
    valid, loss_mask. Metrics: loss, nll, entropy, grad_norm, lr, tokens, skipped, skipped_steps,
    step."""
    setup = _setup(graphdef, None, mesh, layout, micro_batches, compute_dtype, chunk_size, vocab_chunk_size,
                   sft=True)
    return _make_step(setup, opt_cfg, (seed, 1))
