"""Host memory: glibc keeps freed memory for reuse instead of handing it back to the kernel.

Why: XLA:CPU takes every buffer of a program run (its outputs and its scratch) from `malloc`.
glibc serves a block over its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh `mmap`
and unmaps it on `free`, and a thread's own arena returns the freed top of its heap to the kernel
too. So each run of a compiled program writes into pages the kernel must fault in and zero
again, which on CPU can cost more than the computation (docs/performance.md).

What `keep_freed_memory` sets (`mallopt`): one arena for all threads, no `mmap` for large blocks
(they come from the heap and are reused), and no trimming of the heap below 2 GiB free. The
process's resident memory then stays near its peak (a free top of the heap over 2 GiB still goes
back to the kernel: a 30M-parameter update's 12 GB of activations do, docs/performance.md), and
the heap's fragmentation raises that peak above glibc's defaults' (1.6x for a 218M-parameter
model's step: docs/performance.md). The first
two apply to the whole process at once; the single arena only to threads that have not allocated
yet, and a worker thread with an arena of its own still maps (and unmaps) the blocks its heap
cannot hold. Set after `jax.devices()` has started XLA's threads it does not help, so once JAX has
started it sets nothing. `tpurl`'s command line and the scripts call it first thing
(`tpurl.startup`), and so does the tests' conftest.

`TPURL_HOST_MALLOC` chooses: `auto` (the default) keeps freed memory when JAX will run on one CPU
device per process (`JAX_PLATFORMS` names only `cpu` or no GPU/TPU plugin is installed, and neither
`--xla_force_host_platform_device_count` nor `JAX_NUM_CPU_DEVICES` asks for more), where it
helps. The single arena makes every thread share one lock, which slows fake multi-device runs
(the tests' layouts), so they keep glibc's defaults; so does an accelerator host, whose
device buffers do not come from `malloc`. `keep` always, `system` never. Nothing is set without
glibc (macOS, musl) or with another allocator preloaded (`LD_PRELOAD`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import pkgutil
import re
import sys

from tpurl.config_types import env_choice

ENV = "TPURL_HOST_MALLOC"
CHOICES = ("auto", "keep", "system")
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
_applied = False  # whether this process runs with the settings


def mode() -> str:
    """`TPURL_HOST_MALLOC`, checked: "auto" (the default), "keep" or "system"."""
    return env_choice(ENV, CHOICES, "a host allocator mode")


def applied_mode() -> str:
    """The allocator this process runs with: "keep" once `keep_freed_memory` applied its settings,
    else "system" (what a CPU calibration records: the rates differ)."""
    return "keep" if _applied else "system"


def accelerator_host() -> bool:
    """Whether JAX will look for a GPU or TPU: `JAX_PLATFORMS` when set, else an installed plugin
    (found without importing JAX's backends)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    if importlib.util.find_spec("libtpu") is not None:
        return True
    try:
        import jax_plugins  # the namespace package of JAX's PJRT plugins (CUDA, ROCm)
    except ImportError:
        return False
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def _cpu_devices() -> int:
    """CPU devices per process that JAX will make: `JAX_NUM_CPU_DEVICES` when set (as JAX reads it,
    it overrides the flag), else `XLA_FLAGS`' `--xla_force_host_platform_device_count`, else 1."""
    asked = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if asked.isdigit():
        return int(asked)
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(counts[-1]) if counts else 1


def _keeps(chosen: str) -> bool:
    """Whether mode `chosen` keeps freed memory in this process (see the module docstring)."""
    return chosen == "keep" or (chosen == "auto" and not accelerator_host() and _cpu_devices() == 1)


def _glibc_mallopt():
    """glibc's `mallopt`, or None (another C library, or another allocator preloaded)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc...
        return None
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def jax_started() -> bool:
    """Whether JAX's backends (and XLA's threads) already run in this process."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def keep_freed_memory() -> bool:
    """Apply the settings above unless the mode says otherwise or JAX has already started (too late
    to help: see above); whether this process runs with them."""
    global _applied
    if not _keeps(mode()) or (not _applied and jax_started()):
        return _applied
    mallopt = _glibc_mallopt()
    if mallopt is not None:
        done = [mallopt(param, value) == 1 for param, value in _SETTINGS]  # each tried
        _applied = _applied or all(done)
    return _applied
