"""Device meshes from a typed config: axis names, sizes (one may be -1), topology-aware order.

A tpurl program is one SPMD program over one mesh (or two, when rollout and update are
disaggregated). Under JAX's multi-controller runtime every process runs the same program and builds
the *same global* mesh from `jax.devices()` (all processes' devices); `jax.local_devices()` only
names this process's share. `MeshConfig.scope` makes that choice explicit: "global" (the default,
what training over several hosts needs) or "local" (this process only: per-host tools, tests).

Device order matters on TPU/GPU: neighbours in the mesh should be neighbours on the interconnect so
that the collectives of the innermost axes (`tensor`) stay on the fastest links. `jax.make_mesh`
(via `mesh_utils.create_device_mesh`) knows the physical topology; `make_mesh` always goes through
it. Multi-slice (DCN) topologies need `mesh_utils.create_hybrid_device_mesh`; `jax.make_mesh`
refuses them with its own error, and tpurl does not build hybrid meshes yet.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from tpurl.config_types import check_types
from tpurl.sharding.axes import MESH_AXES

SCOPES = ("global", "local")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh axis names and sizes; one size may be -1 ("all remaining devices").

    `axes` must come from `tpurl.sharding.axes.MESH_AXES` (data, fsdp, tensor, expert), so that a
    typo cannot silently turn into an axis that no layout shards over. `scope` picks the devices:
    "global" = `jax.devices()` (every process), "local" = `jax.local_devices()`.
    """

    axes: tuple[str, ...] = ("data", "fsdp", "tensor")
    shape: tuple[int, ...] = (1, -1, 1)
    scope: str = "global"

    def __post_init__(self):
        check_types(self, skip=("axes", "shape"))  # checked below, with examples of the right form
        if isinstance(self.axes, str) or isinstance(self.shape, (str, int)):
            raise ValueError(f"MeshConfig: axes and shape must be sequences, e.g. axes=('fsdp',), shape=(-1,); "
                             f"got axes={self.axes!r}, shape={self.shape!r}")
        # gin and YAML-ish callers pass lists; normalize so that configs compare and hash as tuples.
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "shape", tuple(self.shape))
        if len(self.axes) != len(self.shape):
            raise ValueError(f"MeshConfig: axes {self.axes} and shape {self.shape} differ in length; "
                             "give one size per axis")
        unknown = [a for a in self.axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"MeshConfig.axes: unknown mesh axis {unknown[0]!r}; use names from {MESH_AXES}")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"MeshConfig.axes {self.axes} repeats an axis name; name each axis once")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in self.shape):
            raise ValueError(f"MeshConfig.shape {self.shape} must be integers")
        if sum(s == -1 for s in self.shape) > 1:
            raise ValueError(f"MeshConfig.shape {self.shape} has more than one -1; at most one axis takes the rest")
        if any(s == 0 or s < -1 for s in self.shape):
            raise ValueError(f"MeshConfig.shape {self.shape}: sizes must be positive or -1")
        if self.scope not in SCOPES:
            raise ValueError(f"MeshConfig.scope={self.scope!r}; use one of {SCOPES}")

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Concrete axis sizes for `num_devices` devices (fills in the -1)."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if num_devices % known:
                raise ValueError(f"MeshConfig.shape {self.shape}: {num_devices} devices are not divisible by "
                                 f"{known}; change the fixed sizes so that they divide the device count")
            return tuple(num_devices // known if s == -1 else s for s in self.shape)
        if known != num_devices:
            raise ValueError(f"MeshConfig.shape {self.shape} has {known} devices but {num_devices} are available; "
                             "make the product match or use -1 for one axis")
        return self.shape

    def sizes(self, num_devices: int) -> dict[str, int]:
        """`{axis: size}` for `num_devices` devices."""
        return dict(zip(self.axes, self.resolve(num_devices)))


def mesh_devices(cfg: MeshConfig) -> list[jax.Device]:
    """The devices a mesh of this config spans by default: global or this process's."""
    return list(jax.devices() if cfg.scope == "global" else jax.local_devices())


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: `mesh_devices(cfg)`) with Auto axis types.

    Auto (not Explicit, `jax.make_mesh`'s default) because tpurl shards with NamedShardings on jit
    inputs and `with_sharding_constraint` inside, and lets XLA propagate the rest.

    The order follows the physical topology through `jax.make_mesh`. A device subset that does not
    form a topology-aligned block (e.g. an arbitrary half of a TPU slice for a disaggregated pool)
    is laid out in the given order instead: correct, possibly with slower collectives.
    """
    devices = list(mesh_devices(cfg) if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    try:
        shape = cfg.resolve(len(devices))
    except ValueError as e:
        where = (f" ({jax.process_count()} processes x {jax.local_device_count()} local devices; "
                 f"scope={cfg.scope!r})") if jax.process_count() > 1 else ""
        raise ValueError(f"{e}{where}") from None
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    try:
        return jax.make_mesh(shape, cfg.axes, axis_types=auto, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        if len(devices) == len(jax.devices()):
            raise  # the full device set must be topology-aligned; a failure here is real
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), cfg.axes, axis_types=auto)
