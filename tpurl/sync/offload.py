"""Host offload of pytrees and an account of live memory per memory kind.

`to_host` / `to_device` move every array of a pytree between device memory and host memory
(`memory_kind="pinned_host"`) keeping its sharding (each shard goes to the host memory attached to
its device), so the way back needs no re-layout. `memory_account` sums `jax.live_arrays()` per
memory kind, optionally splitting out named groups (params, optimizer state, KV pool), which is
how a colocated step shows that one phase's tensors are really gone from device memory while
the other phase runs. The CPU backend has no `device.memory_stats()`; the live-array sum is the
account there, and where the backend has stats they are recorded alongside.

Bytes are *resident* bytes: a shard replicated on n devices counts n times.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any, Collection, Mapping

import jax
import numpy as np
from jax.sharding import Sharding

DEVICE = "device"
PINNED_HOST = "pinned_host"


def _kind(x: jax.Array) -> str:
    return x.sharding.memory_kind or DEVICE


def resident_bytes(x: jax.Array) -> int:
    """Bytes `x` occupies over its addressable devices (0 once deleted)."""
    if x.is_deleted():
        return 0
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize * len(x.sharding.addressable_devices)


def tree_bytes_by_memory_kind(tree) -> dict[str, int]:
    """`{memory_kind: resident bytes}` of the jax.Arrays in `tree` (deleted arrays count 0; an
    array that appears twice in the tree counts once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted() and id(x) not in seen:
            seen.add(id(x))
            out[_kind(x)] = out.get(_kind(x), 0) + resident_bytes(x)
    return out


def live_bytes_by_memory_kind(device_ids: Collection[int] | None = None) -> dict[str, int]:
    """`{memory_kind: resident bytes}` of every live jax.Array in this process (with `device_ids`:
    of their buffers on those devices alone, e.g. one pool's).

    Each device buffer counts once: `np.asarray(x)` (and `x.addressable_shards`) leave per-shard
    views of x among the live arrays, which share x's buffers, so buffers are deduplicated by
    (device, address). Collects garbage first: arrays caught in unreachable reference cycles still
    hold their buffers until the collector runs, and would otherwise come and go at random points.
    An array's buffers never change while it lives, so they are read once per array
    (`_BUFFERS`): a step accounts its memory at every phase end, and most arrays (weights,
    optimizer state, the KV pool and their per-shard views) outlive many phases.
    """
    gc.collect()
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for x in jax.live_arrays():
        known = _buffers(x)
        if known is None:  # deleted or donated since it was listed (by another thread): not live
            continue
        kind, buffers = known
        for key, nbytes in buffers:
            if key not in seen and (device_ids is None or key[0] in device_ids):
                seen.add(key)
                out[kind] = out.get(kind, 0) + nbytes
    return out


Buffers = tuple[tuple[tuple[int, int], int], ...]  # ((device id, address), bytes) per addressable shard
# id(array) -> (a weak reference to it, its memory kind, its buffers); an entry leaves when its
# array dies (the weak reference's callback), before the id can be reused.
_BUFFERS: dict[int, tuple[weakref.ref, str, Buffers]] = {}


def _buffers(x: jax.Array) -> tuple[str, Buffers] | None:
    """`x`'s memory kind and addressable buffers; None once it is deleted."""
    if x.is_deleted():
        return None
    known = _BUFFERS.get(id(x))
    if known is not None and known[0]() is x:
        return known[1], known[2]
    try:
        shards = [(shard.device.id, shard.data) for shard in x.addressable_shards]
        buffers = tuple(((device, data.unsafe_buffer_pointer()), data.nbytes) for device, data in shards)
    except (RuntimeError, TypeError):  # deleted midway (by another thread) surfaces as a TypeError
        return None
    key, kind = id(x), _kind(x)
    _BUFFERS[key] = (weakref.ref(x, lambda _, key=key: _BUFFERS.pop(key, None)), kind, buffers)
    return kind, buffers


def freeze_heap() -> None:
    """Collect garbage, then exempt every surviving object from future collections.

    The per-phase memory account collects garbage at each phase boundary (arrays caught in cycles
    would otherwise blur it); with the long-lived heap of compiled programs and modules frozen,
    that collection scans only the step's own young objects: microseconds instead of ~0.5 s."""
    gc.collect()
    gc.freeze()


def _buffer_keys(x: jax.Array) -> set[tuple[int, int]]:
    """`x`'s (device id, address) buffer keys (none once it is deleted), read through `_buffers`."""
    known = _buffers(x)
    return set() if known is None else {key for key, _ in known[1]}


def aliased_elsewhere(tree) -> list[jax.Array]:
    """Live multi-device arrays outside `tree` that share a device buffer with an array of `tree`
    (e.g. the same weights held by two trees). Deleting `tree`'s arrays would delete those too.

    Single-device arrays are not reported: `np.asarray(x)` leaves single-device views of x's
    shards among the live arrays, indistinguishable from a genuine single-device alias.
    """
    mine = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()]
    ids = {id(x) for x in mine}
    keys = set().union(*(_buffer_keys(x) for x in mine)) if mine else set()
    return [y for y in jax.live_arrays()
            if id(y) not in ids and not y.is_deleted() and len(y.sharding.device_set) > 1 and _buffer_keys(y) & keys]


