"""XLA:CPU's compile flags for a tpurl process: its programs compile in 40-50% less time and run as
fast.

What: `--xla_backend_optimization_level=1` (LLVM at -O1, not XLA's -O3) and
`--xla_cpu_use_fusion_emitters=false` (XLA:CPU's loop emitters, not its MLIR fusion emitters). The
matmuls run in the same library kernels either way; what -O3 and the fusion emitters buy is in
elementwise loops, where these programs spend little of their time. On the development CPU a
`tpurl train` run of `scripts/bench_vs_trl.py`'s settings makes its programs in about 45% (4M
parameters) and 40% (30M) less time with steps as fast (docs/performance.md). Code generated
differently may round differently in the last bits; what is computed is the same.

When: `TPURL_CPU_COMPILE` is `fast` (the default) or `xla` (XLA's own defaults). `fast` adds the
flags to `XLA_FLAGS` in a process that will run JAX on the CPU alone (`JAX_PLATFORMS=cpu`, or no
GPU or TPU plugin installed, as `tpurl.hostmem` decides), before JAX starts (XLA reads its flags
when its backends start). It leaves out a flag the user's `XLA_FLAGS` already sets (theirs
stays), adds nothing to an `XLA_FLAGS` that names a file of flags, and adds nothing with a jaxlib
not known to have both flags (`KNOWN_JAXLIB`): XLA aborts a process on a flag it does not know.
Processes started from this one (`tpurl launch`) inherit the flags. `tpurl`'s command line and
the scripts apply it at start (`tpurl.startup`).
"""

from __future__ import annotations

import importlib.metadata
import os
import re

from tpurl import hostmem
from tpurl.config_types import env_choice

ENV = "TPURL_CPU_COMPILE"
CHOICES = ("fast", "xla")
# name -> value: the flags `fast` sets (XLA's own values: 3 and true).
FLAGS = {"xla_backend_optimization_level": "1", "xla_cpu_use_fusion_emitters": "false"}
# jaxlib (major, minor) releases whose XLA has every flag of FLAGS (tests/test_startup.py starts the
# installed one with them when it is one of these).
KNOWN_JAXLIB = ((0, 10),)


def mode() -> str:
    """`TPURL_CPU_COMPILE`, checked: "fast" (the default) or "xla"."""
    return env_choice(ENV, CHOICES, "an XLA:CPU compile mode")


def known_jaxlib(version: str | None = None) -> bool:
    """Whether jaxlib `version` (default: the installed one) is one whose XLA has every flag."""
    if version is None:
        try:
            version = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            return False
    numbers = re.match(r"(\d+)\.(\d+)", version)
    return numbers is not None and (int(numbers[1]), int(numbers[2])) in KNOWN_JAXLIB


def set_by(xla_flags: str) -> set[str]:
    """The names of the flags of FLAGS that an `XLA_FLAGS` value sets."""
    return {name for name in FLAGS if re.search(rf"(^|\s)--{name}(=|\s|$)", xla_flags)}


def flags_to_add() -> list[str]:
    """The flags `apply` would add to this process's `XLA_FLAGS` (see the module docstring). Nothing
    when `XLA_FLAGS` names a file of flags (XLA reads a value that does not start with `-` as one:
    the file's flags are the user's, and a flag appended to its name would make it unreadable)."""
    if mode() != "fast" or hostmem.accelerator_host() or not known_jaxlib():
        return []
    given = os.environ.get("XLA_FLAGS", "").strip()
    if given and not given.startswith("-"):
        return []
    present = set_by(given)
    return [f"--{name}={value}" for name, value in FLAGS.items() if name not in present]


def apply() -> list[str]:
    """Add `flags_to_add()` to `XLA_FLAGS` unless JAX has started (too late: XLA has read its
    flags); the flags added. A bad `TPURL_CPU_COMPILE` raises ValueError."""
    added = flags_to_add()
    if not added or hostmem.jax_started():
        return []
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "").strip(), *added]).strip()
    return added
