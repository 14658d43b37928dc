"""`tpurl.hostmem`: with the memory kept, a freed large block is reused without the kernel faulting
its pages in again, on a worker thread too (as XLA's are); with glibc's defaults
(`TPURL_HOST_MALLOC=system`) every allocation is faulted in anew. Each case runs in a fresh process:
the single arena only binds threads that have not allocated yet. (That `tpurl` applies it before
JAX starts: tests/test_startup.py.)"""

import json
import os
import platform
import subprocess
import sys

import pytest

from tpurl import hostmem

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

CHILD = """
import json, resource, threading
import numpy as np
from tpurl.hostmem import keep_freed_memory

applied = keep_freed_memory()

def faults():  # minor page faults of allocating, writing and freeing 96 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(24 * 2**20, np.float32)
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def on_a_thread(out):  # a worker thread's allocations (more than its own arena's 64 MiB heap holds)
    out += [faults() for _ in range(4)][1:]  # the first grows the heap: its pages are new either way

main = [faults() for _ in range(4)][1:]
worker = []
thread = threading.Thread(target=on_a_thread, args=(worker,))
thread.start()
thread.join()
print(json.dumps({"applied": applied, "main": main, "worker": worker}))
"""
HUGE_PAGES = 96 * 2**20 // 2**21  # the kernel may back the block with 2 MiB pages: at least one fault each


def _run(code: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "LD_PRELOAD")}
    env.update({hostmem.ENV: mode, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})  # one CPU device, glibc's malloc
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults():
    kept, system = _run(CHILD, "auto"), _run(CHILD, "system")
    assert kept["applied"] and not system["applied"]
    for where in ("main", "worker"):  # the violation this guards against: faults on every allocation
        assert min(system[where]) >= HUGE_PAGES, (where, system)
        assert max(kept[where]) < 8, (where, kept)


@pytest.mark.parametrize("env,keeps", [
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": "cuda,cpu"}, False),  # an accelerator host: device buffers are not malloc's
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, False),
    ({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}, False),  # fake devices contend for one arena
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, True),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
      "JAX_NUM_CPU_DEVICES": "1"}, True),  # JAX reads JAX_NUM_CPU_DEVICES first
])
def test_auto_keeps_memory_for_one_cpu_device_only(monkeypatch, env, keeps):
    for name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hostmem._keeps("auto") is keeps
    assert hostmem._keeps("keep") and not hostmem._keeps("system")


@pytest.mark.parametrize("value", ["tcmalloc", "1"])
def test_bad_mode_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv(hostmem.ENV, value)
    with pytest.raises(ValueError, match=f"{hostmem.ENV}='{value}' is not a host allocator mode") as e:
        hostmem.keep_freed_memory()
    assert len(str(e.value).splitlines()) == 1


def test_auto_finds_an_installed_accelerator_plugin(monkeypatch, tmp_path):
    """Without JAX_PLATFORMS, an installed GPU/TPU plugin makes it an accelerator host."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(hostmem.importlib.util, "find_spec", lambda name: None)  # no libtpu
    plugins = tmp_path / "jax_plugins"
    plugins.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    assert not hostmem.accelerator_host()  # the namespace package, empty
    (plugins / "xla_cuda12").mkdir()
    (plugins / "xla_cuda12" / "__init__.py").write_text("")  # as jax-cuda12-plugin installs it
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    assert hostmem.accelerator_host()


def test_the_default_calibration_file_is_per_mode(monkeypatch, tmp_path):
    from tpurl.plan.calibrate import cpu_calibration_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for applied in (False, True):
        monkeypatch.setattr(hostmem, "_applied", applied)
        assert cpu_calibration_path() == str(tmp_path / "tpurl" / f"cpu_calibration_{hostmem.applied_mode()}.json")
