"""Rotary position embeddings with the Llama 3 frequency scaling, in Hugging Face's convention
(the two halves of the head dimension are rotated together: `rotate_half`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.models.config import RopeScaling
from tpurl.models.invariant import rounded


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies `[H/2]` (float64 numpy, computed once at trace time)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(is_medium, smoothed, out)


def rope_cos_sin(positions_BT: jax.Array, head_dim: int, theta: float,
                 scaling: RopeScaling | None, table_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[B, T, H]` in float32.

    `table_size` (bitwise mode: `ModelConfig.attention_window`): looked up in a table of every position
    below it, computed once in numpy (float64, rounded to float32) and embedded in the program, so
    a position's values never depend on how XLA fused or vectorized the trigonometry around it.

    Each is computed on the `H/2` distinct frequencies, then repeated: half the sines and cosines,
    and, on XLA:CPU, the form that keeps them computed once. With the angles concatenated before
    `cos`, XLA fuses the cosine into every consumer instead (each layer's q and k rotation,
    forward and backward, once per head; docs/performance.md)."""
    if table_size is not None:
        angles = np.arange(table_size, dtype=np.float64)[:, None] * inv_frequencies(head_dim, theta, scaling)[None, :]
        cos, sin = (jnp.take(jnp.asarray(f(angles), jnp.float32), positions_BT, axis=0, mode="clip")
                    for f in (np.cos, np.sin))
        return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    inv = jnp.asarray(inv_frequencies(head_dim, theta, scaling), jnp.float32)
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv[None, None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array, *, zero: jax.Array | None = None
               ) -> jax.Array:
    """Rotate `x` (any number of heads) by the per-position angles; computed in float32. `zero`
    (bitwise mode, `invariant.runtime_zero`): both products rounded before their sum
    (`invariant.rounded`), the same in every program."""
    x = x_BTNH.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    a, b = x * cos_BTH[:, :, None, :], rotated * sin_BTH[:, :, None, :]
    if zero is not None:
        a, b = rounded(a, zero), rounded(b, zero)
    return (a + b).astype(x_BTNH.dtype)
