"""`tpurl.xla_cpu`: a `tpurl` process that runs JAX on the CPU starts with XLA:CPU's fast-compile
flags, set before JAX starts, leaving any of them the user set as the user set it, and nothing on
an accelerator host, with `TPURL_CPU_COMPILE=xla`, or with a jaxlib not known to have the flags."""

import json
import os
import subprocess
import sys

import pytest

from tpurl import xla_cpu

FAST = ["--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false"]


@pytest.fixture
def cpu_env(monkeypatch):
    """A CPU host with no XLA flags and no mode set."""
    for name in ("XLA_FLAGS", xla_cpu.ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return monkeypatch


def test_a_cpu_host_gets_both_flags(cpu_env):
    assert xla_cpu.flags_to_add() == FAST


@pytest.mark.parametrize("user_flags,added", [
    ("--xla_backend_optimization_level=3", FAST[1:]),
    ("--xla_force_host_platform_device_count=8 --xla_cpu_use_fusion_emitters=true", FAST[:1]),
    ("--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters", []),
    ("--xla_backend_optimization_level_other=2", FAST),  # another flag of a longer name
])
def test_a_flag_the_user_set_stays_theirs(cpu_env, user_flags, added):
    cpu_env.setenv("XLA_FLAGS", user_flags)
    assert xla_cpu.flags_to_add() == added


@pytest.mark.parametrize("env", [{xla_cpu.ENV: "xla"}, {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu,cpu"}])
def test_nothing_with_xla_defaults_asked_or_on_an_accelerator_host(cpu_env, env):
    for name, value in env.items():
        cpu_env.setenv(name, value)
    assert xla_cpu.flags_to_add() == []


def test_nothing_with_a_jaxlib_not_known_to_have_the_flags(cpu_env):
    assert xla_cpu.known_jaxlib("0.10.2") and not xla_cpu.known_jaxlib("0.11.0")
    assert not xla_cpu.known_jaxlib("0.9.1") and not xla_cpu.known_jaxlib("dev")
    cpu_env.setattr(xla_cpu, "KNOWN_JAXLIB", ())
    assert xla_cpu.flags_to_add() == []


@pytest.mark.parametrize("value", ["slow", "1"])
def test_bad_mode_is_a_one_line_error(cpu_env, value):
    cpu_env.setenv(xla_cpu.ENV, value)
    with pytest.raises(ValueError, match=f"{xla_cpu.ENV}='{value}' is not an XLA:CPU compile mode") as e:
        xla_cpu.flags_to_add()
    assert len(str(e.value).splitlines()) == 1


def test_once_jax_has_started_it_sets_nothing(cpu_env, devices):
    assert xla_cpu.flags_to_add() == FAST  # it would, but XLA has read its flags already
    assert xla_cpu.apply() == [] and "XLA_FLAGS" not in os.environ


@pytest.mark.slow  # a subprocess that starts JAX
def test_the_command_line_sets_them_before_jax_starts_and_this_xla_accepts_them():
    spy = """
import json, os
import jax._src.xla_bridge as xla_bridge
from tpurl import xla_cpu
from tpurl.commands import main as cli

seen = []
real = xla_cpu.apply
def spy():
    seen.append(bool(xla_bridge._backends))  # JAX's backends, started or not
    return real()
xla_cpu.apply = spy
status = cli.main(["layouts", "--model", "tiny"])
print(json.dumps({"status": status, "backends_started_first": seen, "xla_flags": os.environ["XLA_FLAGS"]}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_cpu.ENV, "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", spy], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]  # XLA aborts a process on a flag it does not know
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["status"] == 0 and got["backends_started_first"] == [False]
    assert got["xla_flags"].split() == (FAST if xla_cpu.known_jaxlib() else [])


def test_a_script_with_a_bad_mode_ends_in_one_line():
    code = "from tpurl.startup import apply_at_start; apply_at_start('bench_x')"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, xla_cpu.ENV: "on"},
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "bench_x: TPURL_CPU_COMPILE='on' is not an XLA:CPU compile mode; set it to one of fast, xla (or unset it)"]
