"""Where the two workloads run: one device pool taking turns (colocated) or two disjoint pools
(disaggregated), each with its own mesh.

Colocated: train and rollout meshes cover the same devices (possibly with different shapes, e.g.
`(data=1, fsdp=4, tensor=2)` for training and `(data=4, fsdp=1, tensor=2)` for rollout); weight sync
is a resharding on those devices and may be a single jit. Disaggregated: the first `train_devices`
devices form the train mesh, the next `rollout_devices` the rollout mesh (in a multi-process run,
by default within every process: `PlacementConfig.device_split`); weights cross with
`jax.device_put`, or with one collective permute when the pools hold devices of several processes
(a jit spanning both meshes is rejected; both copies are bit-exact, `tests/sync/test_placement.py`,
`tests/sync/test_cross_process.py`), and the rollout mesh may use a different layout. Devices are
taken in `jax.devices()` order, which on TPU/GPU follows the interconnect, so each pool is a
contiguous block of it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh

from tpurl.config_types import check_types
from tpurl.sharding.layout import MeshConfig, make_mesh

MODES = ("colocated", "disaggregated")
SPLITS = ("per_process", "in_order")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Device split and mesh shapes of the train and rollout pools.

    `train_devices` / `rollout_devices`: pool sizes for mode="disaggregated" (-1: all the devices
    the other pool leaves); ignored when colocated, where both meshes span all devices.
    `device_split`: how a disaggregated multi-process run divides the devices. "per_process" (default):
    every process gives the same share of its devices to each pool, so both pools span every
    process (what `tpurl train` needs: each process runs both workloads' programs and holds its
    part of the train state). "in_order": the first devices in `jax.devices()` order train, the
    next generate, so the pools may belong to different processes (e.g. one process trains and
    another generates; the weight sync then crosses processes). One process: both are the same.
    """

    mode: str = "colocated"
    train_devices: int = -1
    rollout_devices: int = -1
    device_split: str = "per_process"
    train_mesh: MeshConfig = MeshConfig()
    rollout_mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        check_types(self)
        if self.mode not in MODES:
            raise ValueError(f"PlacementConfig.mode={self.mode!r}; use one of {MODES}")
        for name in ("train_devices", "rollout_devices"):
            n = getattr(self, name)
            if n == 0 or n < -1:
                raise ValueError(f"PlacementConfig.{name}={n} must be positive or -1 (the rest)")
        if self.device_split not in SPLITS:
            raise ValueError(f"PlacementConfig.device_split={self.device_split!r}; use one of {SPLITS}")
        if self.mode == "disaggregated" and self.train_devices == -1 and self.rollout_devices == -1:
            raise ValueError("PlacementConfig: disaggregated mode needs train_devices or rollout_devices "
                             "(the other may be -1 for the rest)")

    def split(self, num_devices: int) -> tuple[int, int]:
        """(train, rollout) pool sizes for `num_devices` devices."""
        if self.mode == "colocated":
            return num_devices, num_devices
        train, rollout = self.train_devices, self.rollout_devices
        train = num_devices - rollout if train == -1 else train
        rollout = num_devices - train if rollout == -1 else rollout
        if train <= 0 or rollout <= 0 or train + rollout > num_devices:
            raise ValueError(f"PlacementConfig: train_devices={self.train_devices}, rollout_devices="
                             f"{self.rollout_devices} do not fit {num_devices} devices; both pools need at "
                             "least one device and together at most all of them")
        return train, rollout


@dataclasses.dataclass(frozen=True)
class Placement:
    """The resolved meshes. `colocated`: both meshes hold the same devices."""

    mode: str
    train_mesh: Mesh
    rollout_mesh: Mesh

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def train_devices(self) -> list[jax.Device]:
        return list(self.train_mesh.devices.flat)

    @property
    def rollout_devices(self) -> list[jax.Device]:
        return list(self.rollout_mesh.devices.flat)


def make_placement(cfg: PlacementConfig, devices: Sequence[jax.Device] | None = None) -> Placement:
    """Build the train and rollout meshes from `cfg` over `devices` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    n_train, n_rollout = cfg.split(len(devices))
    if cfg.mode == "colocated":
        # Each mesh gets the topology-aware device order for its own shape; where the two orders
        # differ, a jitted sync is impossible and `sync_weights(method="auto")` uses device_put.
        return Placement(cfg.mode, make_mesh(cfg.train_mesh, devices), make_mesh(cfg.rollout_mesh, devices))
    train_devs, rollout_devs = _pools(devices, n_train, n_rollout, per_process=cfg.device_split == "per_process")
    try:
        return Placement(cfg.mode, make_mesh(cfg.train_mesh, train_devs), make_mesh(cfg.rollout_mesh, rollout_devs))
    except ValueError as e:
        raise ValueError(f"PlacementConfig (disaggregated, {n_train} train + {n_rollout} rollout devices): "
                         f"{e}") from None


def _pools(devices: list[jax.Device], n_train: int, n_rollout: int, *, per_process: bool) -> tuple[list, list]:
    """The train and rollout pools' devices: the first `n_train` and the next `n_rollout`, or with
    `per_process` and devices of several processes, that split within every process."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    if not per_process or len(by_process) == 1:
        return devices[:n_train], devices[n_train:n_train + n_rollout]
    n = len(by_process)
    if n_train % n or n_rollout % n:
        raise ValueError(f"PlacementConfig (disaggregated, {n_train} train + {n_rollout} rollout devices, "
                         f"device_split='per_process'): each of the {n} processes gives the same share of its devices "
                         f"to each pool; set train_devices and rollout_devices to multiples of {n}")
    per_train, per_rollout = n_train // n, n_rollout // n
    return ([d for local in by_process.values() for d in local[:per_train]],
            [d for local in by_process.values() for d in local[per_train:per_train + per_rollout]])
