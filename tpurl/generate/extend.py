"""Extend: append tokens to running sequences' KV pages by a prefill at each one's current position.

Letters: B decode slots, T appended positions (a bucket), L layers, N query heads, K kv heads,
G = N / K, H head_dim, M max pages per sequence, S page size, V vocab.

Multi-turn episodes hand a sequence back to the engine after an environment turn: the tokens to
append are the model's last sampled token (sampled but not yet cached) followed by the
environment's observation tokens. `extend_step` runs them through the model at positions
`start_B + t` in one program over every slot (rows with `count_B = 0` are untouched), attends
each new query to the sequence's cached pages and to the new keys before it (causal), writes the
new keys and values into the sequence's own pages, and samples the next model token from the last
appended position, exactly as a decode step would (key index `steps_B`). The conversation is never
re-prefilled and no generated text is re-tokenized. The appended positions always lie past the
prompt's shared pages, in pages the sequence owns.

Attention runs the pure-jnp path on every backend (the Pallas decode kernels take one query per
sequence); it is exact in fp32 and, like the decode reference, reads only the slots' own pages.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.generate.attention import _MASKED, KernelSharding, PagedPoolAccess
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import sample_tokens


class PagedExtendAttention(PagedPoolAccess):
    """The model's `Attention` for T appended tokens per slot over the paged pool (see the module
    docstring). Use like `PagedDecodeAttention`: `model_cache()`, then `updated_pool(out)`."""

    def __init__(self, pool: dict[str, jax.Array], page_table_BM: jax.Array, start_B: jax.Array,
                 count_B: jax.Array, t: int, *, sharding: KernelSharding | None = None):
        super().__init__(pool, page_table_BM, sharding)
        self.start, self.count = start_B, count_B
        pos_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        writes_BT = jnp.arange(t, dtype=jnp.int32)[None, :] < count_B[:, None]
        col_BT = jnp.minimum(pos_BT // self.page_size, page_table_BM.shape[1] - 1)
        page_BT = jnp.take_along_axis(page_table_BM, col_BT, axis=1)
        self.page_BT = jnp.where(writes_BT, page_BT, self.num_pages)  # sentinel: the write is dropped
        self.row_BT = pos_BT % self.page_size

    def model_cache(self):
        return self.layer_indices()

    def updated_pool(self, cache_out) -> dict[str, jax.Array]:
        # New k/v `[L, B, T, K, H]` -> `[L, K, B, T, H]`, written at each position's (page, row).
        return {name: self.scatter(name, jnp.transpose(new_LBTKH, (0, 3, 1, 2, 4)), self.page_BT, self.row_BT)
                for name, new_LBTKH in zip(("k", "v"), cache_out)}

    def __call__(self, q_BTNH, k_BTKH, v_BTKH, layer):
        b, t, n, h = q_BTNH.shape
        kv = k_BTKH.shape[2]
        g = n // kv
        keys, vals = self.gather_layer(layer)  # [B, M, K, S, H]
        m, s = keys.shape[1], keys.shape[3]
        q_BKGTH = jnp.transpose((q_BTNH.astype(jnp.float32) / math.sqrt(h)).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
        s_cached = jnp.einsum("BKGQH,BMKSH->BKGQMS", q_BKGTH, keys.astype(jnp.float32)).reshape(b, kv, g, t, m * s)
        s_new = jnp.einsum("BKGQH,BTKH->BKGQT", q_BKGTH, k_BTKH.astype(jnp.float32))
        cached_BC = jnp.arange(m * s, dtype=jnp.int32)[None, :] < self.start[:, None]
        idx = jnp.arange(t, dtype=jnp.int32)
        new_BQT = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < self.count[:, None, None])
        scores = jnp.concatenate([jnp.where(cached_BC[:, None, None, None, :], s_cached, _MASKED),
                                  jnp.where(new_BQT[:, None, None], s_new, _MASKED)], axis=-1)
        p = jax.nn.softmax(scores, axis=-1)
        # Zero the values of masked positions too: 0 * NaN would leak poison from unused page rows.
        vals = jnp.where(cached_BC.reshape(b, m, 1, s, 1), vals, 0).astype(jnp.float32)
        out = (jnp.einsum("BKGQMS,BMKSH->BKGQH", p[..., :m * s].reshape(b, kv, g, t, m, s), vals)
               + jnp.einsum("BKGQT,BTKH->BKGQH", p[..., m * s:], v_BTKH.astype(jnp.float32)))
        out_BTNH = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
        return out_BTNH.astype(q_BTNH.dtype), (k_BTKH, v_BTKH)


def extend_step(graphdef, params, state: dict, tokens_BT, count_B, start_B, steps_B, remaining_B, *,
                constrain, sharding: KernelSharding | None):
    """Append `tokens_BT[b, :count_B[b]]` to slot b at positions `start_B[b]...` and sample its next
    token (inside jit; the state is donated by the caller). Returns the new state and the sampled
    tokens (`valid` = rows extended).

    Host-given per row: `steps_B` the sampled token's key index (model tokens generated so far),
    `remaining_B` the model tokens the sequence may still generate, this one included. Extended
    rows become active unless the sampled token ends them (a stop token, or no budget left).
    """
    model = nnx.merge(graphdef, params)
    b, t = tokens_BT.shape
    attention = PagedExtendAttention(state["cache"], state["page_table"], start_B, count_B, t, sharding=sharding)
    positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    hidden_BTD, cache_out = model(tokens_BT, positions_BT, attention=attention, cache=attention.model_cache(),
                                  constrain=constrain)
    last_B1D = jnp.take_along_axis(hidden_BTD, jnp.maximum(count_B - 1, 0)[:, None, None], axis=1)
    logits_BV = model.logits(last_B1D, constrain)[:, 0]
    tokens, logprobs = sample_tokens(logits_BV, state["seeds"], steps_B, state["temperature"], state["top_k"],
                                     state["top_p"])
    ext = count_B > 0
    remaining = remaining_B - 1
    done = ext & (jnp.any(tokens[:, None] == state["stop_ids"], axis=1) | (remaining <= 0))
    new = dict(state, cache=attention.updated_pool(cache_out),
               tokens=jnp.where(ext, tokens, state["tokens"]), lengths=jnp.where(ext, start_B + count_B, state["lengths"]),
               steps=jnp.where(ext, steps_B + 1, state["steps"]), remaining=jnp.where(ext, remaining, state["remaining"]),
               active=jnp.where(ext, ~done, state["active"]))
    return new, ResultTokens(tokens=tokens, logprobs=logprobs, valid=ext, lengths=new["steps"], done=done)
