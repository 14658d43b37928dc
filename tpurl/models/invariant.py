"""Batch-invariant computation: what `ModelConfig.consistency="bitwise"` runs, so that the rollout
engine's logprob of a token equals, bit for bit, the trainer's.

A token's result must not depend on which other tokens share the program, how many there are, how
its row is padded or packed, or where its keys sit in the KV cache. What makes that so:

  * **Fixed tiles** (`tiled`, `matmul_rows`, `rowwise`): every product and row reduction runs on
    tiles of exactly `ROW_TILE` rows in a loop of at least two trips. XLA:CPU picks a kernel and a
    reduction order by shape and context; a tile's are the same in every program.
  * **Rounded op boundaries** (`rounded`): each op's result is rounded before the next reads it,
    so no fused multiply-add joins ops differently in different programs.
  * **Attention over a window of the query's own keys** (`window_attention`,
    `decode_window_attention`): each query gathers the keys it may see, in position order, into a
    window of `window` slots (its sequence's positions 0..W-1; the slots past its own position
    masked). The trainer's padded or packed rows and the engine's pages give the same window for
    the same token, so the same reductions run in the same order.
  * **Rotary tables from numpy** (`tpurl.models.rope.rope_cos_sin`'s `table_size`).
  * **One logprob formula** (`tempered_logprobs`, the engine's `log_softmax(logits / T)`), which
    the trainer's scoring uses too in this mode.

It is slower (every query gathers its window: O(tokens x W) memory per layer; small decode batches
are padded to 64 rows; every op is a loop over tiles) and meant for checking and small models; the
window is `ModelConfig.bitwise_window` (an RL run's: its sequence length rounded up to 64). Cost
and limits: docs/performance.md, "Bitwise consistency".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ROW_TILE = 64
CONSISTENCY = ("fast", "bitwise")
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


_INT_OF_WIDTH = {4: jnp.int32, 2: jnp.int16}


@jax.custom_jvp
def rounded(x: jax.Array, zero: jax.Array) -> jax.Array:
    """`x` rounded to its dtype before any later use: its bits pass through an integer add of
    `zero`, a runtime 0 that the compiler cannot prove is 0, so no fused multiply-add can take an
    unrounded product across it. (XLA:CPU contracts `a * b + c` into an FMA in some fusions and not
    in others, and drops `optimization_barrier`s before fusing.) Differentiates as the identity."""
    ints = _INT_OF_WIDTH[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, ints)
    return jax.lax.bitcast_convert_type(bits + zero.astype(ints), x.dtype)


@rounded.defjvp
def _rounded_jvp(primals, tangents):
    x, zero = primals
    return rounded(x, zero), tangents[0]


def runtime_zero(tokens: jax.Array) -> jax.Array:
    """An int32 0 computed at run time from a forward's token ids (never negative), for `rounded`:
    a program's inputs, so no constant folding can see that it is 0."""
    return (jnp.min(tokens) < 0).astype(jnp.int32)


