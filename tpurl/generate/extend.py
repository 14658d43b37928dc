"""Resume: append tokens to a waiting sequence's KV pages by a prefill at its current position.

Letters: B decode slots, T appended positions (a bucket), L layers, N query heads, K kv heads,
G = N / K, H head_dim, M max pages per sequence, S page size, V vocab.

In a multi-turn episode a sequence waits for its environment outside any decode slot: the engine
`detach`es it (a `Detached`: its replica and pages, which keep its cached positions). When the
environment answers, the sequence is resumed in a free slot of its replica (`Resume`): the tokens
to append are the model's last sampled token (sampled but not yet cached) followed by the
environment's observation tokens. `extend_step` maps the slot onto the sequence's pages, sets its
sampling fields, runs the appended tokens through the model at positions `start + t` in one program
over the resumed slots (the engine gathers them into the power of two of slots that holds them,
`tpurl.generate.compaction`; rows not resumed are untouched), attends each new query to the sequence's cached
pages and to the new keys before it (causal), writes the new keys and values into its pages, and
samples the next model token from the last appended position exactly as a decode step would (key
index `steps`). The conversation is never re-prefilled and no generated text is re-tokenized. The
appended positions always lie past the prompt's shared pages, in pages the sequence owns.

Attention runs the pure-jnp path on every backend (the Pallas decode kernels take one query per
sequence); it is exact in fp32 and, like the decode reference, reads only the slots' own pages.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpurl.generate.attention import _MASKED, KernelSharding, PagedPoolAccess
from tpurl.generate.kv_cache import PagedCacheShape
from tpurl.generate.page_book import Detached
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import SamplingConfig, sample_tokens
from tpurl.models.moe import token_routes


@dataclasses.dataclass(eq=False)
class Resume:
    """Resume `seq` in free slot `slot`: cache `tokens` at positions `start, start + 1, ...` (the
    model's last sampled token, then the environment's) and sample the next token with key index
    `steps` (model tokens so far) of request seed `seed`; `remaining`: model tokens it may still
    generate, this one included (>= 1)."""

    slot: int
    seq: Detached
    tokens: list[int]
    start: int
    steps: int
    remaining: int
    seed: int


def resume_rows(requests: list[Resume], samplings: list[SamplingConfig], slots: int, width: int,
                shape: PagedCacheShape, max_stop_tokens: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The host arrays of one `extend_step`: tokens `[B, width]` and per-slot fields `[B]` (rows of
    slots not resumed have `count` 0); request i samples with `samplings[i]`."""
    rows = {"count": np.zeros(slots, np.int32), "start": np.zeros(slots, np.int32),
            "steps": np.zeros(slots, np.int32), "remaining": np.ones(slots, np.int32),
            "seeds": np.zeros(slots, np.uint32), "temperature": np.ones(slots, np.float32),
            "top_k": np.zeros(slots, np.int32), "top_p": np.ones(slots, np.float32),
            "stop_ids": np.full((slots, max_stop_tokens), -1, np.int32),
            "page_table": np.full((slots, shape.max_pages_per_seq), shape.num_pages, np.int32)}
    tokens_BT = np.zeros((slots, width), np.int32)
    for r, sampling in zip(requests, samplings, strict=True):
        b = r.slot
        tokens_BT[b, :len(r.tokens)] = r.tokens
        rows["count"][b], rows["start"][b], rows["steps"][b], rows["remaining"][b] = (
            len(r.tokens), r.start, r.steps, r.remaining)
        rows["seeds"][b] = r.seed
        rows["temperature"][b], rows["top_k"][b], rows["top_p"][b] = (sampling.temperature, sampling.top_k,
                                                                      sampling.top_p)
        rows["stop_ids"][b, :len(sampling.stop_token_ids)] = sampling.stop_token_ids
        rows["page_table"][b, :len(r.seq.pages)] = r.seq.pages
    return tokens_BT, rows


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
        keys, vals = self.gather_layer(layer)  # [K, B, M, S, H]
        m, s = keys.shape[2], keys.shape[3]
        q_BKGTH = jnp.transpose((q_BTNH.astype(jnp.float32) / math.sqrt(h)).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
        s_cached = jnp.einsum("BKGQH,KBMSH->BKGQMS", q_BKGTH, keys.astype(jnp.float32)).reshape(b, kv, g, t, m * s)
        s_new = jnp.einsum("BKGQH,BTKH->BKGQT", q_BKGTH, k_BTKH.astype(jnp.float32))
        cached_BC = jnp.arange(m * s, dtype=jnp.int32)[None, :] < self.start[:, None]
        idx = jnp.arange(t, dtype=jnp.int32)
        new_BQT = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < self.count[:, None, None])
        scores = jnp.concatenate([jnp.where(cached_BC[:, None, None, None, :], s_cached, _MASKED),
                                  jnp.where(new_BQT[:, None, None], s_new, _MASKED)], axis=-1)
        p = jax.nn.softmax(scores, axis=-1)
        # Zero the values of masked positions too: 0 * NaN would leak poison from unused page rows.
        vals = jnp.where(cached_BC.reshape(1, b, m, s, 1), vals, 0).astype(jnp.float32)
        out = (jnp.einsum("BKGQMS,KBMSH->BKGQH", p[..., :m * s].reshape(b, kv, g, t, m, s), vals)
               + jnp.einsum("BKGQT,BTKH->BKGQH", p[..., m * s:], v_BTKH.astype(jnp.float32)))
        out_BTNH = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
        return out_BTNH.astype(q_BTNH.dtype), (k_BTKH, v_BTKH)


