"""Test setup: 8 fake CPU devices (set before JAX initializes) with fast-compiling XLA flags
(tests/xla_flags.py), strict rank promotion, fp32 matmuls, and one persistent compilation cache per
test session.

The cache: many tests build the same tiny models and runs, so the same programs are compiled again
and again (every `tpurl train` process and every new runtime compiles its own). JAX's persistent
cache, in a folder of this session's own (new each session: nothing carries over between code
versions), lets the later ones load the executable instead; subprocesses inherit it through the
environment. It roughly halves the runs' tests. Host memory is set up as `tpurl` sets it up
(`tpurl.hostmem`; with 8 fake devices that leaves glibc's defaults)."""

import os
import tempfile

from xla_flags import usable_fast_compile  # tests/ is on the path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
if os.environ["JAX_PLATFORMS"] == "cpu":  # see tests/xla_flags.py
    _fast = usable_fast_compile()
    _flags += _fast
    if not _fast:  # XLA's defaults here and in every `tpurl` process a test starts
        os.environ.setdefault("TPURL_CPU_COMPILE", "xla")
os.environ["XLA_FLAGS"] = " ".join(_flags).strip()
_SESSION = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"{os.getpid()}"  # shared by xdist's workers
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"tpurl-test-jax-cache-{_SESSION}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from tpurl.hostmem import keep_freed_memory  # noqa: E402

try:
    keep_freed_memory()  # as `tpurl` runs: before JAX starts (see tpurl/hostmem.py)
    _HOSTMEM_ERROR = None
except ValueError as e:  # reported by pytest_configure, in one line
    _HOSTMEM_ERROR = str(e)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    if _HOSTMEM_ERROR:
        pytest.exit(f"tests: {_HOSTMEM_ERROR}", returncode=2)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 fake CPU devices, got {len(devs)}"
    return devs
