"""Packed sequences: the model forward of a padded batch without the compute on its padding.

A padded batch `[B, T]` (each row one sequence, padded to the task's longest prompt plus
`max_new_tokens`) spends most of its FLOPs on padding when completions are short. Packing puts the
B sequences' real tokens into R rows of the same length T (first-fit decreasing), each token
carrying its sequence's segment id (0 = padding) and its position within the sequence (restarting
at 0), so that attention is causal *and* within a segment and RoPE sees the same positions as in
the padded row. Only the model forward runs packed: its per-token outputs (next-token logprobs,
entropies, values) are gathered back to the padded `[B, T]` layout with a precomputed index map,
and the losses, advantages and KL run unchanged on `[B, T]`.

Blocks. The rows of a batch are split over the layout's batch shards (S, contiguous) and, inside
the train step, into micro-batches (M, interleaved: micro-batch m takes rows m, m + M, ...). A
sequence and the packed row that holds it must land in the same shard of the same micro-batch, so
packing works per block (m, s): the padded rows `m + M * (s * Bb + j)` (j < Bb = B / (M S)) go
into the packed rows `m + M * (s * Rb + k)` (k < Rb), every block padded to the same Rb rows.
`unpack_index[b, t]` is the position `k * T + offset` of token (b, t) inside its block's rows,
so the gather back is local to a device. Rb is rounded up to a multiple of
ceil(Bb / `PackingConfig.row_buckets`) (at most Bb, one sequence per row), so a run compiles at
most `row_buckets` packed shapes however its completion lengths vary from step to step.

The next-token shift: packed row position i predicts token i + 1 of the row, which at a boundary
is the next sequence's first token. Those outputs are never gathered: the padded result at (b, t)
is kept only where token t and its predecessor are both real (`scored_mask`), and then the
predecessor is also the packed predecessor.

Letters: B padded rows, T padded length (= packed row length), R packed rows, S batch shards,
M micro-batches, D embed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.config_types import check_types
from tpurl.models.transformer import DenseAttention, Transformer
from tpurl.sharding.layout import entry_axes

# The keys `pack_batch` adds to a batch (all `[R, T]` int32) and its index map (`[B, T]` int32).
PACKED_KEYS = ("packed_tokens", "packed_segments", "packed_positions")
INDEX_KEY = "unpack_index"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """Whether the update, the old/reference logprobs and the critic run on packed sequences.

    `row_buckets`: how many packed sizes a (shard, micro-batch) block may take. Its packed rows
    are rounded up to a multiple of ceil(its sequences / row_buckets), so a run compiles at most
    that many update (and logprobs) programs, each once, while the padding it adds stays under
    1/row_buckets of the padded rows; more buckets are less padding and more compiles.
    """

    enabled: bool = True
    row_buckets: int = 8

    def __post_init__(self):
        check_types(self)
        if self.row_buckets < 1:
            raise ValueError(f"PackingConfig.row_buckets={self.row_buckets} must be >= 1 (e.g. 8)")


def batch_shards(layout, mesh) -> int:
    """Devices the layout splits a batch's rows over on `mesh` (1 without a layout)."""
    if layout is None or mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in entry_axes(layout.batch_sharding(mesh, 1).spec[0]))


def _first_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing: each sequence's row and offset, and the number of rows used."""
    row_of, offset_of, fill = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64), []
    for j in np.argsort(-lengths, kind="stable"):
        k = next((i for i, used in enumerate(fill) if used + lengths[j] <= capacity), len(fill))
        if k == len(fill):
            fill.append(0)
        row_of[j], offset_of[j] = k, fill[k]
        fill[k] += int(lengths[j])
    return row_of, offset_of, max(len(fill), 1)


