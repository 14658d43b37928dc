"""Hardware presets of `tpurl plan`: per-chip memory, peak rate and bandwidths from public datasheets,
and `cpu`, this machine as measured by `tpurl.plan.calibrate` (`cpu_hardware`).

Names: `tpu-<gen>-<N>` follows Cloud TPU's slice names (`tpu-v5p-8`): for v4 and v5p, N counts
TensorCores and a chip (one JAX device) has two, so `tpu-v5p-8` is 4 chips; for v5e and v6e, N
counts chips. GPUs are `<chip>x<N>` (`h100x8`: one node of 8). `cpu` is this machine with
JAX devices sharing its measured matmul rate and memory bandwidth. The presets are data: looking one
up measures nothing and writes nothing.

Sources (bf16 dense peak, HBM, HBM bandwidth, chip-to-chip bandwidth per chip): Cloud TPU system
architecture pages (v4, v5e, v5p, v6e: "Interchip Interconnect BW" given in Gbps, divided by 8
here); NVIDIA A100 80GB SXM, H100 SXM, H200 SXM and HGX B200 datasheets (dense bf16 Tensor Core
rate, i.e. half the "with sparsity" figure; NVLink bandwidth per GPU). The host link (PCIe, for the
colocated offload) is the bus generation's x16 rate per direction, an approximation.
"""

from __future__ import annotations

import dataclasses
import os
import re

from tpurl.config_types import check_types

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator chip (one JAX device): memory bytes, peak bf16 FLOP/s, bandwidths in bytes/s.

    `efficiency`: the fraction of `peak_flops` the update reaches (its "MFU");
    `forward_efficiency`: the same for forward-only work (scoring, prefill, decode; None: as
    `efficiency`); `step_overhead_s`: the fixed cost of one launched
    program (a decode step's dispatch and host round trip); `decode_slot_s`: what each live
    sequence adds to a decode step beyond its FLOPs and bytes (sampling, bookkeeping), measured for
    `cpu` only (0 for the datasheet presets, where it is small next to a large model's step);
    `sync_host_s`: a weight sync's host work (comparing every leaf's two layouts, waiting for the
    result), paid even when the sync moves nothing; measured for
    `cpu`, and taken to be a server CPU's order of magnitude for the datasheet presets."""

    name: str
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float
    efficiency: float = 0.5
    forward_efficiency: float | None = None
    step_overhead_s: float = 50e-6
    decode_slot_s: float = 0.0
    sequence_s: float = 0.0
    sync_host_s: float = 1e-3
    cores_per_chip: int = 1
    source: str = ""

    def __post_init__(self):
        check_types(self)
        for f in ("hbm_bytes", "peak_flops", "hbm_bandwidth", "link_bandwidth", "host_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Chip({self.name!r}).{f} must be > 0, got {getattr(self, f)}")
        for f in ("efficiency", "forward_efficiency"):
            v = getattr(self, f)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"Chip({self.name!r}).{f}={v} must be in (0, 1]")

    @property
    def forward_rate(self) -> float:
        """FLOP/s of forward-only work."""
        return self.peak_flops * (self.forward_efficiency or self.efficiency)


CHIPS: dict[str, Chip] = {
    "v4": Chip(name="TPU v4", hbm_bytes=32 * GIB, peak_flops=275e12, hbm_bandwidth=1228 * GB,
               link_bandwidth=2400 / 8 * GB, host_bandwidth=16 * GB, cores_per_chip=2,
               source="cloud.google.com/tpu/docs/v4"),
    "v5e": Chip(name="TPU v5e", hbm_bytes=16 * GIB, peak_flops=197e12, hbm_bandwidth=819 * GB,
                link_bandwidth=1600 / 8 * GB, host_bandwidth=16 * GB, source="cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip(name="TPU v5p", hbm_bytes=95 * GIB, peak_flops=459e12, hbm_bandwidth=2765 * GB,
                link_bandwidth=4800 / 8 * GB, host_bandwidth=32 * GB, cores_per_chip=2,
                source="cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip(name="TPU v6e", hbm_bytes=32 * GIB, peak_flops=918e12, hbm_bandwidth=1640 * GB,
                link_bandwidth=3584 / 8 * GB, host_bandwidth=32 * GB, source="cloud.google.com/tpu/docs/v6e"),
    "a100": Chip(name="A100 80GB SXM", hbm_bytes=80 * GB, peak_flops=312e12, hbm_bandwidth=2039 * GB,
                 link_bandwidth=600 * GB, host_bandwidth=32 * GB, step_overhead_s=20e-6,
                 source="NVIDIA A100 datasheet"),
    "h100": Chip(name="H100 SXM", hbm_bytes=80 * GB, peak_flops=989e12, hbm_bandwidth=3350 * GB,
                 link_bandwidth=900 * GB, host_bandwidth=64 * GB, step_overhead_s=20e-6,
                 source="NVIDIA H100 datasheet"),
    "h200": Chip(name="H200 SXM", hbm_bytes=141 * GB, peak_flops=989e12, hbm_bandwidth=4800 * GB,
                 link_bandwidth=900 * GB, host_bandwidth=64 * GB, step_overhead_s=20e-6,
                 source="NVIDIA H200 datasheet"),
    "b200": Chip(name="B200", hbm_bytes=180 * GB, peak_flops=2250e12, hbm_bandwidth=8000 * GB,
                 link_bandwidth=1800 * GB, host_bandwidth=64 * GB, step_overhead_s=20e-6,
                 source="NVIDIA HGX B200 datasheet"),
}
TPUS = ("v4", "v5e", "v5p", "v6e")
GPUS = ("a100", "h100", "h200", "b200")
VALID_NAMES = ", ".join([f"tpu-{g}-N" for g in TPUS] + [f"{g}xN" for g in GPUS] + ["cpu"])


