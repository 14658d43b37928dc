"""Float8 (e4m3) weights with per-channel scales: the rollout engine's quantized projections.

A quantized layer parameter `W` (a projection or an expert tensor, stacked over `layers`) is held
as `q = round_e4m3(W / s)` with one float32 scale `s` per output channel: `s = max|W| / 448` over
the channel's inputs (448 is e4m3's largest finite value), so the channel's largest weight lands
on the format's largest value and every other is rounded to e4m3's 3-bit mantissa. The scale is
the layer parameter `<name>_scale`, whose shape is W's without its input axes. The engine computes
with `q * s` cast to the compute dtype (`dequantize`), one layer at a time inside the layer scan:
a dequantised matmul, what a backend without an fp8 dot does.

Error bound, per weight: `|W - q s| <= max(2^-4 |W|, 2^-10 s)`: half a unit in the last place of a
normal e4m3 value (3 mantissa bits), and half the spacing of e4m3's subnormals (2^-9) below 2^-6.

Which weights: every layer projection (q, k, v, o, and the MLP's gate, up, down) and the experts'
tensors of a mixture-of-experts model. The embedding, the output projection, norms, biases, the
router and LoRA adapters stay in the rollout dtype (as vLLM's and SGLang's fp8 do by default: the
logits and the routing are the most sensitive to rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMATS = ("fp8",)  # ModelConfig.quantization / SyncConfig.quantize
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale"

# Each quantized layer parameter: the positions of its input (contracted) axes, without `layers`.
INPUT_AXES: dict[str, tuple[int, ...]] = {
    "q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1),
    "gate_proj": (0,), "up_proj": (0,), "down_proj": (0,),
    "experts_gate": (1,), "experts_up": (1,), "experts_down": (1,),
}


def check_format(fmt: str | None, where: str) -> None:
    """One-line ValueError unless `fmt` is None or one of `FORMATS`."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"{where}={fmt!r} is unknown; use one of {FORMATS} or None (weights in the rollout dtype)")


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def weight_of(name: str) -> str | None:
    """The quantized weight a `<name>_scale` parameter scales; None for any other name."""
    base = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
    return base if base in INPUT_AXES else None


def input_axes(name: str, stacked: bool = True) -> tuple[int, ...]:
    """The positions of weight `name`'s input axes (after its leading `layers` axis when `stacked`)."""
    lead = 1 if stacked else 0
    return tuple(lead + a for a in INPUT_AXES[name])


def drop_inputs(items: tuple, name: str, stacked: bool = True) -> tuple:
    """`items` (a weight's shape, logical axes or partition spec, stacked unless `stacked=False`)
    without the input axes of `name`: the same for its scale."""
    ins = input_axes(name, stacked)
    return tuple(x for i, x in enumerate(items) if i not in ins)


def channel_scales(w: jax.Array, name: str, stacked: bool = True) -> jax.Array:
    """Float32 per-output-channel scales of weight `w` (see the module docstring); a channel of
    zeros gets scale 1 (its weights quantize to 0 either way)."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=input_axes(name, stacked))
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def expand(scale: jax.Array, name: str, stacked: bool = True) -> jax.Array:
    """Per-channel scales broadcastable against their weight (unit input axes)."""
    return jnp.expand_dims(scale, input_axes(name, stacked))


def quantized_values(w: jax.Array, scale: jax.Array, name: str, stacked: bool = True) -> jax.Array:
    """`W / s` in float32, within e4m3's range: what a cast to `FP8_DTYPE` rounds."""
    v = w.astype(jnp.float32) / expand(scale, name, stacked)
    return jnp.clip(v, -FP8_MAX, FP8_MAX)


def quantize(w: jax.Array, name: str, stacked: bool = True) -> tuple[jax.Array, jax.Array]:
    """`(q, s)`: weight `w` as float8 e4m3 values and float32 per-channel scales."""
    s = channel_scales(w, name, stacked)
    return quantized_values(w, s, name, stacked).astype(FP8_DTYPE), s


def dequantize(q: jax.Array, scale: jax.Array, name: str, dtype, stacked: bool = True) -> jax.Array:
    """`q * s` (computed in float32) in `dtype`."""
    return (q.astype(jnp.float32) * expand(scale.astype(jnp.float32), name, stacked)).astype(dtype)