def pack_batch(tokens_BT, valid_BT, *, shards: int = 1, micro_batches: int = 1, row_buckets: int = 8
               ) -> dict[str, np.ndarray]:
    """The packed form of a padded batch (host numpy; see the module docstring for the layout).

    Returns `packed_tokens`, `packed_segments` (1, 2, ... per sequence within its block; 0 =
    padding), `packed_positions` (`[R, T]` int32 each) and `unpack_index` (`[B, T]` int32).
    The real tokens of a row need not be contiguous: they are packed in order, with positions
    counting the real tokens before them (as `positions_from_mask` does for the padded row).
    """
    tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)
    b, t = valid_BT.shape
    blocks = shards * micro_batches
    if b % blocks:
        raise ValueError(f"pack_batch: {b} rows do not split into {shards} batch shards x {micro_batches} "
                         f"micro-batches; use a batch size that is a multiple of {blocks}")
    bb, m = b // blocks, micro_batches
    lengths = valid_BT.sum(axis=1)
    padded_rows = [[mi + m * (si * bb + np.arange(bb)) for si in range(shards)] for mi in range(m)]
    plans = [[_first_fit(lengths[rows], t) for rows in per_m] for per_m in padded_rows]
    step = -(-bb // row_buckets)
    rb = min(-(-max(p[2] for per_m in plans for p in per_m) // step) * step, bb)
    r = blocks * rb
    out = {key: np.zeros((r, t), np.int32) for key in PACKED_KEYS}
    index_BT = np.zeros((b, t), np.int32)
    for mi in range(m):
        for si in range(shards):
            row_of, offset_of, _ = plans[mi][si]
            for j, src in enumerate(padded_rows[mi][si]):
                cols = np.flatnonzero(valid_BT[src])
                dst, span = mi + m * (si * rb + row_of[j]), slice(offset_of[j], offset_of[j] + len(cols))
                out["packed_tokens"][dst, span] = tokens_BT[src, cols]
                out["packed_segments"][dst, span] = j + 1
                out["packed_positions"][dst, span] = np.arange(len(cols))
                index_BT[src, cols] = row_of[j] * t + offset_of[j] + np.arange(len(cols))
    return {**out, INDEX_KEY: index_BT}


def packed_hidden(model: Transformer, tokens_RT, segments_RT, positions_RT, constrain=None) -> jax.Array:
    """Final hidden states `[R, T, D]` of packed rows: causal attention within each segment."""
    segments_RT = jnp.asarray(segments_RT, jnp.int32)
    attention = DenseAttention(segments_RT > 0, segment_ids_BT=segments_RT)
    hidden, _ = model(jnp.asarray(tokens_RT, jnp.int32), jnp.asarray(positions_RT, jnp.int32),
                      attention=attention, constrain=constrain)
    return hidden


def scored_mask(valid_BT) -> jax.Array:
    """`[B, T]`: where a next-token output exists (token t and its predecessor are real)."""
    valid = jnp.asarray(valid_BT, bool)
    return jnp.concatenate([jnp.zeros((valid.shape[0], 1), bool), valid[:, 1:] & valid[:, :-1]], axis=1)


def unpack(x_RT: jax.Array, index_BT: jax.Array, valid_BT, shards: int = 1) -> jax.Array:
    """Per-token outputs of packed rows gathered back to the padded `[B, T]` layout; 0 wherever
    the padded computation has no output (`scored_mask`). Differentiable (a gather).

    `x_RT` and `index_BT` are one micro-batch's (or the whole batch's, with one micro-batch);
    each of the `shards` blocks gathers from its own rows only.
    """
    r, t = x_RT.shape
    b = index_BT.shape[0]
    if r % shards or b % shards:
        raise ValueError(f"unpack: {r} packed rows and {b} rows must both split over {shards} batch shards")
    x_SN = x_RT.reshape(shards, (r // shards) * t)
    idx_SN = jnp.asarray(index_BT, jnp.int32).reshape(shards, (b // shards) * index_BT.shape[1])
    out_BT = jnp.take_along_axis(x_SN, idx_SN, axis=1).reshape(b, index_BT.shape[1])
    return jnp.where(scored_mask(valid_BT), out_BT, 0.0)


def is_packed(batch) -> bool:
    """Whether `batch` carries packed rows (and the index map back to its padded rows)."""
    return INDEX_KEY in batch


def packed_batch(batch, packing: PackingConfig | None, *, shards: int = 1, micro_batches: int = 1) -> dict:
    """The host boundary into a packed forward: `batch` (a dict of padded `[B, ...]` arrays with
    `tokens` and `valid`) with its tokens replaced by their packed form when `packing` is enabled
    (`valid` stays: the gather back and the losses need it); unchanged otherwise."""
    if packing is None or not packing.enabled or is_packed(batch):
        return dict(batch)
    out = {k: v for k, v in batch.items() if k != "tokens"}
    out.update(pack_batch(batch["tokens"], batch["valid"], shards=shards, micro_batches=micro_batches,
                          row_buckets=packing.row_buckets))
    return out


def to_padded(x_RT: jax.Array, batch, shards: int = 1) -> jax.Array:
    """A per-token output of the rows the forward ran on, in the padded `[B, T]` layout."""
    return unpack(x_RT, batch[INDEX_KEY], batch["valid"], shards) if is_packed(batch) else x_RT
