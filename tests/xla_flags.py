"""The XLA flags of test processes (pytest's and the subprocesses tests start) on CPU.

Tests compile hundreds of tiny programs and run each a few times, so compiling dominates the
suite. They run with the compile flags a `tpurl` process on the CPU sets (`tpurl.xla_cpu.FLAGS`:
LLVM at -O1, XLA:CPU's loop emitters), which compile about 2x faster than XLA's defaults; unlike
`tpurl`, which sets them only for the jaxlib releases known to have them, the tests probe the
installed XLA. (-O0 compiles faster still, but rounds differently enough that tests which expect
two engines' sampled tokens to agree exactly diverge at near-ties.) `TPURL_TEST_FAST_COMPILE=0`
runs the tests with XLA's defaults; tests/sharding/test_parity.py checks the standard train
layout's gradients with them.
"""

import os
import subprocess
import sys

from tpurl import xla_cpu

FAST_COMPILE = tuple(f"--{name}={value}" for name, value in xla_cpu.FLAGS.items())
# XLA's own values of those flags, for a test that must compile as XLA does by default.
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def usable_fast_compile() -> tuple[str, ...]:
    """`FAST_COMPILE` if this XLA knows every flag of it, else () (an unknown flag in XLA_FLAGS
    aborts the process, and a newer XLA may drop one). Probed once per pytest session (xdist's
    workers inherit the answer); `TPURL_TEST_FAST_COMPILE=0` or `1` skips the probe."""
    known = os.environ.get("TPURL_TEST_FAST_COMPILE")
    if known is None:
        env = {**os.environ, "XLA_FLAGS": " ".join(FAST_COMPILE), "JAX_PLATFORMS": "cpu"}
        try:
            probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                                   capture_output=True, timeout=120)
            ok = probe.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        known = os.environ["TPURL_TEST_FAST_COMPILE"] = "1" if ok else "0"
    return FAST_COMPILE if known == "1" else ()


def cpu_xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a test process on the CPU backend with `devices` fake devices."""
    return " ".join([*usable_fast_compile(), f"--xla_force_host_platform_device_count={devices}"])
