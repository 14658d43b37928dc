"""Batched prefill: several prompts in one program, with the first token of every sample fused in.

Letters: P prompts of a prefill batch, T prompt positions (a prefill bucket), G samples per prompt,
L layers, K kv heads, H head_dim, D embed, V vocab.

A prefill is latency-bound for short prompts: one tiny program, then a device-to-host read of the
first tokens. So a whole admission wave is one call: the prompts of one length bucket, padded to
`[P, T]` (P rounded up to a power of two so that compilations stay few), run one forward; the last
real position of each prompt is unembedded and the first token of each of its G samples is drawn in
the same program. The caller reads the `[P, G]` first tokens back with one `device_get`.

Padding prompts (rows past the real ones) have length 1 and token 0; their outputs are ignored.
"""

from __future__ import annotations

import collections
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpurl.generate.attention import PrefillAttention
from tpurl.generate.kv_cache import to_cache
from tpurl.generate.protocol import Prefix, ResultTokens
from tpurl.generate.sampling import SamplingConfig, sample_tokens
from tpurl.models.moe import token_routes


def pow2_bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, capped at `cap` (which need not be a power of two)."""
    if n < 1 or n > cap:
        raise ValueError(f"pow2_bucket: n={n} must be in [1, {cap}]")
    return min(1 << (n - 1).bit_length(), cap)


class PrefillCall(NamedTuple):
    """The padded inputs of one prefill program: prompts `indices` (row r is prompt indices[r]),
    with each row's sampling (`temperature_P`, `top_k_P`, `top_p_P`; padding rows: 1, 0, 1)."""

    indices: list[int]
    tokens_PT: np.ndarray
    lengths_P: np.ndarray
    seeds_PG: np.ndarray
    temperature_P: np.ndarray
    top_k_P: np.ndarray
    top_p_P: np.ndarray


def plan_prefill_calls(prompts: Sequence[np.ndarray], seeds: Sequence[np.ndarray],
                       samplings: Sequence[SamplingConfig], buckets: Sequence[int], max_batch: int
                       ) -> list[PrefillCall]:
    """Group prompts by length bucket (the smallest that holds each), `max_batch` per call in order,
    and pad each call to `[P, T]` prompts (P a power of two, see `pow2_bucket`), `[P, G]` seeds
    (G: the most samples of a prompt in the call) and `[P]` sampling parameters (`samplings[i]`:
    prompt i's)."""
    by_bucket: dict[int, list[int]] = collections.defaultdict(list)
    for i, ids in enumerate(prompts):
        by_bucket[next(b for b in buckets if b >= len(ids))].append(i)
    calls = []
    for bucket, members in by_bucket.items():
        for c in range(0, len(members), max_batch):
            chunk = members[c:c + max_batch]
            p = pow2_bucket(len(chunk), max_batch)
            tokens = np.zeros((p, bucket), np.int32)
            lengths = np.ones(p, np.int32)  # padding rows: one (ignored) token
            seeds_PG = np.zeros((p, max(len(seeds[i]) for i in chunk)), np.uint32)
            temperature, top_k, top_p = np.ones(p, np.float32), np.zeros(p, np.int32), np.ones(p, np.float32)
            for r, i in enumerate(chunk):
                tokens[r, :len(prompts[i])] = prompts[i]
                lengths[r] = len(prompts[i])
                seeds_PG[r, :len(seeds[i])] = seeds[i]
                temperature[r], top_k[r], top_p[r] = samplings[i].temperature, samplings[i].top_k, samplings[i].top_p
            calls.append(PrefillCall(chunk, tokens, lengths, seeds_PG, temperature, top_k, top_p))
    return calls


def prefill_forward(graphdef, params, tokens_PT: jax.Array, lengths_P: jax.Array, *, constrain, cache_dtype,
                    routes: bool = False):
    """Causal forward over right-padded prompts `[P, T]` with true lengths `[P]`.

    Returns the prompts' k/v `[L, P, T, K, H]` (in `cache_dtype`), the float32 logits `[P, V]` at
    each prompt's last real position, and with `routes` the prompts' experts per sparse layer
    `[P, T, Ls, K]` (a router-replay model), else None.
    """
    model = nnx.merge(graphdef, params)
    p, t = tokens_PT.shape
    idx_PT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (p, t))
    valid_PT = idx_PT < lengths_P[:, None]
    attention = PrefillAttention(valid_PT, model.config.attention_query_blocks, model.config.attention_window)
    hidden_PTD, (k, v), routing = model(tokens_PT, idx_PT, cache=None, attention=attention,
                                        constrain=constrain, with_routing=True)
    last_P1D = jnp.take_along_axis(hidden_PTD, (lengths_P - 1)[:, None, None], axis=1)
    logits_PV = model.logits(last_P1D, constrain)[:, 0]
    return to_cache(k, cache_dtype), to_cache(v, cache_dtype), logits_PV, token_routes(routing) if routes else None


