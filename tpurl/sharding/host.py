"""Host reads and host-side roles that stay correct when a mesh spans several processes.

Under `jax.distributed` an array on a global mesh is not *fully addressable*: each process holds
only its own devices' shards, and `np.asarray` / `jax.device_get` on it raise. Every host read of
a value that lives on a mesh goes through `to_host`, which gathers the missing shards from the
other processes (a collective: every process must call it, in the same order, with arrays of the
same global shape). Because every process then holds the same full value, decisions derived from
it (which decode slot finished, which KV page to hand out next, what to log) are identical on
every process, so all of them keep issuing the same computations.

Host batches go the other way through `to_mesh`. Every process computes the same host batch (same
seeds, same gathered rollout results), so each process cuts its own devices' shards out of the
global batch (`jax.make_array_from_callback`): no communication and no equality check, unlike
`jax.device_put` of a numpy array onto a multi-process sharding (which gathers the value from every
process to check that they agree), and simpler than `make_array_from_process_local_data`, which
would need each process to produce exactly its rows.

Writing files is the other side: one process (`is_writer()`, process 0) writes a run's logs,
manifest, report and export. `on_writer(fn)` runs a decision on process 0 alone and hands its
result, or its error, to every process: claiming the run directory, and what must not differ
between processes although computing it could (an environment's answers, a grader's rewards:
process 0's count for all); `barrier(name)` makes the others wait where they must not run ahead of
process 0's writes. With a `mesh`, `on_writer`, `broadcast_from_writer` and `all_processes`
send over that mesh's devices alone (the rollout pool's, say), so they never wait for a program
that other devices (the train pool) are still running.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding


def _leaf_to_host(x: Any) -> Any:
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x


def to_host(tree: Any) -> Any:
    """`tree` with every `jax.Array` leaf as a full numpy array, on every process.

    Fully addressable arrays are copied as `jax.device_get` would (no communication); arrays
    sharded over other processes' devices are gathered (`process_allgather`), which every process
    must call together. Non-array leaves pass through unchanged.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.tree.unflatten(treedef, jax.device_get(leaves))  # one batched copy
    return jax.tree.unflatten(treedef, [_leaf_to_host(x) for x in leaves])


def _leaf_to_mesh(x: Any, sharding: Sharding) -> jax.Array:
    if sharding.is_fully_addressable or isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def to_mesh(tree: Any, shardings: Any) -> Any:
    """`tree` (host arrays, the same on every process) as global arrays with `shardings` (a
    matching pytree, or one sharding for all leaves); each process places only its own shards."""
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: _leaf_to_mesh(x, shardings), tree)
    return jax.tree.map(_leaf_to_mesh, tree, shardings)


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0; always true in a single process)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (a no-op for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _check_spans_processes(mesh: Mesh) -> None:
    """A one-line error unless `mesh` has devices on every process (each must join its collectives)."""
    missing = set(range(jax.process_count())) - {d.process_index for d in mesh.devices.flat}
    if missing:
        raise ValueError(f"a mesh of {mesh.devices.size} devices has none on processes {sorted(missing)}: agreeing or "
                         "broadcasting over it needs devices on every process")


def _gather_rows_over(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """`[devices of mesh, *x.shape]`: each device's row is its own process's `x` (the same shape
    and dtype on every process), gathered on every process over `mesh`'s devices alone."""
    _check_spans_processes(mesh)
    n = mesh.devices.size
    x = np.asarray(x)
    rows = jax.make_array_from_callback(
        (n, *x.shape), NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))),
        lambda index: np.broadcast_to(x, (len(range(n)[index[0]]), *x.shape)), dtype=x.dtype)
    return to_host(rows)


def all_processes(flag: bool, mesh: Mesh | None = None) -> bool:
    """Whether `flag` holds on every process (`flag` itself for a single process): a decision that
    every process must take the same way although each sees only its own outcome. `mesh` (with
    devices on every process): agree over its devices alone, so that the collective does not queue
    behind a program that other devices are still running (default: over every device)."""
    if jax.process_count() == 1:
        return bool(flag)
    flag = np.int32(bool(flag))
    return bool(np.all(multihost_utils.process_allgather(flag) if mesh is None else _gather_rows_over(flag, mesh)))


def broadcast_from_writer(value: Any, mesh: Mesh | None = None) -> Any:
    """Process 0's `value` on every process (itself for one process): a pytree of numbers/arrays,
    or with `mesh` (which must have devices on every process) one array, sent over that mesh's
    devices alone; every process passes a value of the same shape and dtype."""
    if jax.process_count() == 1:
        return value
    if mesh is None:
        return multihost_utils.broadcast_one_to_all(value)
    rows = _gather_rows_over(value, mesh)
    return rows[next(i for i, d in enumerate(mesh.devices.flat) if d.process_index == 0)]


def _broadcast_text(text: str | None, mesh: Mesh | None = None) -> str:
    """Process 0's `text` on every process (the others pass None). The bytes travel padded to a
    power of two (at least 256), so that texts of many lengths share a few compiled gathers."""
    data = np.frombuffer((text or "").encode(), np.uint8)
    size = int(broadcast_from_writer(np.int32(data.size), mesh))
    buffer = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    if is_writer():
        buffer[:size] = data
    return bytes(np.asarray(broadcast_from_writer(buffer, mesh), np.uint8)[:size]).decode()


def on_writer(fn: Callable[[], Mapping[str, Any]], mesh: Mesh | None = None) -> dict[str, Any]:
    """Run `fn` on process 0 only and return its result (a JSON-able dict) on every process;
    `mesh`: send it over that mesh's devices alone (see `broadcast_from_writer`).

    An error raised by `fn` (or by encoding its result) stops every process together instead of
    leaving the others waiting: process 0 raises it as it is, the others a ValueError with its
    message (a `ValueError` or `OSError`'s as it is, any other's prefixed with its type)."""
    if jax.process_count() == 1:
        return dict(fn())
    text = None
    if is_writer():
        try:
            text = json.dumps({"ok": dict(fn())})
        except Exception as e:  # noqa: BLE001 -- handed to every process, re-raised below
            why = str(e) if isinstance(e, (ValueError, OSError)) else f"process 0: {type(e).__name__}: {e}"
            text = json.dumps({"error": why})
            error = e
    shared = json.loads(_broadcast_text(text, mesh))
    if "error" in shared:
        if is_writer():
            raise error
        raise ValueError(shared["error"])
    return shared["ok"]
