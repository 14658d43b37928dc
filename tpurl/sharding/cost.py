"""Memory and traffic arithmetic of layouts: bytes per device, and what a train -> rollout sync moves.

Pure shape arithmetic over `ParamPlacement`s (from `Layout.placements`), so that it runs on an
`AbstractMesh` of any size: plan a 256-chip pod on a laptop. A device's shard of a dimension split
over mesh axes `(a1, ..., ak)` is block number `sum_i c[a_i] * prod_{j>i} size(a_j)` (`a1` major,
JAX's convention; tests check this against `NamedSharding.devices_indices_map`).

A weight sync is `jax.device_put(train_params, rollout_shardings)` on the same devices. What it
moves into device `d` is the part of `d`'s rollout shard that `d` did not already hold in the
train layout; elements it already holds are copied (and cast) locally. `sync_cost` sums that over
devices, in the rollout dtype (the cast is fused before the transfer).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator, Sequence

import jax.numpy as jnp
from jax.sharding import Mesh

from tpurl.sharding.layout import ParamPlacement, entry_axes


def device_coords(sizes: dict[str, int]) -> Iterator[dict[str, int]]:
    """Every device's coordinates `{axis: index}`, in mesh (row-major) order."""
    names = list(sizes)
    for idx in itertools.product(*(range(sizes[n]) for n in names)):
        yield dict(zip(names, idx))


def shard_bounds(p: ParamPlacement, sizes: dict[str, int], coords: dict[str, int]) -> list[tuple[int, int]]:
    """`[(start, stop), ...]` per dim of the shard of `p` held by the device at `coords`."""
    spec = tuple(p.spec) + (None,) * (len(p.shape) - len(p.spec))
    bounds = []
    for n, shard, entry in zip(p.shape, p.shard_shape, spec):
        block = 0
        for axis in entry_axes(entry):
            block = block * sizes[axis] + coords[axis]
        bounds.append((block * shard, block * shard + shard) if entry is not None else (0, n))
    return bounds


def layout_bytes_per_device(placements: Sequence[ParamPlacement]) -> int:
    """Parameter bytes each device holds (even sharding: the same on every device)."""
    return sum(p.bytes_per_device for p in placements)


@dataclasses.dataclass(frozen=True)
class DeviceGrid:
    """A mesh reduced to what the arithmetic needs: axis sizes and device ids in mesh order.

    From a concrete `Mesh` the ids are the real device ids. From an `AbstractMesh` (planning
    without the hardware) they are `first_id, first_id + 1, ...` in row-major order: colocated
    meshes over the same devices share ids (exact when both follow the same device order, as
    `jax.make_mesh` does on CPU/GPU; on TPU the physical order of two differently shaped meshes
    may differ), a disaggregated pool starts after the other one.
    """

    sizes: dict[str, int]
    ids: tuple[int, ...]

    @classmethod
    def of(cls, mesh, first_id: int = 0) -> DeviceGrid:
        sizes = dict(mesh.shape)
        if isinstance(mesh, Mesh):
            return cls(sizes, tuple(d.id for d in mesh.devices.flat))
        return cls(sizes, tuple(range(first_id, first_id + math.prod(sizes.values()))))


@dataclasses.dataclass(frozen=True)
class SyncCost:
    """Bytes a train -> rollout resharding moves between devices.

    `total_bytes`: summed over receiving devices; `max_device_bytes`: into the busiest device;
    `per_param`: total per parameter path; `local_only`: parameters whose every rollout shard is
    already on its device (a local copy/cast, no traffic).
    """

    total_bytes: int
    max_device_bytes: int
    per_param: dict[str, int]
    local_only: tuple[str, ...]


def sync_cost(src: Sequence[ParamPlacement], dst: Sequence[ParamPlacement], src_mesh, dst_mesh=None,
              dst_dtype=None) -> SyncCost:
    """What resharding every parameter from `src` (train) to `dst` (rollout) placements moves.

    `src_mesh`/`dst_mesh`: `Mesh`, `AbstractMesh` or `DeviceGrid` (`dst_mesh` defaults to
    `src_mesh`: one mesh, two layouts). A rollout device that is not in the train mesh
    (disaggregated) receives its whole shard. `dst_dtype`: the rollout dtype (default: as stored).
    """
    src_grid = src_mesh if isinstance(src_mesh, DeviceGrid) else DeviceGrid.of(src_mesh)
    dst_grid = src_grid if dst_mesh is None else dst_mesh if isinstance(dst_mesh, DeviceGrid) else DeviceGrid.of(dst_mesh)
    src_by_path = {p.path: p for p in src}
    if set(src_by_path) != {p.path for p in dst}:
        raise ValueError("sync_cost: train and rollout placements describe different parameters; "
                         "compute both from the same model state")
    src_coords = dict(zip(src_grid.ids, device_coords(src_grid.sizes)))
    per_device = dict.fromkeys(dst_grid.ids, 0)
    per_param: dict[str, int] = {}
    for q in dst:
        p = src_by_path[q.path]
        itemsize = jnp.dtype(dst_dtype or q.dtype).itemsize
        moved = 0
        for dev, coords in zip(dst_grid.ids, device_coords(dst_grid.sizes)):
            want = shard_bounds(q, dst_grid.sizes, coords)
            overlap = 0
            if dev in src_coords:
                have = shard_bounds(p, src_grid.sizes, src_coords[dev])
                overlap = math.prod(max(0, min(h1, w1) - max(h0, w0)) for (h0, h1), (w0, w1) in zip(have, want))
            nbytes = (math.prod(q.shard_shape) - overlap) * itemsize
            per_device[dev] += nbytes
            moved += nbytes
        per_param[q.path] = moved
    return SyncCost(total_bytes=sum(per_device.values()), max_device_bytes=max(per_device.values()),
                    per_param=per_param, local_only=tuple(k for k, v in per_param.items() if v == 0))


def human_count(n: int) -> str:
    """A parameter count in millions or billions: "596.05 M", "8.03 B"."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