def extend_step(graphdef, params, state: dict, tokens_BT, rows: dict, *, constrain,
                sharding: KernelSharding | None, truncate: bool = True, top_n: int = 0, routes: bool = False):
    """Resume the slots with `rows["count"] > 0` (see `resume_rows`): map them onto their pages, set
    their sampling fields, append `tokens_BT[b, :count[b]]` at positions `start[b]...` and sample
    each one's next token (inside jit; the state is donated by the caller). Returns the new state
    and the sampled tokens (`valid`: the resumed rows; with `routes`, the appended tokens' experts)."""
    ext = rows["count"] > 0
    state = dict(state)
    for name in ("seeds", "temperature", "top_k", "top_p", "stop_ids", "page_table"):
        keep = ext.reshape(ext.shape + (1,) * (state[name].ndim - 1))
        state[name] = jnp.where(keep, rows[name].astype(state[name].dtype), state[name])
    model = nnx.merge(graphdef, params)
    b, t = tokens_BT.shape
    start, count = rows["start"], rows["count"]
    attention = PagedExtendAttention(state["cache"], state["page_table"], start, count, t, sharding=sharding)
    positions_BT = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    hidden_BTD, cache_out, routing = model(tokens_BT, positions_BT, attention=attention,
                                           cache=attention.model_cache(), constrain=constrain, with_routing=True)
    last_B1D = jnp.take_along_axis(hidden_BTD, jnp.maximum(count - 1, 0)[:, None, None], axis=1)
    logits_BV = model.logits(last_B1D, constrain)[:, 0]
    tokens, logprobs, top = sample_tokens(logits_BV, state["seeds"], rows["steps"], state["temperature"],
                                          state["top_k"], state["top_p"], truncate=truncate, top_n=top_n)
    remaining = rows["remaining"] - 1
    done = ext & (jnp.any(tokens[:, None] == state["stop_ids"], axis=1) | (remaining <= 0))
    new = dict(state, cache=attention.updated_pool(cache_out),
               tokens=jnp.where(ext, tokens, state["tokens"]), lengths=jnp.where(ext, start + count, state["lengths"]),
               steps=jnp.where(ext, rows["steps"] + 1, state["steps"]),
               remaining=jnp.where(ext, remaining, state["remaining"]), active=jnp.where(ext, ~done, state["active"]))
    return new, ResultTokens(tokens=tokens, logprobs=logprobs, valid=ext, lengths=new["steps"], done=done, top=top,
                             routes=token_routes(routing) if routes else None)


def check_resume(r: Resume, page_book, page_size: int, model_cfg) -> None:
    """A one-line ValueError (naming `extend_batch`) unless `r` can resume: its sequence is detached
    and its slot free on its replica (`PageBook.check_resume`), its tokens fit the sequence's
    pages and the model's vocabulary, and it may still generate a token."""
    try:
        page_book.check_resume(r.slot, r.seq)
    except ValueError as e:
        raise ValueError(f"extend_batch: {e}") from None
    capacity = len(r.seq.pages) * page_size
    if not r.tokens or r.start < 1 or r.start + len(r.tokens) > capacity:
        raise ValueError(f"extend_batch: {len(r.tokens)} tokens at position {r.start} do not fit the sequence's "
                         f"{capacity} cached positions; the episode's token budget is exhausted")
    if min(r.tokens) < 0 or max(r.tokens) >= model_cfg.vocab_size:
        raise ValueError(f"extend_batch: token ids {min(r.tokens)}..{max(r.tokens)} to append are outside the model's "
                         f"vocabulary (0..{model_cfg.vocab_size - 1}); the environment's tokenizer is not the "
                         "model's")
    if r.remaining < 1:
        raise ValueError(f"extend_batch: the sequence has no model tokens left to generate (remaining={r.remaining})")
