"""Meshes and named layouts: the one place that decides how logical axes map to mesh axes.

A `Layout` maps each logical axis name (see `axes.py`) to zero or more mesh axes. It answers two
questions: where a parameter is *stored* (`param_shardings`, e.g. `W_in[D_fsdp, F_tp]`) and how it
is laid out where it is *used* (`compute_constrain`, e.g. `W_in[D, F_tp]`: the FSDP all-gather made
explicit per layer, inside the scan).

Why an explicit compute sharding (the levanter pattern of parameter vs compute axis mappings):
on the CPU backend, letting XLA choose the all-gather for FSDP+TP weights miscompiles the
*gradients* (relative error ~1) while the forward pass is right; see shared/NOTES.md. Pinning each
weight to its compute sharding at the point of use makes the gradients match a single-device run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.sharding.axes import LOGICAL_AXES, logical_axes

Rules = tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh axis names and sizes; one size may be -1 ("all remaining devices")."""

    axes: tuple[str, ...] = ("data", "fsdp", "tensor")
    shape: tuple[int, ...] = (1, -1, 1)

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"MeshConfig: axes {self.axes} and shape {self.shape} differ in length")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"MeshConfig.axes {self.axes} repeats an axis name")
        if sum(s == -1 for s in self.shape) > 1:
            raise ValueError(f"MeshConfig.shape {self.shape} has more than one -1; at most one axis takes the rest")
        if any(s == 0 or s < -1 for s in self.shape):
            raise ValueError(f"MeshConfig.shape {self.shape}: sizes must be positive or -1")

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if num_devices % known:
                raise ValueError(f"MeshConfig.shape {self.shape}: {num_devices} devices are not divisible by {known}")
            return tuple(num_devices // known if s == -1 else s for s in self.shape)
        if known != num_devices:
            raise ValueError(f"MeshConfig.shape {self.shape} has {known} devices but {num_devices} are available; "
                             "make the product match or use -1 for one axis")
        return self.shape


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all global devices, all processes) with Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    if len(devices) == len(jax.devices()):
        # jax.make_mesh orders devices to follow the physical (TPU/GPU) topology.
        return jax.make_mesh(shape, cfg.axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                             devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), cfg.axes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """A named mapping from logical axes to mesh axes.

    `rules`: logical name -> tuple of mesh axes (empty or absent: replicated).
    `gathered_at_use`: mesh axes that shard parameters for storage only and are all-gathered
    where the weight is used (FSDP). Activations keep them on `batch`.
    """

    name: str
    rules: Rules = ()

    gathered_at_use: tuple[str, ...] = ("fsdp",)

    def __post_init__(self):
        for logical, mesh_axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"Layout {self.name!r}: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            if not isinstance(mesh_axes, tuple):
                raise ValueError(f"Layout {self.name!r}: rule for {logical!r} must be a tuple of mesh axes")

    @property
    def rule_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    def spec(self, names: Sequence[str | None], mesh: Mesh, *, compute: bool = False) -> P:
        """PartitionSpec for an array whose dims carry these logical names.

        Mesh axes of size 1 or absent from the mesh are dropped; a mesh axis is used at most once
        (first dim wins), so e.g. `heads` and `kv_heads` can both name `tensor`.
        """
        rules, used, out = self.rule_map, set(), []
        for name in names:
            axes = rules.get(name, ()) if name is not None else ()
            if compute and name != "batch":
                axes = tuple(a for a in axes if a not in self.gathered_at_use)
            axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    def param_shardings(self, state, mesh: Mesh):
        """NamedShardings for every parameter of an (abstract) `nnx.State` or module."""
        return jax.tree.map(lambda names: NamedSharding(mesh, self.spec(names, mesh)), logical_axes(state),
                            is_leaf=lambda x: isinstance(x, tuple))

    def compute_constrain(self, mesh: Mesh) -> Callable[[jax.Array, tuple], jax.Array]:
        """`constrain(x, logical_names)` pinning weights/activations to their compute sharding."""

        def constrain(x, names):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, self.spec(names, mesh, compute=True)))

        return constrain

    def batch_sharding(self, mesh: Mesh, ndim: int) -> NamedSharding:
        """Sharding for a `[B, ...]` batch array: batch over this layout's batch axes."""
        return NamedSharding(mesh, self.spec(("batch",) + (None,) * (ndim - 1), mesh))
