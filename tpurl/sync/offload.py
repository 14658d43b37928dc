"""Host offload of pytrees, and what their buffers share.

`to_host_memory` / `to_device_memory` move every array of a pytree between device memory and host
memory (`memory_kind="pinned_host"`) keeping its sharding (each shard goes to the host memory
attached to its device), so the way back needs no re-layout. `aliased_elsewhere` and
`delete_unshared` say which arrays share device buffers with another tree, so that freeing one
copy of the weights never frees the other. What is where is accounted by `tpurl.memory`.
"""

from __future__ import annotations


import jax
from jax.sharding import Sharding

from tpurl.memory import DEVICE, PINNED_HOST, buffer_keys, resident_bytes

def aliased_elsewhere(tree) -> list[jax.Array]:
    """Live multi-device arrays outside `tree` that share a device buffer with an array of `tree`
    (e.g. the same weights held by two trees). Deleting `tree`'s arrays would delete those too.

    Single-device arrays are not reported: `np.asarray(x)` leaves single-device views of x's
    shards among the live arrays, indistinguishable from a genuine single-device alias.
    """
    mine = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()]
    ids = {id(x) for x in mine}
    keys = set().union(*(buffer_keys(x) for x in mine)) if mine else set()
    return [y for y in jax.live_arrays()
            if id(y) not in ids and not y.is_deleted() and len(y.sharding.device_set) > 1 and buffer_keys(y) & keys]


def delete_unshared(tree, *, keep) -> int:
    """Delete the arrays of `tree` now (freeing their device buffers) except those that are, or share a
    buffer with, an array of `keep`; returns the resident bytes freed. For dropping an old copy of
    weights (e.g. the previous rollout params before a sync) whose leaves may alias the ones kept
    (a free sync passes train params through)."""
    kept = [x for x in jax.tree.leaves(keep) if isinstance(x, jax.Array) and not x.is_deleted()]
    ids = {id(x) for x in kept}
    keys = set().union(*(buffer_keys(x) for x in kept)) if kept else set()
    freed = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted() and id(x) not in ids and not buffer_keys(x) & keys:
            freed += resident_bytes(x)
            x.delete()
    return freed


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


def to_host_memory(tree, *, memory_kind: str = PINNED_HOST, delete_source: bool = False):
    """Copy every array of `tree` to host memory of the same devices (same sharding).

    `delete_source=True` frees the device buffers once the copies are done (the caller hands
    ownership over; any other reference to them becomes a deleted array).
    """
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError("to_host_memory: the tree holds a deleted array; offload a tree only once")
    return _put(tree, _with_kind(tree, memory_kind), delete_source)


def to_device_memory(tree, shardings=None, *, delete_source: bool = False):
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


