"""The contiguous ("dense") KV cache: one `[max_seq_len]` row per slot, behind the same engine protocol.

Letters: L layers, B slots, C cache positions (= max_seq_len), K kv heads, G query heads per kv
head, N = K * G, H head_dim, T prompt positions.

The cache is `{"k": [L, B, C, K, H], "v": ...}`. Simpler than pages and the baseline the paged cache
is measured against: every slot reserves `max_seq_len` positions whether it uses them or not, and a
group of G samples holds G copies of its prompt.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
_MASKED = -1e30


def init_dense_cache(shape: tuple[int, ...], dtype, sharding: NamedSharding, fill: float = 0.0):
    """A fresh `[L, B, C, K, H]` cache pair created in its sharding."""

    def make():
        x = jnp.full(shape, fill, jnp.dtype(dtype))
        return {"k": x, "v": x}

    return jax.jit(make, out_shardings={"k": sharding, "v": sharding})()


class DenseDecodeAttention:
    """The model's `Attention` for one decode step over the contiguous cache.

    Writes each active slot's new k/v at row `lengths[b]` of its cache line (idle slots write
    nowhere: their row index is out of range and the scatter drops it), then attends over rows
    `[0, lengths[b]]`. Rows past the length are masked in the scores and zeroed in the values, so
    stale or poisoned data never contributes.
    """

    def __init__(self, lengths_B: jax.Array, active_B: jax.Array):
        self.lengths = lengths_B
        self.active = active_B

    def __call__(self, q_BTNH, k_BTKH, v_BTKH, cache):
        k_BCKH, v_BCKH = cache
        b, c = k_BCKH.shape[:2]
        row_B = jnp.where(self.active, self.lengths, c)
        slot_B = jnp.arange(b)
        k_BCKH = k_BCKH.at[slot_B, row_B].set(k_BTKH[:, 0].astype(k_BCKH.dtype), mode="drop")
        v_BCKH = v_BCKH.at[slot_B, row_B].set(v_BTKH[:, 0].astype(v_BCKH.dtype), mode="drop")
        n, h = q_BTNH.shape[2], q_BTNH.shape[3]
        kv = k_BCKH.shape[2]
        q_BKGH = (q_BTNH[:, 0].astype(jnp.float32) / math.sqrt(h)).astype(q_BTNH.dtype).reshape(b, kv, n // kv, h)
        valid_BC = jnp.arange(c, dtype=jnp.int32)[None, :] <= jnp.where(self.active, self.lengths, -1)[:, None]
        s_BKGC = jnp.einsum("BKGH,BCKH->BKGC", q_BKGH, k_BCKH, preferred_element_type=jnp.float32)
        s_BKGC = jnp.where(valid_BC[:, None, None, :], s_BKGC, _MASKED)
        p_BKGC = jax.nn.softmax(s_BKGC, axis=-1)
        vals = jnp.where(valid_BC[:, :, None, None], v_BCKH, 0).astype(jnp.float32)
        out_BKGH = jnp.einsum("BKGC,BCKH->BKGH", p_BKGC, vals)
        return out_BKGH.reshape(b, 1, n, h).astype(q_BTNH.dtype), (k_BCKH, v_BCKH)


def write_prompt_dense(cache: dict[str, jax.Array], k_LTKH: jax.Array, v_LTKH: jax.Array, slot: jax.Array,
                       poison: bool = False) -> dict[str, jax.Array]:
    """Copy a prompt's k/v (`[L, T, K, H]`, T <= C) into rows `[0, T)` of `slot`'s cache line.

    Rows past the true length are bucket padding; decode masks them by length. With `poison`, the
    slot's whole line is first filled with NaN (isolation tests)."""
    out = {}
    for name, x_LTKH in (("k", k_LTKH), ("v", v_LTKH)):
        line = cache[name]
        if poison:
            line = line.at[:, slot].set(jnp.nan)
        upd = x_LTKH[:, None].astype(line.dtype)
        out[name] = jax.lax.dynamic_update_slice(line, upd, (0, slot, 0, 0, 0))
    return out