def prefill_and_sample(graphdef, params, tokens_PT: jax.Array, lengths_P: jax.Array, seeds_PG: jax.Array,
                       temperature_P: jax.Array, top_k_P: jax.Array, top_p_P: jax.Array, *, constrain, cache_dtype,
                       truncate: bool = True, top_n: int = 0, routes: bool = False, bitwise: bool = False):
    """`prefill_forward` plus the first token of each sample, drawn with its prompt's sampling
    parameters (`[P]` each): `(k, v, tokens_PG, logprobs_PG, top, routes)` (`top`: `TopLogprobs`
    `[P, G, K]` with `top_n` > 0, else None; `routes`: the prompts' experts, `prefill_forward`).

    Sample g of prompt p draws from that prompt's last logits with key `(seeds_PG[p, g], step 0)`,
    exactly as a decode step would: the draw depends on the seed only, not on the batch. `bitwise`:
    the model's `consistency` is "bitwise" (the logprobs computed batch-invariantly).
    """
    k, v, logits_PV, routes_PTLK = prefill_forward(graphdef, params, tokens_PT, lengths_P, constrain=constrain,
                                                   cache_dtype=cache_dtype, routes=routes)
    p, g = seeds_PG.shape
    # Row r = p * G + g draws from prompt p's logits (a gather: XLA:CPU compiles the equivalent
    # broadcast-and-reshape of some small vocabularies extremely slowly).
    prompt_R = jnp.arange(p * g, dtype=jnp.int32) // g
    logits_RV = jnp.take(logits_PV, prompt_R, axis=0)
    tokens_R, logprobs_R, top = sample_tokens(logits_RV, seeds_PG.reshape(-1), jnp.zeros(p * g, jnp.int32),
                                              jnp.take(temperature_P, prompt_R), jnp.take(top_k_P, prompt_R),
                                              jnp.take(top_p_P, prompt_R), truncate=truncate, top_n=top_n,
                                              bitwise=bitwise)
    if top is not None:
        top = jax.tree.map(lambda x: x.reshape(p, g, -1), top)
    return k, v, tokens_R.reshape(p, g), logprobs_R.reshape(p, g), top, routes_PTLK


def prefixes(prompts: Sequence[np.ndarray], seeds: Sequence[np.ndarray], samplings: Sequence[SamplingConfig],
             calls, host) -> list[tuple[Prefix, ResultTokens]]:
    """Per prompt, in order: its `Prefix` (its row of its call's k/v) and its samples' first tokens.

    `calls`: `(prompt indices, k, v)` of each prefill call; `host`: each call's `(first tokens,
    logprobs, top, routes)` `[P, G]` (top: `[P, G, K]` or None; routes `[P, T, Ls, K]` or None),
    read to the host."""
    out: list = [None] * len(prompts)
    for (chunk, k, v), (first, logprobs, top, routes) in zip(calls, host):
        for r, i in enumerate(chunk):
            g = len(seeds[i])
            first_top = None if top is None else jax.tree.map(lambda x: x[r, :g], top)
            prefix = Prefix(k=k, v=v, row=r, prompt_ids=prompts[i], sampling=samplings[i], seeds=seeds[i],
                            first_tokens=first[r, :g], first_logprobs=logprobs[r, :g], first_top=first_top,
                            routes=None if routes is None else routes[r, :len(prompts[i])],
                            inserted=np.zeros(g, bool))
            done = np.array([prefix.finished_at_first_token(j) for j in range(g)])
            out[i] = (prefix, ResultTokens(tokens=prefix.first_tokens, logprobs=prefix.first_logprobs,
                                           valid=np.ones(g, bool), lengths=np.ones(g, np.int32), done=done,
                                           top=first_top))
    return out


def forward_flops(graphdef, params, prompts: int, bucket: int, *, constrain, cache_dtype) -> float:
    """FLOPs of one prefill forward of `[prompts, bucket]` (XLA's cost analysis; no sampling)."""
    fn = jax.jit(lambda prm, toks, lens: prefill_forward(graphdef, prm, toks, lens, constrain=constrain,
                                                         cache_dtype=cache_dtype)[:3])
    cost = fn.lower(params, np.zeros((prompts, bucket), np.int32), np.ones(prompts, np.int32)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