def tiled(fn, *xs: jax.Array) -> jax.Array:
    """`fn` applied to the rows of `xs` (arrays of M rows each: the same leading axis) in tiles of
    exactly `ROW_TILE` rows, one after the other in a loop (`jax.lax.map`, at least two trips; the
    last tiles padded): every reduction and product `fn` makes has the same shape, in the same loop
    body, in every program, so XLA:CPU picks the same kernel and order for it. (It picks by shape
    and context: a matmul of a few rows, or a reduction over a short axis of many rows, rounds
    otherwise than over 64 rows, and a loop of one trip is inlined into its surroundings.) `fn`
    maps tiles to one array."""
    m = xs[0].shape[0]
    n = max(2, -(-m // ROW_TILE))
    tiles = [jnp.pad(x, ((0, n * ROW_TILE - m),) + ((0, 0),) * (x.ndim - 1)).reshape(n, ROW_TILE, *x.shape[1:])
             for x in xs]
    out = jax.lax.map(lambda t: fn(*t), tuple(tiles))
    return out.reshape(n * ROW_TILE, *out.shape[2:])[:m]


def rowwise(fn, x: jax.Array) -> jax.Array:
    """`fn` (a function of rows along the last axis, e.g. a normalization) over `x`'s rows, its
    leading axes flattened, in `tiled` tiles."""
    out = tiled(fn, x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], *out.shape[1:])


def matmul_rows(x2: jax.Array, w2: jax.Array, preferred_element_type=None) -> jax.Array:
    """`x2 @ w2` (`[M, K] @ [K, N]`) in `tiled` tiles of rows: each row's result independent of M."""
    return tiled(lambda t: jnp.matmul(t, w2, preferred_element_type=preferred_element_type), x2)


def attend(q_MNH: jax.Array, k_MWKH: jax.Array, v_MWKH: jax.Array, valid_MW: jax.Array) -> jax.Array:
    """Each of M queries (unscaled, N heads) over its own window of W keys (K kv heads; `valid`
    marks the slots it sees), in `tiled` tiles; returns `[M, N, H]` in q's dtype."""
    m, n, h = q_MNH.shape
    kv = k_MWKH.shape[2]
    q = (q_MNH.astype(jnp.float32) / math.sqrt(h)).astype(q_MNH.dtype).reshape(m, kv, n // kv, h)

    def tile(q, k, v, valid):
        s = jnp.einsum("mkgh,mwkh->mkgw", q, k, preferred_element_type=jnp.float32)
        s = jnp.where(valid[:, None, None, :], s, _MASKED)  # finite: a padding query that sees nothing stays finite
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        vals = jnp.where(valid[:, :, None, None], v, 0).astype(jnp.float32)
        return jnp.einsum("mkgw,mwkh->mkgh", e, vals) / jnp.sum(e, axis=-1, keepdims=True)

    return tiled(tile, q, k_MWKH, v_MWKH, valid_MW).reshape(m, n, h).astype(q_MNH.dtype)


def window_indices(mask_BTS: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """For each query of a `[B, T, S]` visibility mask, the columns of the keys it sees in column
    (= position) order, `[B, T, W]` (S where none), and which window slots hold one."""
    b, t, s = mask_BTS.shape
    rank = jnp.cumsum(mask_BTS, axis=-1, dtype=jnp.int32) - 1
    slot = jnp.where(mask_BTS, rank, window)  # out of range: dropped
    bi, ti, ci = jnp.meshgrid(jnp.arange(b), jnp.arange(t), jnp.arange(s), indexing="ij")
    idx = jnp.full((b, t, window), s, jnp.int32).at[bi, ti, slot].set(ci, mode="drop")
    return idx, idx < s


def window_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BTS: jax.Array,
                     window: int) -> jax.Array:
    """Attention of full rows (training, scoring, prefill) in windows (module docstring): the same
    result for a token as `decode_window_attention` gives it in the engine."""
    b, t, n, h = q_BTNH.shape
    idx, valid = window_indices(mask_BTS, window)
    gather = jax.vmap(lambda x, i: jnp.concatenate([x, jnp.zeros_like(x[:1])])[i])  # [S+1, K, H] by [T, W]
    k_win, v_win = gather(k_BSKH, idx), gather(v_BSKH, idx)
    kv = k_BSKH.shape[2]
    out = attend(q_BTNH.reshape(b * t, n, h), k_win.reshape(b * t, window, kv, h),
                 v_win.reshape(b * t, window, kv, h), valid.reshape(b * t, window))
    return out.reshape(b, t, n, h)


def decode_window_attention(q_BNH: jax.Array, keys_BCKH: jax.Array, vals_BCKH: jax.Array, lengths_B: jax.Array,
                            k_new_BKH: jax.Array, v_new_BKH: jax.Array, window: int) -> jax.Array:
    """One decode step's attention in windows: each slot's cached keys (positions 0..C-1, the first
    `lengths[b]` real) with its new key at position `lengths[b]`, cut or padded to the window."""
    b, c = keys_BCKH.shape[:2]
    if c < window:
        pad = ((0, 0), (0, window - c), (0, 0), (0, 0))
        keys_BCKH, vals_BCKH = jnp.pad(keys_BCKH, pad), jnp.pad(vals_BCKH, pad)
    keys, vals = keys_BCKH[:, :window], vals_BCKH[:, :window]
    rows = jnp.arange(b)
    keys = keys.at[rows, lengths_B].set(k_new_BKH.astype(keys.dtype), mode="drop")
    vals = vals.at[rows, lengths_B].set(v_new_BKH.astype(vals.dtype), mode="drop")
    valid = jnp.arange(window, dtype=jnp.int32)[None, :] <= lengths_B[:, None]
    return attend(q_BNH, keys, vals, valid)


def rowwise_pair(fn, a: jax.Array, b: jax.Array) -> jax.Array:
    """`rowwise` for an elementwise `fn` of two arrays of one shape (e.g. `ops.swiglu`)."""
    d = a.shape[-1]
    return rowwise(lambda ab: fn(ab[:, :d], ab[:, d:]), jnp.concatenate([a, b], axis=-1))


def tempered_logprobs(logits_MV: jax.Array, temperature_M: jax.Array, bitwise: bool = False) -> jax.Array:
    """`log_softmax(logits / T)` per row in float32; rows with T = 0 (greedy) use T = 1: the logprob
    the engine reports for a sampled token (`tpurl.generate.sampling`), and in bitwise mode the
    trainer's too (then over rows padded to `ROW_TILE`)."""
    t_M = jnp.where(temperature_M > 0, temperature_M, 1.0).astype(jnp.float32)
    if not bitwise:
        return jax.nn.log_softmax(logits_MV.astype(jnp.float32) / t_M[:, None], axis=-1)
    x = jnp.concatenate([logits_MV.astype(jnp.float32), t_M[:, None]], axis=-1)  # each row with its T
    # (A tile's padding rows hold T = 0: they divide by 1.)
    return rowwise(lambda x: jax.nn.log_softmax(x[:, :-1] / jnp.where(x[:, -1:] > 0, x[:, -1:], 1.0), axis=-1), x)


def token_logprobs(hidden_MD: jax.Array, w_DV: jax.Array, tokens_M: jax.Array, temperature: float
                   ) -> tuple[jax.Array, jax.Array]:
    """`(logprob, entropy)` of each token `[M]` from the hidden state that predicts it, as the
    engine computes it: the logits by `matmul_rows`, then `tempered_logprobs`. The temperature
    enters as a runtime value (as the engine's does: plus a runtime 0 from `tokens_M`), so no
    constant folding makes this program's division and its loops other than the engine's."""
    logits = matmul_rows(hidden_MD, w_DV, jnp.float32)
    t_M = jnp.full((hidden_MD.shape[0],), temperature, jnp.float32) + runtime_zero(tokens_M).astype(jnp.float32)
    logp = tempered_logprobs(logits, t_M, bitwise=True)
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens_M, jnp.int32)[:, None], axis=-1)[:, 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)
