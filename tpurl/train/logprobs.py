"""Log-probabilities (and entropies) of the taken tokens without materializing `[B, T, V]` logits.

Convention (shared with the rollout engine and the losses): `logprobs[b, t] =
log p(tokens[b, t] | tokens[b, :t])` under `log_softmax(logits / temperature)`, aligned with the
token it scores; 0 at t = 0 and wherever token t or its predecessor is padding. `entropy[b, t]` is
the entropy of that same next-token distribution.

Why chunk: float32 logits of a 150k vocabulary over 8k tokens are 4.9 GB per sequence, and the
backward pass would keep them alive. The hidden states are split into time chunks of `chunk_size`
and (optionally) the vocabulary into chunks of `vocab_chunk_size` with an online log-sum-exp; each
chunk is a `jax.checkpoint`ed scan step, so only one chunk's logits exist at a time, in the
forward pass and in the backward pass (which recomputes them). Peak temporary memory is
O(B * chunk_size * vocab_chunk) instead of O(B * T * V).

Letters: B batch, T time, C time chunk, D embed, V vocab, U vocab chunk, N number of chunks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tpurl.models import invariant
from tpurl.models.attention import DenseAttention
from tpurl.models.moe import routing_args
from tpurl.models.transformer import Transformer, positions_from_mask
from tpurl.sharding.host import to_host, to_mesh
from tpurl.train.packed_shapes import PackedShapes
from tpurl.train.packing import (COUNTS_KEY, INDEX_KEY, PACKED_KEYS, PackingConfig, batch_shards, check_micro_batches,
                                 check_packed_format, is_packed, micro_batch_merge, micro_batch_split, packed_batch,
                                 packed_hidden, predecessors, to_padded)

DEFAULT_CHUNK = 128
_NEG = -1e30


def as_model(model_or_pair) -> Transformer:
    """A `Transformer`, or one merged from a `(graphdef, params)` pair (inside jit: no copy)."""
    if isinstance(model_or_pair, tuple):
        graphdef, params = model_or_pair
        return nnx.merge(graphdef, params)
    return model_or_pair


def with_compute_dtype(model: Transformer, dtype=None) -> Transformer:
    """The model computing in `dtype` (e.g. "bfloat16") on its stored (e.g. fp32 master) weights.

    Call it on a model merged inside the traced function: the config is static graph data, and
    swapping it makes every layer cast its weights to `dtype` at use, so gradients still arrive
    in the weights' own dtype. None keeps the model's configured compute dtype.
    """
    if dtype is not None and jnp.dtype(dtype) != model.config.compute_dtype:
        model.config = dataclasses.replace(model.config, dtype=jnp.dtype(dtype).name)
    return model


def forward_hidden(model: Transformer, tokens_BT, valid_BT, constrain=None, dropout_key=None,
                   routes_BTLK=None, with_routing: bool = False):
    """Final hidden states `[B, T, D]` of a padded batch under causal + padding attention
    (`dropout_key`: a training forward's, `Transformer.__call__`). A mixture-of-experts model
    replays `routes_BTLK` (each token's experts per sparse layer, -1: its own) when given; with
    `with_routing`, `(hidden, routing)` (`moe.Routing` over the real tokens, or None)."""
    valid_BT = jnp.asarray(valid_BT, bool)
    hidden, _, routing = model(tokens_BT, positions_from_mask(valid_BT), attention=DenseAttention(valid_BT),
                               constrain=constrain, unroll=model.config.unroll_layers, dropout_key=dropout_key,
                               **routing_args(model.config.moe, routes_BTLK, valid_BT))
    return (hidden, routing) if with_routing else hidden


def batch_prev_hidden(model: Transformer, batch, constrain=None, dropout_key=None):
    """`(prev_hidden, tokens, scored, routing)` of the rows the forward runs on (the padded `[B, T]`
    rows, or the packed `[R, L]` rows when the batch carries them, `tpurl.train.packing`; map
    per-token outputs back with `to_padded`): each token's predecessor's final hidden state (the
    state that predicts it), and where it has one; a mixture-of-experts model's `moe.Routing`
    (replaying the batch's `routes` when it has them), else None. `dropout_key`: a training
    forward's (None: scoring)."""
    if is_packed(batch):
        (hidden, routing), tokens = packed_hidden(model, batch, constrain, dropout_key), batch["packed_tokens"]
    else:
        hidden, routing = forward_hidden(model, batch["tokens"], batch["valid"], constrain, dropout_key,
                                         batch.get("routes"), with_routing=True)
        tokens = batch["tokens"]
    prev, scored = predecessors(hidden, batch)
    return prev, tokens, scored, routing


def _chunk_stats_full(h_BCD, w_DV, tgt_BC, inv_temp):
    """Target logprob and entropy of one time chunk over the whole vocabulary."""
    logits = jnp.einsum("BCD,DV->BCV", h_BCD, w_DV, preferred_element_type=jnp.float32) * inv_temp
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt_logit = jnp.take_along_axis(logits, tgt_BC[..., None], axis=-1)[..., 0]
    p = jnp.exp(logits - logz[..., None])
    return tgt_logit - logz, logz - jnp.sum(p * logits, axis=-1)


def _chunk_stats_streamed(h_BCD, w_NDU, tgt_BC, inv_temp, vocab_size):
    """Same as `_chunk_stats_full`, streaming over vocabulary chunks with an online log-sum-exp.

    Carries the running max `m`, `s = sum exp(l - m)`, `e = sum exp(l - m) * l` and the target
    logit; entropy = logZ - E_p[l] = (m + log s) - e / s.
    """
    u = w_NDU.shape[-1]

    @jax.checkpoint
    def body(carry, xs):
        m, s, e, tgt_logit = carry
        w_DU, offset = xs
        logits = jnp.einsum("BCD,DU->BCU", h_BCD, w_DU, preferred_element_type=jnp.float32) * inv_temp
        col = offset + jnp.arange(u)
        # Padded vocab columns get a finite "minus infinity": with -inf, 0 * inf = nan would
        # leak into the backward pass of p * logits.
        logits = jnp.where((col < vocab_size)[None, None, :], logits, _NEG)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        s = s * scale + p.sum(axis=-1)
        e = e * scale + jnp.sum(p * logits, axis=-1)
        local = tgt_BC - offset
        inside = (local >= 0) & (local < u)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, u - 1)[..., None], axis=-1)[..., 0]
        return (m_new, s, e, jnp.where(inside, picked, tgt_logit)), None

    shape = tgt_BC.shape
    init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    offsets = jnp.arange(w_NDU.shape[0], dtype=jnp.int32) * u
    (m, s, e, tgt_logit), _ = jax.lax.scan(body, init, (w_NDU, offsets))
    logz = m + jnp.log(s)
    return tgt_logit - logz, logz - e / s


def logprobs_from_hidden(hidden_BTD: jax.Array, w_DV: jax.Array, tokens_BT: jax.Array, valid_BT: jax.Array, *,
                         temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                         vocab_chunk_size: int | None = None, bitwise: bool = False) -> tuple[jax.Array, jax.Array]:
    """Chunked `(logprobs_BT, entropy_BT)` from the final hidden states of padded rows and the
    unembedding `[D, V]`: position t - 1 predicts token t (`next_token_logprobs` after the shift)."""
    prev_BTD, scored_BT = predecessors(hidden_BTD, {"valid": valid_BT})
    return next_token_logprobs(prev_BTD, w_DV, tokens_BT, scored_BT, temperature=temperature, chunk_size=chunk_size,
                               vocab_chunk_size=vocab_chunk_size, bitwise=bitwise)


def next_token_logprobs(prev_BTD: jax.Array, w_DV: jax.Array, tokens_BT: jax.Array, scored_BT: jax.Array, *,
                        temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                        vocab_chunk_size: int | None = None, bitwise: bool = False) -> tuple[jax.Array, jax.Array]:
    """Chunked `(logprobs_BT, entropy_BT)` of each token from the hidden state that predicts it
    (`prev_BTD`, already shifted), 0 where `scored_BT` is False.

    `chunk_size` bounds the time positions whose logits exist at once; `vocab_chunk_size` (None:
    the whole vocabulary) bounds the vocabulary columns. Differentiable; the backward pass
    recomputes each chunk's logits instead of storing them. `bitwise` (`ModelConfig.consistency`):
    computed as the rollout engine computes them (`tpurl.models.invariant.token_logprobs`: in row
    tiles, neither chunked nor recomputed; `chunk_size` and `vocab_chunk_size` do not apply).
    """
    if bitwise:
        b, t, d = prev_BTD.shape
        lp, ent = invariant.token_logprobs(prev_BTD.reshape(b * t, d), w_DV, jnp.reshape(tokens_BT, -1), temperature)
        scored = jnp.asarray(scored_BT, bool)
        return jnp.where(scored, lp.reshape(b, t), 0.0), jnp.where(scored, ent.reshape(b, t), 0.0)
    if chunk_size <= 0 or (vocab_chunk_size is not None and vocab_chunk_size <= 0):
        raise ValueError(f"chunk_size={chunk_size} and vocab_chunk_size={vocab_chunk_size} must be positive")
    b, t, d = prev_BTD.shape
    v = w_DV.shape[1]
    inv_temp = 1.0 / float(temperature)
    c = max(min(chunk_size, t), 1)
    n = math.ceil(t / c)
    pad = n * c - t
    h_NBCD = jnp.pad(prev_BTD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    tgt_NBC = jnp.pad(jnp.asarray(tokens_BT, jnp.int32), ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

    if vocab_chunk_size is None or vocab_chunk_size >= v:
        def stats(h, tgt):
            return _chunk_stats_full(h, w_DV, tgt, inv_temp)
    else:
        u = vocab_chunk_size
        nv = math.ceil(v / u)
        w_NDU = jnp.pad(w_DV, ((0, 0), (0, nv * u - v))).reshape(d, nv, u).swapaxes(0, 1)

        def stats(h, tgt):
            return _chunk_stats_streamed(h, w_NDU, tgt, inv_temp, v)

    @jax.checkpoint
    def body(_, xs):
        return None, stats(*xs)

    _, (lp_NBC, ent_NBC) = jax.lax.scan(body, None, (h_NBCD, tgt_NBC))
    lp_BT = lp_NBC.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent_BT = ent_NBC.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    scored = jnp.asarray(scored_BT, bool)
    return jnp.where(scored, lp_BT, 0.0), jnp.where(scored, ent_BT, 0.0)


def token_logprobs(model_or_pair, tokens_BT: jax.Array, valid_BT: jax.Array, *, temperature: float = 1.0,
                   chunk_size: int = DEFAULT_CHUNK, vocab_chunk_size: int | None = None,
                   constrain=None) -> tuple[jax.Array, jax.Array]:
    """`(logprobs_BT, entropy_BT)` of a padded batch under the model at `temperature`.

    `model_or_pair` is a `Transformer` or `(graphdef, params)`. See the module docstring for the
    alignment convention and the memory bound.
    """
    model = as_model(model_or_pair)
    hidden = forward_hidden(model, tokens_BT, valid_BT, constrain)
    return logprobs_from_hidden(hidden, model.unembedding(constrain), tokens_BT, valid_BT,
                                temperature=temperature, chunk_size=chunk_size,
                                vocab_chunk_size=vocab_chunk_size, bitwise=model.config.bitwise)


def make_logprob_fn(graphdef, *, mesh: Mesh | None = None, layout=None, temperature: float = 1.0,
                    chunk_size: int = DEFAULT_CHUNK, vocab_chunk_size: int | None = None, compute_dtype=None,
                    packing: PackingConfig | None = None, micro_batches: int = 1
                    ) -> Callable[[nnx.State, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """A jitted `fn(params, tokens_BT, valid_BT) -> (logprobs_BT, entropy_BT)` for scoring batches
    (old-policy and reference logprobs) in a layout: weights pinned to their compute sharding,
    the batch and the outputs sharded over the layout's batch axes. Use the train step's
    `compute_dtype` so that old-policy ratios start at 1 (up to rounding). With `packing` enabled
    the forward runs on packed rows (`tpurl.train.packing`); the outputs are the same `[B, T]`.
    `micro_batches` scores the rows in the update's micro-batches (`packing.micro_batch_split`),
    one forward each in a loop, so the pass holds one micro-batch's activations (B / M rows).

    `fn.on_batch(params, batch)` scores a batch prepared as the train step prepares it (packed
    with the same micro-batches and placed: `make_train_step(...).prepare`), so one placed batch
    serves the scoring passes and the update; `fn.lower` lowers the pass (XLA's analyses)."""
    sharded = mesh is not None and layout is not None
    constrain = layout.compute_constrain(mesh) if sharded else None
    shards = batch_shards(layout, mesh)

    def _score(params, batch):
        model = with_compute_dtype(as_model((graphdef, params)), compute_dtype)
        prev, tokens, scored, _ = batch_prev_hidden(model, batch, constrain)
        lp, ent = next_token_logprobs(prev, model.unembedding(constrain), tokens, scored, temperature=temperature,
                                      chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                                      bitwise=model.config.bitwise)
        return to_padded(lp, batch, shards), to_padded(ent, batch, shards)

    out_shardings = (layout.batch_sharding(mesh, 2),) * 2 if sharded else None
    return scoring_fn(_score, out_shardings, packing, shards, micro_batches, mesh, layout)


def scoring_fn(score, out_shardings, packing, shards: int, micro_batches: int, mesh, layout):
    """`fn(*args, tokens_BT, valid_BT)` over `score(*args, batch)` (see `make_logprob_fn`), with
    `fn.on_batch(*args, batch)` for a prepared batch and `fn.lower(*args, tokens_BT, valid_BT)`
    (`fn.on_batch.lower(*args, batch)`: the same program, from a prepared batch;
    `fn.on_batch.shapes`: the packed shapes it has met, `tpurl.train.packed_shapes`)."""
    jitted = jax.jit(in_micro_batches(score, shards, micro_batches, mesh, layout), out_shardings=out_shardings)
    shapes = PackedShapes(shards * micro_batches, packing.row_buckets if packing else 1)

    def on_batch(*args):
        args = (*args[:-1], _scoring_keys(args[-1], shards, micro_batches))
        shapes.record(jitted.lower, *args)
        return jitted(*args)

    on_batch.lower = lambda *args: jitted.lower(*args[:-1], _scoring_keys(args[-1], shards, micro_batches))

    def prepare(tokens_BT, valid_BT):
        return scoring_batch(tokens_BT, valid_BT, packing, shards, mesh, layout, micro_batches=micro_batches)

    def fn(*args):
        *head, tokens_BT, valid_BT = args
        return on_batch(*head, prepare(tokens_BT, valid_BT))

    def lower(*args):
        *head, tokens_BT, valid_BT = args
        return on_batch.lower(*head, prepare(tokens_BT, valid_BT))

    on_batch.shapes = shapes
    fn.on_batch, fn.lower = on_batch, lower
    return fn


def _scoring_keys(batch, shards: int, micro_batches: int) -> dict:
    """What a scoring pass reads of a batch: the (packed) tokens, `valid`, the index map, and a
    mixture-of-experts model's replayed routes and packed column counts, once the packed rows are
    checked to be in the pass's blocks (`check_packed_format`)."""
    check_packed_format(batch, shards, micro_batches, what="scoring pass's batch")
    return {k: v for k, v in batch.items() if k in ("tokens", "valid", "routes", "packed_routes", COUNTS_KEY,
                                                    INDEX_KEY, *PACKED_KEYS)}


def in_micro_batches(score, shards: int, micro_batches: int, mesh=None, layout=None):
    """`score(*args, batch)` (a pytree of `[rows, T]` outputs) run on `micro_batches` micro-batches
    of `batch` in a loop (`jax.lax.map`: one micro-batch's activations at a time) and merged back
    into `[B, T]`; the micro-batches are the update's (`packing.micro_batch_split`). Rows are scored
    independently, so the result equals one pass over the whole batch."""
    if micro_batches == 1:
        return score

    def split_score(*args):
        *head, batch = args
        check_micro_batches(batch["valid"].shape[0], shards, micro_batches, what="scoring pass")
        mbs = {k: micro_batch_split(v, shards, micro_batches) for k, v in batch.items()}

        def one(mb):
            return score(*head, layout.constrain_batch(mesh, mb) if mesh is not None and layout is not None else mb)

        out = jax.lax.map(one, mbs)
        return jax.tree.map(lambda x: micro_batch_merge(x, shards), out)

    return split_score


def scoring_batch(tokens_BT, valid_BT, packing: PackingConfig | None, shards: int, mesh=None, layout=None, *,
                  micro_batches: int = 1) -> dict:
    """The device batch of a scoring pass (logprobs, values): `{tokens, valid}`, or their packed
    form with `packing` enabled (blocks per shard and micro-batch, as the update packs), sharded
    over the layout's batch axes when there is one."""
    batch = to_host({"tokens": tokens_BT, "valid": valid_BT})
    if packing is not None and packing.enabled:
        batch = packed_batch(batch, packing, shards=shards, micro_batches=micro_batches)
    batch = {k: np.asarray(v, bool if k == "valid" else np.int32) for k, v in batch.items()}
    if mesh is None or layout is None:
        return batch
    # Every process holds the same host batch and places only its own shards (no cross-process check).
    return to_mesh(batch, {k: layout.batch_sharding(mesh, v.ndim) for k, v in batch.items()})