def delete_unshared(tree, *, keep) -> int:
    """Delete the arrays of `tree` now (freeing their device buffers) except those that are, or share a
    buffer with, an array of `keep`; returns the resident bytes freed. For dropping an old copy of
    weights (e.g. the previous rollout params before a sync) whose leaves may alias the ones kept
    (a free sync passes train params through)."""
    kept = [x for x in jax.tree.leaves(keep) if isinstance(x, jax.Array) and not x.is_deleted()]
    ids = {id(x) for x in kept}
    keys = set().union(*(_buffer_keys(x) for x in kept)) if kept else set()
    freed = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted() and id(x) not in ids and not _buffer_keys(x) & keys:
            freed += resident_bytes(x)
            x.delete()
    return freed


def device_memory_stats() -> dict[str, dict[str, int]] | None:
    """`device.memory_stats()` per local device, or None where the backend has none (CPU)."""
    stats = {str(d): d.memory_stats() for d in jax.local_devices()}
    return None if all(s is None for s in stats.values()) else stats


def _put(tree, targets: list, delete_source: bool):
    """device_put each leaf of `tree` to the matching entry of the flat list `targets`."""
    leaves, treedef = jax.tree.flatten(tree)
    done: dict[int, jax.Array] = {}  # an array that appears twice moves once and stays shared
    moved = []
    for x, s in zip(leaves, targets):
        if isinstance(x, jax.Array) and id(x) not in done:
            done[id(x)] = jax.device_put(x, s)
        moved.append(done[id(x)] if isinstance(x, jax.Array) else x)
    if delete_source:
        # Donation across memory kinds is not implemented on every backend (not on CPU), so free
        # the sources by hand once the copies have landed.
        jax.block_until_ready(moved)
        for x, y in zip(leaves, moved):
            if isinstance(x, jax.Array) and x is not y and not x.is_deleted():
                x.delete()
    return jax.tree.unflatten(treedef, moved)


def _with_kind(tree, memory_kind: str) -> list:
    return [x.sharding.with_memory_kind(memory_kind) if isinstance(x, jax.Array) else None
            for x in jax.tree.leaves(tree)]


def to_host(tree, *, memory_kind: str = PINNED_HOST, delete_source: bool = False):
    """Copy every array of `tree` to host memory of the same devices (same sharding).

    `delete_source=True` frees the device buffers once the copies are done (the caller hands
    ownership over; any other reference to them becomes a deleted array).
    """
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError("to_host: the tree holds a deleted array; offload a tree only once")
    return _put(tree, _with_kind(tree, memory_kind), delete_source)


def to_device(tree, shardings=None, *, delete_source: bool = False):
    """Copy every array of `tree` back to device memory: into `shardings` (a matching pytree or
    prefix of shardings) when given, else into each array's own sharding with
    `memory_kind="device"`. Pass explicit shardings to, e.g., give optax's scalar step count a
    replicated sharding over the mesh instead of the single device it was created on."""
    if shardings is None:
        targets = _with_kind(tree, DEVICE)
    else:
        flat, sdef = jax.tree.flatten(shardings, is_leaf=lambda s: isinstance(s, Sharding))
        subtrees = sdef.flatten_up_to(tree)
        targets = [s for s, sub in zip(flat, subtrees) for _ in jax.tree.leaves(sub)]
    return _put(tree, targets, delete_source)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryAccount:
    """Live memory at one point of a step. `live`: all live arrays per memory kind; `groups`:
    named pytrees' bytes per memory kind; `device_stats`: `memory_stats()` where available."""

    phase: str
    live: dict[str, int]
    groups: dict[str, dict[str, int]]
    device_stats: dict[str, dict[str, int]] | None = None

    def device_bytes(self, group: str | None = None) -> int:
        """Device-memory bytes of `group` (or of all live arrays)."""
        return (self.live if group is None else self.groups.get(group, {})).get(DEVICE, 0)


def memory_account(phase: str, groups: Mapping[str, Any] | None = None) -> MemoryAccount:
    """Account live memory now: all live arrays per kind, plus each named group's pytree."""
    return MemoryAccount(phase=phase, live=live_bytes_by_memory_kind(),
                         groups={name: tree_bytes_by_memory_kind(t) for name, t in (groups or {}).items()},
                         device_stats=device_memory_stats())
