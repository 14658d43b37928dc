"""The train state pytree, the optax optimizer, and where the state lives on a mesh.

`TrainState` holds what the update changes: the model parameters (an `nnx.State` of fp32 master
weights; pair it with the model's graphdef), the optimizer state, the step counter, the count of
steps the non-finite-gradient guard skipped, and PPO's value head (None otherwise). A LoRA run
(`tpurl.models.lora`) trains only the adapters: `params` are the adapters and `frozen` the base
(in `LoraConfig.base_dtype`, no optimizer state, never donated by the step); `model_state()` is
the whole model's.

Placement: parameters follow `layout.param_shardings` (e.g. `W_in[D_fsdp, F_tp]`); every optimizer
moment that mirrors the parameter tree gets the same shardings, and every other optimizer leaf
(optax's scalar `count`, the value head's moments) is replicated. The explicit replicated sharding
for `count` matters: left alone it lands on one device, and a jit over the mesh rejects it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.models.lora import adapter_state, base_state
from tpurl.train.config import OptimizerConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """`params` (nnx.State), `opt_state` (over `trainable()`), `step` and `skipped` (int32 scalars),
    `value_head` (PPO critic, or None), `frozen` (a LoRA run's base, or None)."""

    params: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    value_head: Any = None
    frozen: Any = None

    def trainable(self):
        """What the optimizer updates: `(params, value_head)`."""
        return (self.params, self.value_head)

    def model_state(self):
        """The model's whole parameter state: `params`, with the frozen base when there is one."""
        return self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then constant or cosine decay to
    `min_lr_ratio * lr` over `total_steps`."""
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    else:
        main = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps, alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return main
    warm = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, main], [cfg.warmup_steps])


def _decay_mask(trainable):
    """Weight decay on matrices only: not on norm scales, biases or the value head's bias."""
    def decays(path, leaf):
        name = jax.tree_util.keystr(path)
        return leaf.ndim >= 2 and "norm" not in name and "bias" not in name

    return jax.tree_util.tree_map_with_path(decays, trainable)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decoupled weight decay) or SGD, under `make_schedule`."""
    schedule = make_schedule(cfg)
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    if cfg.optimizer == "adamw":
        parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 mask=_decay_mask))
    else:
        parts.append(optax.sgd(schedule))
    return optax.chain(*parts)


def state_shardings(state: TrainState, mesh: Mesh, layout) -> TrainState:
    """NamedShardings for every leaf of a (concrete or abstract) `TrainState` under `layout`."""
    param_sh = layout.param_shardings(state.params, mesh)
    params_def = jax.tree.structure(state.params)
    replicated = NamedSharding(mesh, P())

    def is_param_tree(x):
        return jax.tree.structure(x) == params_def

    def shard(x):
        return param_sh if is_param_tree(x) else replicated

    return TrainState(
        params=param_sh,
        opt_state=jax.tree.map(shard, state.opt_state, is_leaf=is_param_tree),
        step=replicated, skipped=replicated,
        value_head=jax.tree.map(lambda _: replicated, state.value_head),
        frozen=None if state.frozen is None else layout.param_shardings(state.frozen, mesh))


def _build_state(params, value_head, opt_cfg: OptimizerConfig, frozen=None) -> TrainState:
    # Copies, so that donating the state in the train step leaves the caller's arrays valid (the
    # frozen base is never donated: it is the caller's).
    params = jax.tree.map(jnp.copy, params)
    value_head = jax.tree.map(jnp.copy, value_head)
    return TrainState(params=params, opt_state=make_optimizer(opt_cfg).init((params, value_head)),
                      step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), value_head=value_head,
                      frozen=frozen)


_build_state_jit = jax.jit(_build_state, static_argnames="opt_cfg")


def abstract_train_state(params, opt_cfg: OptimizerConfig, *, mesh: Mesh, layout, value_head=None,
                         frozen=None) -> TrainState:
    """The `TrainState` that `init_train_state` would build from `params` (concrete or abstract), as
    `ShapeDtypeStruct`s carrying their shardings: a template to restore a checkpoint into, with
    nothing allocated."""
    abstract = jax.eval_shape(lambda p, v, f: _build_state(p, v, opt_cfg, f), params, value_head, frozen)
    shardings = state_shardings(abstract, mesh, layout)  # a prefix of `abstract` (one per nnx.Param)

    def place(sharding, subtree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree)

    return jax.tree.map(place, shardings, abstract, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def init_train_state(model_or_params, opt_cfg: OptimizerConfig, *, mesh: Mesh | None = None, layout=None,
                     value_head=None, frozen=None) -> TrainState:
    """A fresh `TrainState` from a model (or its `nnx.State` of parameters).

    With `mesh` and `layout`, parameters and optimizer state are placed in the layout's shardings
    (the optimizer state is created directly there by a jitted init). The parameters are copied,
    so the model's own arrays stay valid when the train step donates the state. A model with LoRA
    adapters trains those alone: its base becomes `frozen` (cast to `LoraConfig.base_dtype`); a
    state of adapters takes its base as `frozen`.
    """
    if isinstance(model_or_params, nnx.Module):
        if frozen is not None:
            raise ValueError("init_train_state: a model holds its own base (with LoRA); pass frozen= only with a "
                             "state of adapters")
        params, frozen = trained_and_frozen(model_or_params)
    else:
        params = model_or_params
    if (mesh is None) != (layout is None):
        raise ValueError("init_train_state: pass both mesh and layout (sharded) or neither (single device)")
    if mesh is None:
        return _build_state_jit(params, value_head, opt_cfg=opt_cfg).replace(frozen=frozen)
    abstract = jax.eval_shape(lambda p, v: _build_state(p, v, opt_cfg), params, value_head)
    shardings = state_shardings(abstract, mesh, layout)
    params = jax.device_put(params, shardings.params)
    state = jax.jit(_build_state, static_argnames="opt_cfg", out_shardings=shardings)(params, value_head,
                                                                                      opt_cfg=opt_cfg)
    if frozen is not None:
        frozen = jax.device_put(frozen, layout.param_shardings(frozen, mesh))
    return state.replace(frozen=frozen)


def trained_and_frozen(params, lora=None):
    """The trained parameters and the frozen base of a model's parameters (an `nnx.State`, or the
    model): all of them and None, or with LoRA adapters (`lora`, a `LoraConfig`; a model's own when
    given a model), the adapters and the base cast to `lora.base_dtype`."""
    if isinstance(params, nnx.Module):
        lora = getattr(params.config, "lora", None)
        params = nnx.state(params, nnx.Param)
    if lora is None:
        return params, None
    dtype = jnp.dtype(lora.base_dtype)
    return adapter_state(params), jax.tree.map(lambda x: _cast(x, dtype), base_state(params))


def _cast(x, dtype):
    """`x` in `dtype` (an abstract array as an abstract array)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)


def state_sizes(state: TrainState) -> dict[str, int]:
    """Global parameter counts and bytes of a train state, by part (shapes only, nothing read):
    `trained_params`/`trained_bytes` (what the optimizer updates, the value head included),
    `optimizer_bytes`, `frozen_params`/`frozen_bytes` (a LoRA run's base; 0 otherwise)."""
    def count(tree) -> int:
        return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(tree))

    def nbytes(tree) -> int:
        return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    trained = state.trainable()
    return {"trained_params": count(trained), "trained_bytes": nbytes(trained),
            "optimizer_bytes": nbytes(state.opt_state),
            "frozen_params": count(state.frozen), "frozen_bytes": nbytes(state.frozen)}
