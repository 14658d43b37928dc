"""Hardware presets of `tpurl plan`: per-chip memory, peak rate and bandwidths from public datasheets,
and `cpu`, measured on this machine.

Names: `tpu-<gen>-<N>` follows Cloud TPU's slice names (`tpu-v5p-8`): for v4 and v5p, N counts
TensorCores and a chip (one JAX device) has two, so `tpu-v5p-8` is 4 chips; for v5e and v6e, N
counts chips. GPUs are `<chip>x<N>` (`h100x8`: one node of 8). `cpu` is this machine with
`jax.device_count()` devices sharing its measured matmul rate and memory bandwidth.

Sources (bf16 dense peak, HBM, HBM bandwidth, chip-to-chip bandwidth per chip): Cloud TPU system
architecture pages (v4, v5e, v5p, v6e: "Interchip Interconnect BW" given in Gbps, divided by 8
here); NVIDIA A100 80GB SXM, H100 SXM, H200 SXM and HGX B200 datasheets (dense bf16 Tensor Core
rate, i.e. half the "with sparsity" figure; NVLink bandwidth per GPU). The host link (PCIe, for the
colocated offload) is the bus generation's x16 rate per direction, an approximation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

from tpurl.config_types import check_types

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator chip (one JAX device): memory bytes, peak bf16 FLOP/s, bandwidths in bytes/s.

    `efficiency`: the fraction of `peak_flops` a large matmul workload reaches (the "MFU" the
    update and prefill are predicted at); `step_overhead_s`: the fixed cost of one launched
    program (a decode step's dispatch and host round trip)."""

    name: str
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float
    efficiency: float = 0.5
    step_overhead_s: float = 50e-6
    cores_per_chip: int = 1
    source: str = ""

    def __post_init__(self):
        check_types(self)
        for f in ("hbm_bytes", "peak_flops", "hbm_bandwidth", "link_bandwidth", "host_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Chip({self.name!r}).{f} must be > 0, got {getattr(self, f)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Chip({self.name!r}).efficiency={self.efficiency} must be in (0, 1]")


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


def hardware(name: str, *, calibration_path: str | None = None) -> Hardware:
    """The preset `name` (see the module docstring); `cpu` measures this machine once and caches it
    at `calibration_path` (default: `cpu_calibration_path()`)."""
    key = name.strip().lower()
    if key == "cpu":
        import jax

        return Hardware("cpu", cpu_chip(calibration_path, jax.device_count()), jax.device_count())
    m = re.fullmatch(r"tpu-(v4|v5e|v5p|v6e)-(\d+)", key) or re.fullmatch(r"(a100|h100|h200|b200)x(\d+)", key)
    if not m or int(m.group(2)) < 1:
        raise ValueError(f"--hardware {name!r} is not a known preset; use one of {VALID_NAMES} "
                         "(e.g. tpu-v5p-8, h100x8)")
    chip, n = CHIPS[m.group(1)], int(m.group(2))
    if n % chip.cores_per_chip:
        raise ValueError(f"--hardware {name!r}: {chip.name} slices count TensorCores, {chip.cores_per_chip} per "
                         f"chip; use a multiple of {chip.cores_per_chip} (e.g. tpu-{m.group(1)}-8)")
    return Hardware(key, chip, n // chip.cores_per_chip)


def cpu_calibration_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpurl", "cpu_calibration.json")


def measure_cpu() -> dict[str, float]:
    """This machine's fp32 matmul rate (FLOP/s), memory bandwidth (bytes/s, read + write of a
    64 MiB array) and the cost of launching one small jitted program (s): a few seconds."""
    import jax
    import jax.numpy as jnp

    def best(fn, *args, reps=5):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    matmul = best(jax.jit(lambda x: x @ x), a)
    big = jnp.ones((16 * 2**20,), jnp.float32)
    copy = best(jax.jit(lambda x: x * 2.0), big)
    small = jnp.ones((8,), jnp.float32)
    launch = best(jax.jit(lambda x: x + 1.0), small, reps=50)
    return {"matmul_flops": 2 * n**3 / matmul, "memory_bandwidth": 2 * big.nbytes / copy, "launch_s": launch}


def cpu_chip(calibration_path: str | None, devices: int) -> Chip:
    """The `cpu` preset's chip: the machine's measured rates shared by its `devices` JAX devices."""
    path = calibration_path or cpu_calibration_path()
    if os.path.exists(path):
        with open(path) as f:
            cal = json.load(f)
    else:
        cal = measure_cpu()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    try:
        flops, bw, launch = float(cal["matmul_flops"]), float(cal["memory_bandwidth"]), float(cal["launch_s"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"CPU calibration {path} lacks matmul_flops/memory_bandwidth/launch_s; delete it "
                         "to measure again") from None
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Chip(name="cpu (measured)", hbm_bytes=mem / devices, peak_flops=flops / devices,
                hbm_bandwidth=bw / devices, link_bandwidth=bw / devices, host_bandwidth=bw / devices,
                efficiency=1.0, step_overhead_s=launch, source=f"measured ({path})")