@dataclasses.dataclass(frozen=True)
class Hardware:
    """`devices` identical chips (JAX devices) of one slice or node."""

    name: str
    chip: Chip
    devices: int

    @property
    def backend(self) -> str:
        """The JAX platform: "tpu", "gpu" or "cpu"."""
        return "tpu" if self.name.startswith("tpu-") else "cpu" if self.name == "cpu" else "gpu"


def hardware(name: str) -> Hardware:
    """The datasheet preset `name` (see the module docstring). `cpu` is measured, not looked up:
    `tpurl.plan.calibrate.cpu_hardware` builds it."""
    key = name.strip().lower()
    if key == "cpu":
        raise ValueError("the cpu preset is measured on this machine: build it with "
                         "tpurl.plan.calibrate.cpu_hardware (tpurl plan --hardware cpu does)")
    m = re.fullmatch(r"tpu-(v4|v5e|v5p|v6e)-(\d+)", key) or re.fullmatch(r"(a100|h100|h200|b200)x(\d+)", key)
    if not m or int(m.group(2)) < 1:
        raise ValueError(f"--hardware {name!r} is not a known preset; use one of {VALID_NAMES} "
                         "(e.g. tpu-v5p-8, h100x8)")
    chip, n = CHIPS[m.group(1)], int(m.group(2))
    if n % chip.cores_per_chip:
        raise ValueError(f"--hardware {name!r}: {chip.name} slices count TensorCores, {chip.cores_per_chip} per "
                         f"chip; use a multiple of {chip.cores_per_chip} (e.g. tpu-{m.group(1)}-8)")
    return Hardware(key, chip, n // chip.cores_per_chip)


# Substrings of a JAX device's `device_kind` (lower case) -> its chip in `CHIPS`, most specific first.
DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("b200", "b200"), ("v6 lite", "v6e"),
                ("v6e", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"))
# Variants whose datasheet differs from the preset their name would match (PCIe and NVL cards, the
# 40 GB A100, Grace Hopper and Grace Blackwell): no preset rather than the wrong one.
OTHER_VARIANTS = ("pcie", "nvl", "40gb", "gh200", "gb200")


def preset_for_device(device) -> str | None:
    """The key in `CHIPS` of a JAX device (by its `device_kind`, e.g. "NVIDIA H200" -> "h200",
    "TPU v5 lite" -> "v5e"), or None for a CPU or a chip without a preset of its own."""
    if device.platform == "cpu":
        return None
    kind = device.device_kind.lower()
    if any(v in kind for v in OTHER_VARIANTS):
        return None
    return next((key for part, key in DEVICE_KINDS if part in kind), None)


def is_cpu(name: str) -> bool:
    """Whether `name` is the measured `cpu` preset."""
    return name.strip().lower() == "cpu"


# What `tpurl.plan.calibrate.measure_cpu` records.
CALIBRATION_FIELDS = ("matmul_flops", "efficiency", "forward_efficiency", "memory_bandwidth", "launch_s",
                      "decode_slot_s", "sequence_s", "sync_host_s")


def cpu_chip(cal: dict, devices: int, *, source: str) -> Chip:
    """The `cpu` preset's chip from a calibration record (`CALIBRATION_FIELDS`): the machine's
    measured rates shared by its `devices` JAX devices. `source` names the record in errors."""
    try:
        c = {k: float(cal[k]) for k in CALIBRATION_FIELDS}
    except (TypeError, ValueError):
        raise ValueError(f"CPU calibration {source} has a field that is not a number; delete it to measure "
                         "again") from None
    mem, bw = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), c["memory_bandwidth"] / devices
    return Chip(name="cpu (measured)", hbm_bytes=mem / devices, peak_flops=c["matmul_flops"] / devices,
                hbm_bandwidth=bw, link_bandwidth=bw, host_bandwidth=bw, efficiency=c["efficiency"],
                forward_efficiency=c["forward_efficiency"], step_overhead_s=c["launch_s"],
                decode_slot_s=c["decode_slot_s"], sequence_s=c["sequence_s"], sync_host_s=c["sync_host_s"],
                source=f"measured ({source})")
