"""Weight sync between processes: one collective permute over a mesh that spans both pools.

When the train pool's devices and the rollout pool's devices belong to different processes (JAX's
multi-controller runtime: e.g. one process trains, another generates), `jax.device_put` cannot copy
a shard from one to the other on every backend (on XLA:CPU it is refused, or with the transfer
server configured never completes; docs/weight_sync.md). What every
backend runs is a collective inside one SPMD program over devices of several processes (gloo on
CPU, NCCL on GPU, ICI/DCN on TPU). So the cross-pool copy is one program over the *pool mesh*
`(pool=2, *rollout mesh axes)`, whose pool 0 is the train devices (arranged like the rollout mesh)
and pool 1 the rollout devices, position by position.

Letters: N = a leaf's first dimension. A leaf `X[N, ...]`, already cast and laid out in the rollout
layout on the train devices (`reshard.staging_sharding`), and a receive buffer `R[N, ...]` on the
rollout devices are viewed, without a copy, as one global array `X2[2N, ...]` whose first
dimension is split over `("pool", <the rollout layout's axes of that dimension>)`: pool 0 holds
the staged shards, pool 1 the receive buffers, and the shard at each mesh position has the same
shape in both pools. A `ppermute` over "pool" sends every pool-0 shard to the device at the same
position of pool 1, and the rollout array is a view of pool 1's output shards
(`jax.make_array_from_single_device_arrays`, again no copy). Only device buffers move; nothing
goes through the host, a file or a pickle.

Every process calls `permute_to` with the same arguments (SPMD); each one touches only the shards
on its own devices. The same program also works when both pools live in one process.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

POOL = "pool"

# Compiled sync programs kept per static signature (shardings, dtypes, shapes), here and in
# `tpurl.sync.reshard`: a run needs one per bucket shape, a handful for stacked layers; a bound keeps
# a process that builds many meshes (tests, notebooks) from holding every one of them and its
# programs. A sync needing more signatures than this would compile some of them again every time.
PROGRAM_CACHE_SIZE = 256


def crosses_processes(src: Sharding, dst: Sharding) -> bool:
    """Whether moving a leaf from `src`'s pool to `dst`'s disjoint pool needs this module's permute:
    when the two pools' devices belong to more than one process. That includes pools that each
    span the same processes, with every shard staying in its own process: multi-controller JAX
    refuses `jax.device_put` between different device sets of a global array. False when the
    pools share devices (there one program's collectives move the data) or in a single process."""
    if not src.device_set.isdisjoint(dst.device_set):
        return False
    # Also when both pools are one process's devices in a multi-process run: the other processes
    # hold neither and cannot `device_put`, and every process must take the same way.
    return jax.process_count() > 1 or len({d.process_index for d in src.device_set | dst.device_set}) > 1


def check_permutable(src: Sharding, dst: Sharding) -> None:
    """Raise a one-line ValueError unless `src` (the staged leaf) can be permuted into `dst`: both
    named shardings, with the same spec on meshes of the same shape over disjoint devices."""
    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
        raise ValueError("SyncConfig.method='permute' moves NamedSharding arrays only; build the rollout shardings "
                         "with layout.param_shardings(params, mesh)")
    if src.mesh.devices.shape != dst.mesh.devices.shape or src.mesh.axis_names != dst.mesh.axis_names:
        raise ValueError(f"SyncConfig.method='permute' needs train and rollout pools of the same size (got "
                         f"{src.mesh.size} train and {dst.mesh.size} rollout devices); use pools of equal size")
    if src.device_set & dst.device_set:
        raise ValueError("SyncConfig.method='permute' needs disjoint train and rollout devices (disaggregated "
                         "placement); colocated meshes sync with method='jit' or 'device_put'")


def pool_mesh(src: Mesh, dst: Mesh) -> Mesh:
    """The mesh `(pool=2, *dst axes)`: pool 0 is `src`'s devices, pool 1 `dst`'s, same positions."""
    devices = np.stack([np.asarray(src.devices), np.asarray(dst.devices)])
    return Mesh(devices, (POOL, *dst.axis_names))


def pool_spec(spec: P, ndim: int) -> P:
    """`spec` with "pool" prepended to the axes of dimension 0 (pool-major: pool 0 holds rows [0, N))."""
    if ndim == 0:
        raise ValueError("SyncConfig.method='permute' cannot move a 0-d leaf (it has no dimension to split "
                         "between the pools); give it at least one dimension")
    entries = list(spec) + [None] * (ndim - len(spec))
    first = entries[0]
    first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return P((POOL, *first), *entries[1:])


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _receive_program(shapes, dtypes, shardings):
    """The jitted `() -> zero buffers`, one per leaf, laid out like the rollout shards."""
    return jax.jit(lambda: [jnp.zeros(s, d) for s, d in zip(shapes, dtypes)], out_shardings=list(shardings))


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def permute_program(mesh: Mesh, specs: tuple[P, ...]):
    """The jitted program sending each pool-0 shard of each leaf to the same position in pool 1."""
    def send(*blocks):
        return [jax.lax.ppermute(b, POOL, perm=[(0, 1)]) for b in blocks]
    return jax.jit(jax.shard_map(send, mesh=mesh, in_specs=specs, out_specs=list(specs)))


def _local(x: jax.Array) -> dict[jax.Device, jax.Array]:
    return {s.device: s.data for s in x.addressable_shards}


def _as_pool_array(staged: jax.Array, received: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`staged` (pool 0) and `received` (pool 1) as one `[2N, ...]` array; no copy."""
    shape = (2 * staged.shape[0], *staged.shape[1:])
    buffers = {**_local(staged), **_local(received)}
    ordered = [buffers[d] for d in sharding.mesh.devices.flat if d in buffers]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered, dtype=staged.dtype)


def _pool1_view(out: jax.Array, shape, dst: NamedSharding) -> jax.Array:
    """Pool 1's shards of `out` as an array of `shape` in `dst` (no copy); pool 0's are dropped."""
    buffers = _local(out)
    ordered = [buffers[d] for d in dst.mesh.devices.flat if d in buffers]
    return jax.make_array_from_single_device_arrays(shape, dst, ordered, dtype=out.dtype)


def permute_to(staged: list[jax.Array], dsts: list[NamedSharding]) -> list[jax.Array]:
    """Copy each staged leaf into its rollout sharding across pools, device to device.

    Args:
      staged: leaves already in the rollout dtype and laid out with their target's spec on the
        train devices, arranged like the rollout mesh (`reshard.staging_sharding`).
      dsts: the target shardings, on a mesh of the same shape over disjoint devices.
    Returns:
      The rollout leaves: views of the permute's output buffers on the rollout devices. Every
      process must call this with the same leaves, in the same order.
    """
    for x, dst in zip(staged, dsts, strict=True):
        check_permutable(x.sharding, dst)
        if not x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, dst.spec), x.ndim):
            raise ValueError(f"permute_to: a staged leaf is laid out as {x.sharding.spec}, its target as {dst.spec}; "
                             "stage it with reshard.staging_sharding first")
    if not staged:
        return []
    meshes = {(x.sharding.mesh, dst.mesh) for x, dst in zip(staged, dsts)}
    if len(meshes) > 1:
        raise ValueError("permute_to moves leaves between one pair of meshes per call; group them by mesh")
    mesh = pool_mesh(*meshes.pop())
    specs = tuple(pool_spec(dst.spec, x.ndim) for x, dst in zip(staged, dsts))
    received = _receive_program(tuple(x.shape for x in staged), tuple(x.dtype for x in staged), tuple(dsts))()
    pooled = [_as_pool_array(x, r, NamedSharding(mesh, s)) for x, r, s in zip(staged, received, specs)]
    outs = permute_program(mesh, specs)(*pooled)
    # Wait for the whole permute, pool 0 included: the rollout views alone have no shards on the
    # train process, so waiting on them there would not bound the sync's temporaries.
    jax.block_until_ready(outs)
    return [_pool1_view(y, x.shape, dst) for y, x, dst in zip(outs, staged, dsts)]
