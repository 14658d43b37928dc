"""LoRA adapters on the transformer's projections: configuration, shapes, logical axes, the
low-rank path and the merged weight.

Letters: L layers, D embed, N heads, K kv heads, H head_dim, F mlp, R rank, I / O a projection's
input / output axes (flattened).

A projection `W[I..., O...]` (`q_proj[D, N, H]`, `o_proj[N, H, D]`, `down_proj[F, D]`, ...) with an
adapter computes `x @ W + scale * (x @ A) @ B` with `A[I..., R]` and `B[R, O...]`, `scale = alpha /
rank` (`alpha / sqrt(rank)` with `rslora`): Hugging Face PEFT's LoRA, whose `lora_A.weight` is
`A^T` and `lora_B.weight` is `B^T` over the flattened axes. A starts random and B at zero, so a new
adapter leaves the model unchanged. Adapters are stacked along the `layers` axis like every layer
parameter and carry logical axes (`A[L, I..., lora_rank]`, `B[L, lora_rank, O...]`): every layout
shards them as it shards the projection's own input and output axes, and never the rank.

Adapters are `nnx.LoRAParam`s (a kind of `nnx.Param`): `adapter_state(model)` is what a LoRA run
trains, `base_state(model)` the rest, frozen.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.config_types import check_types
from tpurl.models.ops import dense

# The projections an adapter may target: their input and output logical axes (without `layers`).
PROJECTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "q_proj": (("embed",), ("heads", "head_dim")),
    "k_proj": (("embed",), ("kv_heads", "head_dim")),
    "v_proj": (("embed",), ("kv_heads", "head_dim")),
    "o_proj": (("heads", "head_dim"), ("embed",)),
    "gate_proj": (("embed",), ("mlp",)),
    "up_proj": (("embed",), ("mlp",)),
    "down_proj": (("mlp",), ("embed",)),
}
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the projections named in `targets` (of `PROJECTIONS`).

    `rank` R and `alpha` give the adapter's scale `alpha / R` (`alpha / sqrt(R)` with `rslora`);
    `dropout` drops the adapter path's input in training forwards (the update and the warm start;
    never in scoring or rollout); `base_dtype` is the dtype the frozen base weights are held in
    (the rollout's, typically: no fp32 master copy of a weight that never changes). A new
    adapter's A matrices are drawn from the model's initialization seed.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(PROJECTIONS)
    rslora: bool = False
    base_dtype: str = "bfloat16"

    def __post_init__(self):
        check_types(self)
        if self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank} must be >= 1 (e.g. 16)")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha} must be > 0 (e.g. twice the rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout={self.dropout} must be in [0, 1)")
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown or not self.targets:
            what = f"unknown {unknown!r}" if unknown else "empty"
            raise ValueError(f"LoraConfig.targets={self.targets!r}: {what}; the model's projections are "
                             f"{list(PROJECTIONS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoraConfig.targets={self.targets!r} names a projection twice")
        try:
            dt = jnp.dtype(self.base_dtype)
        except TypeError:
            raise ValueError(f"LoraConfig.base_dtype={self.base_dtype!r} is not a dtype name") from None
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"LoraConfig.base_dtype={self.base_dtype!r} must be a floating dtype")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """A one-line ValueError if the rank exceeds a target's input or output width (`shapes`: each
        projection's weight shape without `layers`): such an adapter is no longer low-rank."""
        for name in self.targets:
            fan_in, fan_out = fans(name, shapes[name])
            if self.rank > min(fan_in, fan_out):
                raise ValueError(f"LoraConfig.rank={self.rank} exceeds {name}'s width ({fan_in} in, {fan_out} out); "
                                 f"use a rank of at most {min(fan_in, fan_out)}")

    def mismatch(self, other: LoraConfig) -> str | None:
        """The first of rank, alpha, targets (as a set) and rslora in which `other` differs, as
        `"field: mine vs other's"`; None when the two adapters compute alike."""
        for field in ("rank", "alpha", "targets", "rslora"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if (set(mine) != set(theirs)) if field == "targets" else mine != theirs:
                return f"{field}: {mine!r} vs {theirs!r}"
        return None


def fans(target: str, weight_shape: tuple[int, ...]) -> tuple[int, int]:
    """`(fan_in, fan_out)` of a projection's weight shape (without `layers`): the flattened widths of
    its input and output axes."""
    n_in = len(PROJECTIONS[target][0])
    return math.prod(weight_shape[:n_in]), math.prod(weight_shape[n_in:])


def adapter_names(target: str) -> tuple[str, str]:
    """The layer parameters of `target`'s adapter: `(A, B)`."""
    return f"{target}_lora_a", f"{target}_lora_b"


def adapter_axes(target: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of `target`'s `A` and `B` (without `layers`)."""
    ins, outs = PROJECTIONS[target]
    return (*ins, RANK_AXIS), (RANK_AXIS, *outs)


def adapter_shapes(target: str, weight_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of `target`'s `A` and `B` for its weight's shape (both without `layers`)."""
    n_in = len(PROJECTIONS[target][0])
    return (*weight_shape[:n_in], rank), (rank, *weight_shape[n_in:])


def init_adapter(key: jax.Array, shape_a: tuple[int, ...], shape_b: tuple[int, ...], dtype
                 ) -> tuple[jax.Array, jax.Array]:
    """A new adapter (stacked shapes): A uniform in +-1/sqrt(fan_in) (PEFT's Kaiming-uniform with
    a = sqrt(5)), B zero."""
    fan_in = math.prod(shape_a[1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(key, shape_a, jnp.float32, -bound, bound).astype(dtype)
    return a, jnp.zeros(shape_b, dtype)


def adapter_params(cfg, key: jax.Array) -> dict[str, nnx.LoRAParam]:
    """New adapters of every target of `cfg.lora` (a `ModelConfig`), stacked over its layers, by
    layer-parameter name: A random (from `key` folded with the target's position), B zero, in
    `cfg.param_dtype`."""
    cfg.check_lora()
    shapes = cfg.projection_shapes()
    out = {}
    for i, target in enumerate(cfg.lora.targets):
        shape_a, shape_b = adapter_shapes(target, shapes[target], cfg.lora.rank)
        a, b = init_adapter(jax.random.fold_in(key, i), (cfg.num_layers, *shape_a), (cfg.num_layers, *shape_b),
                            cfg.weight_dtype)
        axes_a, axes_b = adapter_axes(target)
        name_a, name_b = adapter_names(target)
        out[name_a] = nnx.LoRAParam(a, logical_axes=("layers", *axes_a))
        out[name_b] = nnx.LoRAParam(b, logical_axes=("layers", *axes_b))
    return out


def new_adapters(cfg, seed: int = 0) -> nnx.State:
    """A new adapters state for `cfg` (a `ModelConfig` with `lora`): the paths and values a model
    built from `cfg` with `seed` holds (`adapter_state(init_model(cfg, seed))`) without building
    the model."""
    return nnx.State({"layers": adapter_params(cfg, adapter_key(jax.random.key(seed)))})


def adapter_key(init_key: jax.Array) -> jax.Array:
    """The key new adapters are drawn from, given the key a model's weights are initialized from."""
    return jax.random.fold_in(init_key, 0x10AA)


def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, target: str) -> jax.Array:
    """The adapter's path `scale * (x @ A) @ B` (contracting the target's input axes)."""
    n_in = len(PROJECTIONS[target][0])
    return dense(dense(x, a, n_in), b) * jnp.asarray(scale, x.dtype)


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, target: str, dtype=None) -> jax.Array:
    """`W + scale * A @ B` (stacked or one layer's), computed in float32 and returned in `dtype`
    (default W's): the weight that computes the base projection plus the adapter in one product."""
    n_in = len(PROJECTIONS[target][0])
    lead = w.ndim - len(PROJECTIONS[target][0]) - len(PROJECTIONS[target][1])  # 1 when stacked
    ins, outs = w.shape[lead:lead + n_in], w.shape[lead + n_in:]
    a2 = a.astype(jnp.float32).reshape(*w.shape[:lead], math.prod(ins), -1)
    b2 = b.astype(jnp.float32).reshape(*w.shape[:lead], -1, math.prod(outs))
    delta = jnp.matmul(a2, b2).reshape(w.shape) * scale
    return (w.astype(jnp.float32) + delta).astype(dtype or w.dtype)


def adapter_state(model_or_state) -> nnx.State:
    """The adapters of a model (or of its state): what a LoRA run trains."""
    return _state(model_or_state, nnx.LoRAParam)


def base_state(model_or_state) -> nnx.State:
    """Every parameter that is not an adapter: a LoRA run's frozen base."""
    return _state(model_or_state, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))


def targeted_split(base: nnx.State, lora: LoraConfig) -> tuple[nnx.State, nnx.State]:
    """`(targeted, untargeted)`: a base state's projections that `lora` adapts, and the rest."""
    targeted = {("layers", t) for t in lora.targets}

    def is_targeted(path, _):
        return tuple(str(p) for p in path[:2]) in targeted

    return nnx.State(base).filter(is_targeted), nnx.State(base).filter(lambda path, v: not is_targeted(path, v))


def _state(model_or_state, kind) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, kind)
    return nnx.State(model_or_state).filter(kind)
