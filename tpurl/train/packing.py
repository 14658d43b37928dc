"""Packed sequences: the model forward of a padded batch without the compute on its padding.

A padded batch `[B, T]` (each row one sequence, padded to the task's longest prompt plus
`max_new_tokens`) spends most of its FLOPs on padding when completions are short, and a GRPO
batch computes each prompt once per sample. Packing puts the B sequences' real tokens into R rows
of L tokens, a multiple of T (`PackingConfig.row_length`), each token carrying its position
within its sequence (so RoPE sees the same positions as in the padded row), its predecessor in
the row and the end of its subtree. Only the model forward runs packed: its per-token outputs
(next-token logprobs, entropies, values) are gathered back to the padded `[B, T]` layout with a
precomputed index map, and the losses, advantages and KL run unchanged on `[B, T]`.

Shared prefixes. Sequences that begin with the same tokens may share them: a row then holds the
prefix tree of its sequences in depth-first order. A sequence's first token past the shared part
follows its sibling's tokens, not its own predecessor, so each token records its predecessor's
column (`packed_parents`, -1 for a sequence's first token), and its next-token outputs are read
from that column's state (`predecessors`). In depth-first order the tokens that can see token k
(k itself and every token after it in a sequence through k) are exactly the columns k up to its
subtree's end (`packed_ends`, 0 on padding), so attention is `k <= q < ends[k]`
(`DenseAttention(key_ends_BT=...)`): causal within each sequence, the shared prefix seen by every
sequence through it, nothing across sequences. Without sharing each subtree is a plain segment.
The padded computation's shared positions are the same tokens at the same positions, attending to
the same keys, so the outputs are the padded ones (up to float reassociation), and every padded
token that maps to a shared column adds its gradient there.

Rows. Each block's sequences are packed by first-fit decreasing, and with `share_prefixes` also by
first fit in lexicographic order where a sequence costs only its tokens past the prefix it shares
with the row; the block keeps the shared packing unless the plain one takes fewer rows. A row
holding fewer than L // T sequences has room for any other, so either takes at most
ceil(Bb / (L // T)) rows.

Blocks. The rows of a batch are split over the layout's batch shards (S, contiguous) and each
shard's rows into M micro-batches (contiguous within the shard: `micro_batch_split`). A sequence
and the packed row that holds it must land in the same shard of the same micro-batch, so packing
works per block (s, m): the padded rows `(s * M + m) * Bb + j` (j < Bb = B / (M S)) go into the
packed rows `(s * M + m) * Rb + k` (k < Rb), every block padded to the same Rb rows.
`unpack_index[b, t]` is the position `k * L + column` of token (b, t) inside its block's rows,
so the gather back is local to a device. Rb is rounded up to a multiple of ceil(the most rows a
block can take / `PackingConfig.row_buckets`), so a run compiles at most `row_buckets` packed
shapes however its completion lengths vary from step to step. Samples of one prompt share only
within a block; a block holds consecutive rows, where a group's samples sit (an RL step's whole
batch, and its minibatches of whole groups, `tpurl.rl.step.minibatch_order`; where the groups do
not divide into the minibatches, rows are shuffled and share less).

Letters: B padded rows, T padded length, R packed rows, L packed row length, S batch shards,
M micro-batches, D embed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.config_types import check_types
from tpurl.models.attention import DenseAttention
from tpurl.models.moe import routing_args
from tpurl.models.transformer import Transformer
from tpurl.sharding.layout import entry_axes

# The keys `pack_batch` adds to a batch (all `[R, L]` int32; with `COUNTS_KEY`) and its index map
# (`[B, T]` int32).
PACKED_KEYS = ("packed_tokens", "packed_positions", "packed_parents", "packed_ends")
INDEX_KEY = "unpack_index"
# `[R, L]` int32: how many padded tokens each packed column stands for (a group's shared prompt: one
# per sequence through it; 0 on padding), so that per-token sums over packed rows equal the padded ones.
COUNTS_KEY = "packed_counts"
# The blocks a batch was packed in, as the shape of an `[S, M]` array (batch shards, micro-batches):
# rows packed for other blocks would be read as the wrong sequences, so each reader checks it
# (`check_packed_format`) before it splits the rows.
FORMAT_KEY = "packed_format"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """Whether the update, the old/reference logprobs and the critic run on packed sequences.

    `row_buckets`: how many packed sizes a (shard, micro-batch) block may take. Its packed rows
    are rounded up to a multiple of ceil(the most rows it could need / row_buckets), so a run
    compiles at most that many update (and logprobs) programs, each once; more buckets are less
    padding and more compiles.

    `share_prefixes`: sequences in one row that begin alike (a GRPO group's samples of one prompt)
    hold their common prefix once; their tokens after it attend to that one copy (the row is
    their prefix tree). Used for a block unless plain packing takes fewer rows.

    `min_row_length`: packed rows are the largest multiple of the padded length T up to this (and
    at least T, at most a block's T x sequences) tokens long, so that short sequences of a group
    fit one row and share their prompt. Longer rows cost attention over the row (its FLOPs grow
    with the row length), which stays small next to the layers' matmuls while rows are no longer
    than a few hundred tokens.
    """

    enabled: bool = True
    row_buckets: int = 8
    share_prefixes: bool = True
    min_row_length: int = 128

    def __post_init__(self):
        check_types(self)
        if self.row_buckets < 1:
            raise ValueError(f"PackingConfig.row_buckets={self.row_buckets} must be >= 1 (e.g. 8)")
        if self.min_row_length < 0:
            raise ValueError(f"PackingConfig.min_row_length={self.min_row_length} must be >= 0 (e.g. 128)")

    def row_length(self, padded_length: int, block_rows: int) -> int:
        """Tokens per packed row for blocks of `block_rows` sequences padded to T = `padded_length`:
        the largest multiple of T up to `min_row_length` (at least T) that is at most the block's
        padded tokens. A multiple of T, so that a row holds whole padded rows' worth of sequences,
        and at most a block: packing never computes more tokens than the padded batch."""
        return padded_length * max(1, min(block_rows, self.min_row_length // max(padded_length, 1)))


def batch_shards(layout, mesh) -> int:
    """Devices the layout splits a batch's rows over on `mesh` (1 without a layout)."""
    if layout is None or mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in entry_axes(layout.batch_sharding(mesh, 1).spec[0]))


def _shared_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _fit_plain(seqs: list[np.ndarray], capacity: int) -> list[list[tuple[int, int]]]:
    """First-fit decreasing, no sharing: each row's `(sequence, shared length 0)` in row order."""
    rows, fill = [], np.zeros(len(seqs), np.int64)
    for j in sorted(range(len(seqs)), key=lambda j: -len(seqs[j])):
        k = int(np.argmax(fill + len(seqs[j]) <= capacity))  # a row not yet opened is empty
        if k == len(rows):
            rows.append([])
        rows[k].append((j, 0))
        fill[k] += len(seqs[j])
    return rows


def _fit_shared(seqs: list[np.ndarray], capacity: int) -> list[list[tuple[int, int]]]:
    """First fit in lexicographic order with shared prefixes: a sequence costs a row only its
    tokens past the longest prefix it shares with a sequence already there, and goes to the
    fitting row where that cost is least. Each row's `(sequence, shared length with its
    predecessor in the row)` in row order (which is the row's prefix tree in depth-first order).

    In this order the sequence a row shares most with is its last one, and the prefix two sorted
    sequences share is the least of the prefixes shared by the consecutive ones between them, so
    each row's shared length is a running minimum of consecutive shared lengths."""
    n = len(seqs)
    rows, fill, shared, prev = [], np.zeros(n, np.int64), np.zeros(n, np.int64), None
    for j in sorted(range(n), key=lambda j: tuple(seqs[j])):
        s = seqs[j]
        if prev is not None:
            shared = np.minimum(shared, _shared_len(prev, s))
        fits = fill + len(s) - shared <= capacity  # a row not yet opened is empty and fits
        k = int(np.argmax(np.where(fits, shared, -1)))
        if k == len(rows):
            rows.append([])
        rows[k].append((j, int(shared[k])))
        fill[k] += len(s) - shared[k]
        shared[k], prev = len(s), s
    return rows


def _lay_out_row(out: dict, index_BT: np.ndarray, row: int, local: int, items, seqs, sources, length: int):
    """Writes one packed row: each sequence's tokens past its shared prefix, in order, with their
    positions, predecessors (`packed_parents`, -1 for a sequence's first token) and subtree ends
    (`packed_ends`: one past the last token of any sequence through that token), and each padded
    token's place in the block (`index_BT`: `local * length + column`)."""
    pos, prev = 0, np.zeros(0, np.int64)
    for j, shared in items:
        s = seqs[j]
        new = len(s) - shared
        nodes = np.concatenate([prev[:shared], pos + np.arange(new)])
        out["packed_tokens"][row, pos:pos + new] = s[shared:]
        out["packed_positions"][row, pos:pos + new] = np.arange(shared, len(s))
        out["packed_parents"][row, pos:pos + new] = np.concatenate([[-1], nodes[:-1]])[shared:]
        out["packed_ends"][row, nodes] = pos + new  # grows with each sequence: every node's latest is its end
        src, cols = sources[j]
        index_BT[src, cols] = local * length + nodes
        pos, prev = pos + new, nodes


def pack_batch(tokens_BT, valid_BT, packing: PackingConfig | None = None, *, shards: int = 1,
               micro_batches: int = 1) -> dict[str, np.ndarray]:
    """The packed form of a padded batch (host numpy; see the module docstring for the layout).

    Returns `packed_tokens`, `packed_positions`, `packed_parents`, `packed_ends`, `packed_counts`
    (`[R, L]` int32 each; L = `packing.row_length(T, B / (shards x micro_batches))`),
    `unpack_index` (`[B, T]` int32) and `packed_format` (`[shards, micro_batches]` zeros: the
    blocks, `check_packed_format`). `packed_counts` holds how many padded tokens each column
    stands for (a shared prompt's: one per sequence through it).
    The real tokens of a row need not be contiguous: they are packed in order, with positions
    counting the real tokens before them (as `positions_from_mask` does for the padded row).
    """
    packing = packing or PackingConfig()
    tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)
    b, t = valid_BT.shape
    blocks = shards * micro_batches
    if b % blocks:
        raise ValueError(f"pack_batch: {b} rows do not split into {shards} batch shards x {micro_batches} "
                         f"micro-batches; use a batch size that is a multiple of {blocks}")
    bb, m = b // blocks, micro_batches
    length = packing.row_length(t, bb)
    blocks_rows = [(mi, si, (si * m + mi) * bb + np.arange(bb)) for si in range(shards) for mi in range(m)]
    plans = [_plan_block(tokens_BT, valid_BT, rows, length, packing.share_prefixes) for _, _, rows in blocks_rows]
    rb = _block_rows(max(max(len(p[0]), 1) for p in plans), bb, t, length, packing.row_buckets)
    out = {key: np.zeros((blocks * rb, length), np.int32) for key in PACKED_KEYS}
    out["packed_parents"][:] = -1
    index_BT = np.zeros((b, t), np.int32)
    for (mi, si, _), (row_items, seqs, sources) in zip(blocks_rows, plans):
        for k, items in enumerate(row_items):
            _lay_out_row(out, index_BT, (si * m + mi) * rb + k, k, items, seqs, sources, length)
    columns = _packed_columns(index_BT, blocks, blocks * rb, length)[valid_BT]
    counts = np.bincount(columns, minlength=blocks * rb * length).astype(np.int32).reshape(blocks * rb, length)
    return {**out, COUNTS_KEY: counts, INDEX_KEY: index_BT, FORMAT_KEY: np.zeros((shards, micro_batches), np.int8)}


