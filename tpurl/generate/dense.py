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
from tpurl.generate.attention import softmax_with_new
from tpurl.generate.kv_cache import to_cache
from tpurl.models.invariant import decode_window_attention

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")


def init_dense_cache(shape: tuple[int, ...], dtype, fill: float = 0.0) -> dict[str, jax.Array]:
    """A fresh `[L, B, C, K, H]` cache pair (call inside jit with its out_shardings)."""
    x = jnp.full(shape, fill, jnp.dtype(dtype))
    return {"k": x, "v": x}


class DenseDecodeAttention:
    """The model's `Attention` for one decode step over the contiguous cache `[L, B, C, K, H]`.

    Same protocol as `PagedDecodeAttention`: `model_cache()` (the layer index: the cache is read
    in place, never copied through the layer scan), then `updated_cache(out)` writes every layer's
    new k/v at row `lengths[b]` with one scatter. Each layer attends over rows `[0, lengths[b])` plus
    its own new key in one softmax. Rows past the length are masked in the scores and zeroed in the
    values, so stale or poisoned data never contributes; idle slots write nowhere (their row index
    is out of range and the scatter drops it).
    """

    def __init__(self, cache: dict[str, jax.Array], lengths_B: jax.Array, active_B: jax.Array,
                 window: int | None = None):
        self.cache = cache
        self.lengths = lengths_B
        self.active = active_B
        self.window = window  # bitwise mode (`ModelConfig.attention_window`)

    def model_cache(self):
        return jnp.arange(self.cache["k"].shape[0], dtype=jnp.int32)

    def updated_cache(self, cache_out) -> dict[str, jax.Array]:
        b, c = self.cache["k"].shape[1:3]
        row_B = jnp.where(self.active, self.lengths, c)
        slot_B = jnp.arange(b)
        return {name: self.cache[name].at[:, slot_B, row_B].set(
                    to_cache(new_LB1KH[:, :, 0], self.cache[name].dtype), mode="drop")
                for name, new_LB1KH in zip(("k", "v"), cache_out)}

    def __call__(self, q_BTNH, k_BTKH, v_BTKH, layer):
        k_BCKH, v_BCKH = self.cache["k"][layer], self.cache["v"][layer]
        if self.window is not None:
            lengths_B = jnp.where(self.active, self.lengths, 0)
            out_BNH = decode_window_attention(q_BTNH[:, 0], k_BCKH, v_BCKH, lengths_B, k_BTKH[:, 0], v_BTKH[:, 0],
                                              self.window)
            return out_BNH[:, None], (k_BTKH, v_BTKH)
        b, c, kv, _ = k_BCKH.shape
        n, h = q_BTNH.shape[2], q_BTNH.shape[3]
        g = n // kv
        q_BKGH = (q_BTNH[:, 0].astype(jnp.float32) / math.sqrt(h)).astype(q_BTNH.dtype).reshape(b, kv, g, h)
        valid_BC = (jnp.arange(c, dtype=jnp.int32)[None, :] < self.lengths[:, None]) & self.active[:, None]
        s_BKGC = jnp.einsum("BKGH,BCKH->BKGC", q_BKGH, k_BCKH, preferred_element_type=jnp.float32)
        s_new_BKG = jnp.einsum("BKGH,BKH->BKG", q_BKGH, k_BTKH[:, 0], preferred_element_type=jnp.float32)
        p_BKGC, p_new_BKG = softmax_with_new(s_BKGC, valid_BC, s_new_BKG)
        vals = jnp.where(valid_BC[:, :, None, None], v_BCKH, 0).astype(jnp.float32)
        out_BKGH = jnp.einsum("BKGC,BCKH->BKGH", p_BKGC, vals)
        out_BKGH = out_BKGH + p_new_BKG[..., None] * v_BTKH[:, 0, :, None, :].astype(jnp.float32)
        return out_BKGH.reshape(b, 1, n, h).astype(q_BTNH.dtype), (k_BTKH, v_BTKH)
