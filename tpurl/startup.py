"""What a tpurl process sets before JAX starts: XLA:CPU's compile flags (`tpurl.xla_cpu`) and the
host allocator (`tpurl.hostmem`). Both only help if set before JAX starts its backends, so
`tpurl`'s command line calls `prepare` first thing and the scripts `apply_at_start`; a program
that uses tpurl as a library calls `prepare()` before its first JAX computation."""

from __future__ import annotations

import sys

from tpurl import hostmem, xla_cpu


def prepare() -> None:
    """Apply both (each decides from the environment whether it applies); a bad `TPURL_CPU_COMPILE`
    or `TPURL_HOST_MALLOC` raises ValueError."""
    xla_cpu.apply()
    hostmem.keep_freed_memory()


def apply_at_start(prog: str) -> None:
    """`prepare()` at a program's start; a bad setting ends the program with one line,
    `prog: message`, and status 2."""
    try:
        prepare()
    except ValueError as e:
        sys.stderr.write(f"{prog}: {e}\n")
        raise SystemExit(2) from None