def _plan_block(tokens_BT, valid_BT, rows, length: int, share: bool):
    """One block's rows (`[(sequence, shared length)]` each), its sequences' real tokens and each
    sequence's `(padded row, columns)`; sequences without tokens take no place."""
    sources = [(i, np.flatnonzero(valid_BT[i])) for i in rows if valid_BT[i].any()]
    seqs = [tokens_BT[i, cols] for i, cols in sources]
    plain = _fit_plain(seqs, length)
    if not share:
        return plain, seqs, sources
    shared = _fit_shared(seqs, length)
    return (shared if len(shared) <= len(plain) else plain), seqs, sources


def _block_rows(used: int, bb: int, t: int, length: int, buckets: int) -> int:
    """A block's packed rows: `used` rounded up to a multiple of ceil(most / buckets), where `most`
    = ceil(bb / (length // t)) is the most rows either fit can take (a row holding fewer than
    length // t sequences has room for any other), so at most `buckets` sizes occur."""
    most, step = _bucket_step(bb, t, length, buckets)
    return min(-(-used // step) * step, max(most, used))


def _bucket_step(bb: int, t: int, length: int, buckets: int) -> tuple[int, int]:
    """`(most, step)`: the most packed rows a block of `bb` sequences padded to `t` can take in rows
    of `length`, and the multiple its packed rows are rounded up to."""
    most = -(-bb // max(length // t, 1))
    return most, -(-most // buckets)


def row_ladder(rows: int, padded_length: int, length: int, blocks: int, buckets: int) -> tuple[int, ...]:
    """Every packed row count R a batch of `rows` sequences padded to `padded_length` can be packed
    into, in `blocks` blocks of rows `length` tokens long with `buckets` sizes
    (`PackingConfig.row_buckets`): what the programs on its packed rows can meet, smallest first."""
    most, step = _bucket_step(rows // blocks, padded_length, length, buckets)
    return tuple(blocks * min(k * step, most) for k in range(1, -(-most // step) + 1))


def packed_hidden(model: Transformer, batch, constrain=None, dropout_key=None):
    """`(hidden, routing)`: final hidden states `[R, L, D]` of packed rows, each token attending to
    itself and its predecessors in its sequence (the tokens whose subtree holds it, `packed_ends`),
    and a mixture-of-experts model's `moe.Routing` (replaying `packed_routes` when the batch has
    them), else None; `dropout_key`: a training forward's (`Transformer.__call__`)."""
    ends_RL = jnp.asarray(batch["packed_ends"], jnp.int32)
    attention = DenseAttention(ends_RL > 0, key_ends_BT=ends_RL)
    hidden, _, routing = model(jnp.asarray(batch["packed_tokens"], jnp.int32),
                               jnp.asarray(batch["packed_positions"], jnp.int32), attention=attention,
                               constrain=constrain, unroll=model.config.unroll_layers, dropout_key=dropout_key,
                               **routing_args(model.config.moe, batch.get("packed_routes"),
                                            batch[COUNTS_KEY] if model.config.moe else None))
    return hidden, routing


def predecessors(x: jax.Array, batch) -> tuple[jax.Array, jax.Array]:
    """`(x at each token's predecessor, where there is one)` in the rows the forward ran on: for
    padded rows the previous column, where both tokens are real (`scored_mask`); for packed rows
    the token's parent (`packed_parents`), which for a sequence sharing a prefix is not always the
    previous column. `x` is `[rows, len]` or `[rows, len, D]`; 0 where there is no predecessor.
    This is the next-token shift: position t's output is read from its predecessor's state."""
    tail = (1,) * (x.ndim - 2)
    if is_packed(batch):
        parents = jnp.asarray(batch["packed_parents"], jnp.int32)
        has = parents >= 0
        prev = jnp.take_along_axis(x, jnp.maximum(parents, 0).reshape(parents.shape + tail), axis=1)
    else:
        has = scored_mask(batch["valid"])
        prev = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    return jnp.where(has.reshape(has.shape + tail), prev, 0).astype(x.dtype), has


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
    (`valid` stays: the gather back and the losses need it); unchanged otherwise, or when it is
    packed already."""
    if is_packed(batch):
        check_packed_format(batch, shards, micro_batches)
        return dict(batch)
    if packing is None or not packing.enabled:
        return dict(batch)
    out = {k: v for k, v in batch.items() if k not in ("tokens", "routes")}
    out.update(pack_batch(batch["tokens"], batch["valid"], packing, shards=shards, micro_batches=micro_batches))
    if "routes" in batch:  # a router replay's routes follow their tokens into the packed rows
        out["packed_routes"] = packed_rows_of(batch["routes"], out[INDEX_KEY], batch["valid"],
                                              out["packed_tokens"].shape, shards * micro_batches, -1)
    return out


def _packed_columns(index_BT, blocks: int, rows: int, length: int) -> np.ndarray:
    """Each padded token's column `[B, T]` in the flattened packed rows `[rows * length]`:
    `unpack_index` is its place in its block's rows (`blocks` blocks of B / blocks padded rows and
    rows / blocks packed rows, in order)."""
    index_BT = np.asarray(index_BT)
    b = index_BT.shape[0]
    block_B = np.arange(b) // (b // blocks)
    return block_B[:, None] * (rows // blocks) * length + index_BT


def packed_rows_of(values_BT, index_BT, valid_BT, packed_shape: tuple[int, int], blocks: int, fill) -> np.ndarray:
    """Per-token values `[B, T, ...]` laid out as the packed rows `[R, L, ...]` hold their tokens
    (`_packed_columns`); `fill` where a packed column holds no token. Several padded positions
    share a column where a group shares a prefix: a value other than `fill` is kept (the values of
    a shared token are equal, but a sequence may lack one: a route it never recorded)."""
    values_BT, valid_BT = np.asarray(values_BT), np.asarray(valid_BT, bool)
    b, (r, length) = valid_BT.shape[0], packed_shape
    out = np.full((r * length, *values_BT.shape[2:]), fill, values_BT.dtype)
    flat_BT = _packed_columns(index_BT, blocks, r, length)
    known = valid_BT & np.all((values_BT != fill).reshape(b, values_BT.shape[1], -1), axis=-1)
    out[flat_BT[valid_BT & ~known]] = values_BT[valid_BT & ~known]
    out[flat_BT[known]] = values_BT[known]  # written last: a known value wins a shared column
    return out.reshape(r, length, *values_BT.shape[2:])


def take_rows(batch, rows: np.ndarray, sharding_for=None) -> dict:
    """`batch` (a dict of `[B, ...]` arrays) at `rows`: device arrays gathered on the device (into
    `sharding_for(ndim)` when given, e.g. the layout's batch sharding, so the rows land where the
    update reads them), host arrays on the host (nothing crosses between them)."""
    idx = jnp.asarray(rows)

    def take(v):
        if not isinstance(v, jax.Array):
            return np.asarray(v)[rows]
        return _gather_rows(None if sharding_for is None else sharding_for(v.ndim))(v, idx)

    return {k: take(v) for k, v in batch.items()}


@functools.cache
def _gather_rows(sharding):
    """A jitted row gather whose result has `sharding` (None: XLA's choice)."""
    return jax.jit(lambda v, idx: jnp.take(v, idx, axis=0), out_shardings=sharding)


def check_packed_format(batch, shards: int, micro_batches: int, what: str = "batch") -> None:
    """A one-line ValueError unless `batch`, where packed, was packed in the blocks of `shards` batch
    shards x `micro_batches` micro-batches that its reader splits it into (the shape of its
    `packed_format`; a static shape, so nothing is read from the device)."""
    if not is_packed(batch):
        return
    got = tuple(np.shape(batch[FORMAT_KEY])) if FORMAT_KEY in batch else None
    if got != (shards, micro_batches):
        raise ValueError(f"a {what} packed for (batch shards, micro-batches) = {got} is read as "
                         f"({shards}, {micro_batches}); pack it with the reader's own `prepare` (the same layout, mesh "
                         "and AlgorithmConfig.micro_batches)")


def check_micro_batches(rows: int, shards: int, micro_batches: int, what: str = "batch") -> None:
    """A one-line ValueError unless `rows` split into `micro_batches` in each of `shards` batch
    shards (what `micro_batch_split` needs)."""
    if rows % (shards * micro_batches):
        raise ValueError(f"a {what} of {rows} rows does not split into micro_batches={micro_batches} in each of the "
                         f"{shards} batch shards; use a multiple of {shards * micro_batches} "
                         "(AlgorithmConfig.micro_batches)")


def micro_batch_split(x: jax.Array, shards: int, micro_batches: int) -> jax.Array:
    """`[N, ...] -> [M, N / M, ...]`: micro-batch m holds the m-th of M contiguous chunks of every
    shard's rows (shard s's rows are the s-th contiguous block of N / S), so with the rows sharded
    over the S batch shards every device keeps its own rows and no data moves. Padded rows and
    packed rows split alike (`pack_batch` lays its blocks out in this order)."""
    n, m = x.shape[0], micro_batches
    per = n // (shards * m)
    return x.reshape((shards, m, per) + x.shape[1:]).swapaxes(0, 1).reshape((m, n // m) + x.shape[1:])


def micro_batch_merge(x: jax.Array, shards: int) -> jax.Array:
    """The inverse of `micro_batch_split`: `[M, N / M, ...] -> [N, ...]`."""
    m, rows = x.shape[:2]
    per = rows // shards
    return x.reshape((m, shards, per) + x.shape[2:]).swapaxes(0, 1).reshape((m * rows,) + x.shape[2:])


def to_padded(x_RT: jax.Array, batch, shards: int = 1) -> jax.Array:
    """A per-token output of the rows the forward ran on, in the padded `[B, T]` layout."""
    return unpack(x_RT, batch[INDEX_KEY], batch["valid"], shards) if is_packed(batch) else x_RT
