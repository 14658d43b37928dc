"""Host memory: glibc keeps freed memory for reuse instead of handing it back to the kernel.

Why: XLA:CPU takes every buffer of a program run (its outputs and its scratch) from `malloc`.
glibc serves a block over its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh `mmap`
and unmaps it on `free`, and a thread's own arena returns the freed top of its heap to the kernel
too. So each run of a compiled program writes into pages the kernel must fault in and zero again,
4 KiB at a time: on a 2-core x86 host, `x * 2` over a 35 MB fp32 array took 8.8 ms that way and
1.3 ms with the memory kept; the issue-15 packed update (`scripts/bench_step.py --packing`) 1.17 s
and 0.86 s. On a GPU or TPU the device buffers do not come from `malloc`; host-side arrays do.

What `keep_freed_memory` sets (`mallopt`): one arena for all threads, no `mmap` for large
blocks (they come from the heap and are reused), and no trimming of the heap below 2 GiB free. The
process's resident memory then stays at its peak, as with the allocators that ML runtimes bring
(PyTorch's caching allocator, tcmalloc on Cloud TPU VMs). It must run before JAX starts its CPU
client (the first computation or `jax.devices()`): XLA's threads take their arenas on their first
allocation. `tpurl`'s command line, the benchmarks and the tests call it first thing.

`TPURL_HOST_MALLOC=system` leaves glibc's defaults. Without glibc (macOS, musl), nothing is set.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "TPURL_HOST_MALLOC"
CHOICES = ("keep", "system")
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))


def mode() -> str:
    """`TPURL_HOST_MALLOC`, checked: "keep" (the default) or "system"."""
    value = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a host allocator mode; set it to one of "
                         f"{', '.join(CHOICES)} (or unset it)")
    return value


def keep_freed_memory() -> bool:
    """Apply the settings above unless `TPURL_HOST_MALLOC=system`; whether they were applied."""
    if mode() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)
