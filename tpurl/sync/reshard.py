"""Weight sync as a resharding: train params (fp32 master, train layout) -> rollout params
(rollout dtype, rollout layout), on the devices the arrays already live on.

Three ways to move the bytes; `SyncConfig.method="auto"` picks `permute` when disjoint pools hold
devices of more than one process, else the faster of the first two as measured on this backend:

  * `device_put`: cast and relayout on the *source* devices into a staging sharding whose shards
    are exactly the target's (the rollout layout on a mesh of the source devices shaped like the
    rollout mesh), then `jax.device_put` into the rollout sharding, which then copies whole shards
    device to device. The way across disjoint meshes of one process (disaggregated placement),
    where a jit is rejected.
  * `jit`: one jitted cast + `with_sharding_constraint` per piece; XLA emits the collectives.
    Needs the source and target shardings to share one device assignment.
  * `permute`: stage like `device_put`, then cross with one collective permute over a mesh spanning
    both pools (`tpurl.sync.cross_process`). The way between pools of a multi-process run (a train
    process and a rollout process, or pools that split every process's devices), where
    `jax.device_put` cannot move a global array.

Bucketing bounds the peak extra memory: the leaves to move are cut into *pieces* of at most
`bucket_bytes` (at the rollout dtype) -- a stacked `[L, ...]` layer parameter is sliced along its
first axis that neither layout shards (the `layers` axis) -- and pieces are grouped into buckets.
After each bucket the host waits for the device, so at most one bucket of temporaries (sliced
source, cast copy, collective buffers) is in flight beyond the rollout params being built. A
sliced leaf is assembled in place: its rollout buffer is allocated once and each piece is written
into it with a donated `dynamic_update_slice`, so assembly never holds two copies.

Host traffic. Every op is device-side; the only host->device transfers are explicit `device_put`s
of the int32 slice offsets. `jax.device_put` itself would relay a layout change through the host
(when a target shard is not a slice that the source already holds, it assembles the whole array on
the host and uploads it again), which is why the `device_put` method stages the target layout on
the source devices first. Without a staging mesh (train and rollout pools of different sizes) the
relay remains. `tests/host_guard.py` checks every method for host copies and host ops.

A leaf may also be *derived* (`tpurl.sync.derived`): an object with the shape and train-layout
sharding of the array it computes, a `materialize()` that computes it inside a program, and
`slice_layers(start, size)` for a piece along its first axis: a LoRA weight merged with its adapter
(`tpurl.sync.lora.MergedWeight`), a quantized weight's values or scales
(`tpurl.sync.quantize.QuantizedPart`, made here when `SyncConfig.quantize` is set). The bucket's
program computes it, casts and reshards in one go, so the weight is never held in full at the train
layout.

Leaves whose sharding and dtype already match the target are passed through (same buffers, no
copy); when all of them match, the sync is free. Note the aliasing that implies: a free sync's
rollout params *are* the train params, so the trainer must not donate them while a rollout runs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from tpurl.sync.config import SyncConfig, SyncReport
from tpurl.sync.derived import is_derived, leaf_slice, leaf_value
from tpurl.sync.quantize import quantized_state
from tpurl.sharding.host import broadcast_from_writer
from tpurl.sync.cross_process import PROGRAM_CACHE_SIZE, check_permutable, crosses_processes, permute_to


@dataclasses.dataclass(frozen=True)
class _Leaf:
    src: jax.Array
    dst: Sharding
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the rollout leaf (what the sync moves)."""
        return int(np.prod(self.src.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def work_bytes(self) -> int:
        """Bytes a program making this leaf holds beyond its inputs: the leaf, and for a derived
        leaf its float32 computation over what it is computed from (`source_size` elements where
        the leaf says, e.g. a quantized weight's scales read the whole weight; else its own size):
        what buckets are sized by."""
        if not is_derived(self.src):
            return self.nbytes
        return self.nbytes + 4 * int(getattr(self.src, "source_size", np.prod(self.src.shape, dtype=np.int64)))


@dataclasses.dataclass(frozen=True)
class _Piece:
    leaf: int
    axis: int | None  # None: the whole leaf in one go
    start: int
    size: int
    nbytes: int


def flatten_with_shardings(train_params, rollout_shardings) -> tuple[list[jax.Array], list[Sharding], Any]:
    """Leaves of `train_params` (arrays, or derived leaves) and the target sharding of each;
    `rollout_shardings` may be any prefix of the params tree (e.g. one sharding per `nnx.Param`,
    or a single sharding)."""
    shardings, sdef = jax.tree.flatten(rollout_shardings, is_leaf=lambda x: isinstance(x, Sharding))
    try:
        subtrees = sdef.flatten_up_to(train_params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rollout_shardings does not match the structure of train_params ({e}); build it "
                         "with layout.param_shardings(params, mesh)") from None
    leaves, targets = [], []
    for s, sub in zip(shardings, subtrees):
        if not isinstance(s, Sharding):
            raise ValueError(f"rollout_shardings holds {type(s).__name__}, not a jax Sharding")
        for x in jax.tree.leaves(sub, is_leaf=is_derived):
            if not isinstance(x, jax.Array) and not is_derived(x):
                raise ValueError(f"train_params holds a {type(x).__name__} leaf; sync moves jax.Arrays only")
            leaves.append(x)
            targets.append(s)
    return leaves, targets, jax.tree.structure(train_params, is_leaf=is_derived)


def rollout_dtype_of(x: jax.Array, cfg: SyncConfig) -> np.dtype:
    """The rollout dtype of leaf `x`: a derived leaf's own `rollout_dtype` where it has one (a
    quantized weight's), else `cfg.rollout_dtype` for floating leaves, else x's own."""
    if getattr(x, "rollout_dtype", None) is not None:
        return np.dtype(x.rollout_dtype)
    if cfg.rollout_dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return np.dtype(x.dtype)
    return np.dtype(jnp.dtype(cfg.rollout_dtype))


def _same_layout(leaf: _Leaf) -> bool:
    return leaf.src.sharding.is_equivalent_to(leaf.dst, leaf.src.ndim)


def _unchanged(leaf: _Leaf) -> bool:
    return not is_derived(leaf.src) and leaf.src.dtype == leaf.dtype and _same_layout(leaf)


def _same_assignment(a: Sharding, b: Sharding) -> bool:
    """True when a single jit may take `a` in and give `b` out (same devices in the same order)."""
    if isinstance(a, NamedSharding) and isinstance(b, NamedSharding):
        return tuple(a.mesh.devices.flat) == tuple(b.mesh.devices.flat)
    return a.device_set == b.device_set and len(a.device_set) == 1


def _split_axis(leaf: _Leaf) -> int | None:
    """First axis of length > 1 that neither layout shards (the stacked `layers` axis in practice);
    pieces are cut along it. None when the leaf cannot be sliced (or is not on a named mesh)."""
    if not (isinstance(leaf.src.sharding, NamedSharding) and isinstance(leaf.dst, NamedSharding)):
        return None
    shape = leaf.src.shape
    src_shard, dst_shard = leaf.src.sharding.shard_shape(shape), leaf.dst.shard_shape(shape)
    for axis, n in enumerate(shape[:1] if is_derived(leaf.src) else shape):  # derived: sliced by layer only
        if n > 1 and src_shard[axis] == n and dst_shard[axis] == n:
            return axis
    return None


def _pieces(leaf_index: int, leaf: _Leaf, bucket_bytes: int) -> list[_Piece]:
    axis = _split_axis(leaf) if leaf.work_bytes > bucket_bytes else None
    if axis is None:
        return [_Piece(leaf_index, None, 0, 0, leaf.work_bytes)]
    n = leaf.src.shape[axis]
    slab = leaf.work_bytes // n
    # Largest divisor of n that fits the bucket: equal pieces share one compiled program.
    size = max([d for d in range(1, n + 1) if n % d == 0 and d * slab <= bucket_bytes] or [1])
    return [_Piece(leaf_index, axis, start, size, size * slab) for start in range(0, n, size)]


def _buckets(pieces: list[_Piece], bucket_bytes: int) -> list[list[_Piece]]:
    buckets, current, used = [], [], 0
    for piece in pieces:
        if current and used + piece.nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(piece)
        used += piece.nbytes
    if current:
        buckets.append(current)
    return buckets


# Jitted building blocks; shardings and dtypes are static so repeated syncs hit the compile cache.
@functools.partial(jax.jit, static_argnames=("dtype", "sharding"))
def cast_to(x, *, dtype, sharding):
    """Cast and (when `sharding` differs from x's) reshard; with x's own sharding a local cast."""
    return jax.lax.with_sharding_constraint(leaf_value(x).astype(dtype), sharding)


# A program's target shardings are its `out_shardings`, never a sharding constraint inside it: a
# constraint to a mesh of another shape (the rollout mesh over the same devices) is dropped by the
# partitioner and the result comes out replicated. One compiled program per (static) signature.
@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def cast_then_reshard_program(dtypes, src, dst):
    """The jitted `xs -> [x.astype(dt) in dst]`: each leaf is cast in its source layout, then
    resharded, one program for a bucket of leaves.

    Pinning the cast to the source layout lets the collective move rollout-dtype bytes (half of
    fp32). Backends without bf16 collectives may still upcast around the gather (XLA:CPU does),
    which is one reason `auto` measures instead of assuming.
    """
    def cast_then_reshard(xs):
        return [jax.lax.with_sharding_constraint(leaf_value(x).astype(dt), s) for x, dt, s in zip(xs, dtypes, src)]
    return jax.jit(cast_then_reshard, out_shardings=list(dst))


def _cast_then_reshard(xs, *, dtypes, src, dst):
    return cast_then_reshard_program(dtypes, src, dst)(xs)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _zeros(*, shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _slice_cast_program(axis, size, dtype, sharding):
    return jax.jit(lambda x, start: leaf_value(leaf_slice(x, start, size, axis)).astype(dtype), out_shardings=sharding)


def _slice_cast(x, start, *, axis, size, dtype, sharding):
    return _slice_cast_program(axis, size, dtype, sharding)(x, start)


@functools.partial(jax.jit, static_argnames=("axis", "sharding"), donate_argnums=(0,))
def _write(out, piece, start, *, axis, sharding):
    return jax.lax.with_sharding_constraint(jax.lax.dynamic_update_slice_in_dim(out, piece, start, axis), sharding)


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _slice_cast_reshard_write_program(axis, size, dtype, src, dst):
    def write(out, x, start):
        # Slice and cast before the collective, then move only the piece into `out`'s layout (on one
        # mesh this keeps the temporaries piece-sized; `out_shardings` makes the result right either way).
        piece = jax.lax.with_sharding_constraint(leaf_value(leaf_slice(x, start, size, axis)).astype(dtype), src)
        piece = jax.lax.with_sharding_constraint(piece, dst)
        return jax.lax.dynamic_update_slice_in_dim(out, piece, start, axis)
    return jax.jit(write, out_shardings=dst, donate_argnums=0)


def _slice_cast_reshard_write(out, x, start, *, axis, size, dtype, src, dst):
    return _slice_cast_reshard_write_program(axis, size, dtype, src, dst)(out, x, start)


def staging_sharding(src: Sharding, dst: Sharding) -> Sharding:
    """Where the `device_put` method lays a leaf out before `jax.device_put(..., dst)`: `dst`'s spec
    on the source devices, arranged like `dst`'s mesh (in the source mesh's device order, so a jit
    from `src` may produce it). Every staged shard is then exactly one target shard: the put copies
    whole shards. `src` itself when there is no such arrangement (not both named shardings, or
    meshes of different sizes)."""
    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)) or src.mesh.size != dst.mesh.size:
        return src
    if src.mesh.devices.shape == dst.mesh.devices.shape and src.mesh.axis_names == dst.mesh.axis_names:
        mesh = src.mesh
    else:
        devices = np.asarray(src.mesh.devices).reshape(dst.mesh.devices.shape)
        mesh = Mesh(devices, dst.mesh.axis_names, axis_types=dst.mesh.axis_types)
    return NamedSharding(mesh, dst.spec, memory_kind=src.memory_kind)


def _replicated(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, P())


class _Offsets:
    """Device-resident int32 slice offsets, one explicit (guard-allowed) transfer each, reused."""

    def __init__(self):
        self._cache: dict[tuple, jax.Array] = {}

    def __call__(self, start: int, sharding: NamedSharding) -> jax.Array:
        key = (start, sharding.mesh)
        if key not in self._cache:
            self._cache[key] = jax.device_put(np.int32(start), _replicated(sharding))
        return self._cache[key]


def _cross(method: str, staged: list[jax.Array], dsts: list[Sharding]) -> list[jax.Array]:
    """The last step of the `device_put` and `permute` methods: staged shards to the target devices."""
    return permute_to(staged, dsts) if method == "permute" else jax.device_put(staged, dsts)


def _run_whole(method: str, leaves: list[_Leaf]) -> list[jax.Array]:
    """Move whole leaves: two dispatches per bucket (not two per leaf), which is what small models
    on a busy host pay for."""
    src = tuple(leaf.src.sharding for leaf in leaves)
    dtypes = tuple(leaf.dtype for leaf in leaves)
    xs = [leaf.src for leaf in leaves]
    if method == "jit":
        return _cast_then_reshard(xs, dtypes=dtypes, src=src, dst=tuple(leaf.dst for leaf in leaves))
    staged = tuple(staging_sharding(leaf.src.sharding, leaf.dst) for leaf in leaves)
    work = [i for i, leaf in enumerate(leaves)
            if is_derived(leaf.src) or leaf.src.dtype != leaf.dtype or staged[i] != src[i]]
    if work:  # cast and relayout on the source devices (collectives among them, if any)
        sub = lambda t: tuple(t[i] for i in work)  # noqa: E731
        for i, y in zip(work, _cast_then_reshard(sub(xs), dtypes=sub(dtypes), src=sub(src), dst=sub(staged))):
            xs[i] = y
    return _cross(method, xs, [leaf.dst for leaf in leaves])


def _run_slice(method: str, piece: _Piece, leaf: _Leaf, out: jax.Array | None, offsets: _Offsets) -> jax.Array:
    """Move one slice of a leaf into its (lazily allocated) rollout buffer, written in place."""
    dt = leaf.dtype
    if out is None:
        out = _zeros(shape=leaf.src.shape, dtype=dt, sharding=leaf.dst)
    if method == "jit":
        return _slice_cast_reshard_write(out, leaf.src, offsets(piece.start, leaf.dst), axis=piece.axis,
                                         size=piece.size, dtype=dt, src=leaf.src.sharding, dst=leaf.dst)
    src_piece = _slice_cast(leaf.src, offsets(piece.start, leaf.src.sharding), axis=piece.axis, size=piece.size,
                            dtype=dt, sharding=staging_sharding(leaf.src.sharding, leaf.dst))
    moved = _cross(method, [src_piece], [leaf.dst])[0]
    return _write(out, moved, offsets(piece.start, leaf.dst), axis=piece.axis, sharding=leaf.dst)


def _execute(method: str, leaves: list[_Leaf], moving: list[int], bucket_bytes: int):
    outs: list[jax.Array | None] = [None] * len(leaves)
    pieces = [p for i in moving for p in _pieces(i, leaves[i], bucket_bytes)]
    buckets = _buckets(pieces, bucket_bytes)
    offsets = _Offsets()
    for bucket in buckets:
        whole = [p.leaf for p in bucket if p.axis is None]
        if whole:
            for i, y in zip(whole, _run_whole(method, [leaves[i] for i in whole])):
                outs[i] = y
        for piece in bucket:
            if piece.axis is not None:
                outs[piece.leaf] = _run_slice(method, piece, leaves[piece.leaf], outs[piece.leaf], offsets)
        # Wait for this bucket before dispatching the next: bounds the temporaries in flight.
        jax.block_until_ready([outs[p.leaf] for p in bucket])
    return outs, buckets


# backend platform -> the method measured faster there (filled by `calibrate`).
_AUTO_CHOICE: dict[str, str] = {}


def _resolve_method(cfg: SyncConfig, leaves: list[_Leaf], moving: list[int]) -> str | None:
    jit_ok = all(_same_assignment(leaves[i].src.sharding, leaves[i].dst) for i in moving)
    if cfg.method == "jit" and not jit_ok:
        raise ValueError("SyncConfig.method='jit' cannot move weights between different device sets (a jit "
                         "spanning two meshes is rejected); use method='device_put', 'permute' or 'auto'")
    across = any(crosses_processes(leaves[i].src.sharding, leaves[i].dst) for i in moving)
    if cfg.method == "permute" or (cfg.method == "auto" and across):
        for i in moving:  # one line, before anything is dispatched
            check_permutable(staging_sharding(leaves[i].src.sharding, leaves[i].dst), leaves[i].dst)
        return "permute"
    if cfg.method != "auto":
        return cfg.method
    if not jit_ok:
        return "device_put"
    return _AUTO_CHOICE.get(jax.default_backend())


def calibrate(train_params, rollout_shardings, cfg: SyncConfig, repeats: int = 2) -> dict[str, float]:
    """Time both methods on this sync (after one warm-up each), remember the faster one for this
    backend (used by `method="auto"`), and return the best seconds per method."""
    times = {}
    for method in ("device_put", "jit"):
        sub = dataclasses.replace(cfg, method=method)
        sync_weights(train_params, rollout_shardings, sub)  # compile
        best = float("inf")
        for _ in range(repeats):
            _, report = sync_weights(train_params, rollout_shardings, sub)
            best = min(best, report.seconds)
        times[method] = best
    # Every process of a multi-process run must run the same programs: process 0's timing decides.
    methods = list(times)
    fastest = int(broadcast_from_writer(np.int32(methods.index(min(times, key=times.get)))))
    _AUTO_CHOICE[jax.default_backend()] = methods[fastest]
    return times


def auto_choice(backend: str | None = None) -> str | None:
    """The method `auto` uses on `backend` (default: the default backend); None until calibrated."""
    return _AUTO_CHOICE.get(backend or jax.default_backend())


def made_by_sync(rollout_params, train_params) -> list[jax.Array]:
    """The arrays of a sync's `rollout_params` that are not `train_params`' own (a leaf whose layout
    and dtype match passes through): what the sync allocated, which its owner may free."""
    passed = {id(x) for x in jax.tree.leaves(train_params)}
    return [x for x in jax.tree.leaves(rollout_params) if id(x) not in passed]


def sync_weights(train_params, rollout_shardings, cfg: SyncConfig = SyncConfig()):
    """Reshard (and cast) `train_params` into `rollout_shardings`; returns `(rollout_params, report)`.

    Args:
      train_params: a pytree of jax.Arrays (e.g. the `nnx.State` of the trained model).
      rollout_shardings: a matching pytree (or prefix) of target shardings, e.g.
        `rollout_layout.param_shardings(params, rollout_mesh)`; may be on another mesh.
      cfg: method, bucket size, rollout dtype and quantization (`quantize`: the layer weights
        become float8 values and scales, `tpurl.sync.quantize`, as `rollout_shardings` expects).
    Returns:
      The rollout params (same tree structure; unchanged leaves are the same arrays) and a
      `SyncReport`. The train params are left intact. Drop the previous step's rollout params
      before calling, or both copies are on device at once.
    """
    source = train_params  # what `calibrate` is handed: it quantizes it again itself
    if cfg.quantize is not None:
        train_params = quantized_state(train_params)
    arrays, targets, treedef = flatten_with_shardings(train_params, rollout_shardings)
    leaves = [_Leaf(x, s, rollout_dtype_of(x, cfg)) for x, s in zip(arrays, targets)]
    moving = [i for i, leaf in enumerate(leaves) if not _unchanged(leaf)]
    if not moving:
        report = SyncReport(method="none", bytes_moved=0, leaves_resharded=0, leaves_relaid=0,
                            leaves_unchanged=len(leaves),
                            buckets=0, max_bucket_bytes=0, seconds=0.0, free=True)
        return train_params, report
    method = _resolve_method(cfg, leaves, moving)
    if method is None:  # "auto" on a backend not measured yet: one warm-up and one timed run each
        calibrate(source, rollout_shardings, cfg, repeats=1)
        method = _AUTO_CHOICE[jax.default_backend()]
    start = time.perf_counter()
    outs, buckets = _execute(method, leaves, moving, cfg.bucket_bytes)
    seconds = time.perf_counter() - start
    result = [outs[i] if outs[i] is not None else leaf.src for i, leaf in enumerate(leaves)]
    report = SyncReport(method=method, bytes_moved=sum(leaves[i].nbytes for i in moving),
                        leaves_resharded=len(moving), leaves_relaid=sum(not _same_layout(leaves[i]) for i in moving),
                        leaves_unchanged=len(leaves) - len(moving),
                        buckets=len(buckets), max_bucket_bytes=max(sum(p.nbytes for p in b) for b in buckets),
                        seconds=seconds, free=False)
    return jax.tree.unflatten(treedef, result), report
