"""Host memory: glibc keeps freed memory for reuse instead of handing it back to the kernel.

Why: XLA:CPU takes every buffer of a program run (its outputs and its scratch) from `malloc`.
glibc serves a block over its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh `mmap`
and unmaps it on `free`, and a thread's own arena returns the freed top of its heap to the kernel
too. So each run of a compiled program writes into pages the kernel must fault in and zero
again: on a 2-core x86 host, `x * 2` over a 35 MB fp32 array took 8.8 ms that way and 1.3 ms with
the memory kept (docs/performance.md).

What `keep_freed_memory` sets (`mallopt`): one arena for all threads, no `mmap` for large
blocks (they come from the heap and are reused), and no trimming of the heap below 2 GiB free.
The process's resident memory then stays at its peak. The first two apply to the whole process at
once; the single arena only to threads that have not allocated yet, and a worker thread with an
arena of its own still maps (and unmaps) the blocks its heap cannot hold. Measured, set after
`jax.devices()` had started XLA's threads, most ops ran as slowly as with glibc's defaults: call
it before JAX starts. `tpurl`'s command line, the scripts and the tests do (`apply_at_start`).

`TPURL_HOST_MALLOC` chooses: `auto` (the default) keeps freed memory when JAX will run on the CPU
(`JAX_PLATFORMS` names only `cpu`, or no GPU/TPU plugin is installed), where it was measured; on
an accelerator host the device buffers do not come from `malloc` and glibc's defaults stay (a
single arena would make every host thread share one lock). `keep` always, `system` never. Nothing
is set without glibc (macOS, musl) or with another allocator preloaded (`LD_PRELOAD`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import pkgutil
import sys

ENV = "TPURL_HOST_MALLOC"
CHOICES = ("auto", "keep", "system")
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
_applied = False  # whether this process runs with the settings


def mode() -> str:
    """`TPURL_HOST_MALLOC`, checked: "auto" (the default), "keep" or "system"."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a host allocator mode; set it to one of "
                         f"{', '.join(CHOICES)} (or unset it)")
    return value


def applied_mode() -> str:
    """The allocator this process runs with: "keep" once `keep_freed_memory` applied its settings,
    else "system" (what a CPU calibration records: the rates differ)."""
    return "keep" if _applied else "system"


def _accelerator_host() -> bool:
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


def _glibc_mallopt():
    """glibc's `mallopt`, or None (another C library, or another allocator preloaded)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc...
        return None
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Apply the settings above unless the mode says otherwise; whether this process runs with them."""
    global _applied
    chosen = mode()
    if chosen == "system" or (chosen == "auto" and _accelerator_host()):
        return _applied
    mallopt = _glibc_mallopt()
    if mallopt is not None:
        done = [mallopt(param, value) == 1 for param, value in _SETTINGS]  # each tried
        _applied = _applied or all(done)
    return _applied


def apply_at_start(prog: str) -> None:
    """`keep_freed_memory()` at a program's start; a bad `TPURL_HOST_MALLOC` ends the program with
    one line, `prog: message`, and status 2."""
    try:
        keep_freed_memory()
    except ValueError as e:
        sys.stderr.write(f"{prog}: {e}\n")
        raise SystemExit(2) from None
