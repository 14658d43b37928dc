"""`tpurl.startup`: the command line sets XLA:CPU's compile flags (`tpurl.xla_cpu`) and the host
allocator (`tpurl.hostmem`) before JAX starts, and the XLA it starts accepts the flags; a script
with a bad setting of either ends in one line."""

import json
import os
import platform
import subprocess
import sys

import pytest

from tpurl import hostmem, xla_cpu
from xla_flags import FAST_COMPILE  # tests/ is on the path

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

SPY = """
import json, os
import jax._src.xla_bridge as xla_bridge
from tpurl import hostmem, xla_cpu
from tpurl.commands import main as cli

seen = {}
def spy(module, name):
    real = getattr(module, name)
    def call():
        seen[name] = bool(xla_bridge._backends)  # JAX's backends, started or not
        return real()
    setattr(module, name, call)
spy(xla_cpu, "apply")
spy(hostmem, "keep_freed_memory")
status = cli.main(["layouts", "--model", "tiny"])
print(json.dumps({"status": status, "backends_started_first": seen, "xla_flags": os.environ["XLA_FLAGS"],
                  "host_malloc": hostmem.applied_mode()}))
"""


@pytest.mark.slow  # a subprocess that starts JAX
def test_the_command_line_sets_both_before_jax_starts():
    env = {k: v for k, v in os.environ.items()
           if k not in (xla_cpu.ENV, hostmem.ENV, "JAX_NUM_CPU_DEVICES", "LD_PRELOAD")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one CPU device, no flags of the user's
    done = subprocess.run([sys.executable, "-c", SPY], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]  # XLA aborts a process on a flag it does not know
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["status"] == 0
    assert got["backends_started_first"] == {"apply": False, "keep_freed_memory": False}
    assert got["xla_flags"].split() == (list(FAST_COMPILE) if xla_cpu.known_jaxlib() else [])
    assert got["host_malloc"] == ("keep" if GLIBC else "system")


@pytest.mark.parametrize("env,message", [
    ({hostmem.ENV: "on"}, "TPURL_HOST_MALLOC='on' is not a host allocator mode; set it to one of auto, keep, system "
                          "(or unset it)"),
    ({xla_cpu.ENV: "on"}, "TPURL_CPU_COMPILE='on' is not an XLA:CPU compile mode; set it to one of fast, xla "
                          "(or unset it)"),
])
def test_a_script_with_a_bad_setting_ends_in_one_line(env, message):
    code = "from tpurl.startup import apply_at_start; apply_at_start('bench_x')"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.splitlines() == [f"bench_x: {message}"]
