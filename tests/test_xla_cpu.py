"""`tpurl.xla_cpu`: a process that runs JAX on the CPU gets XLA:CPU's fast-compile flags, any of
them the user set staying as the user set it, and nothing on an accelerator host, with
`TPURL_CPU_COMPILE=xla`, with a jaxlib not known to have the flags, or once JAX has started.
(That `tpurl` sets them before JAX starts and that this XLA accepts them: tests/test_startup.py.)"""

import importlib.metadata
import os
import re

import pytest

from tpurl import xla_cpu

FAST = ["--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false"]


@pytest.fixture
def cpu_env(monkeypatch):
    """A CPU host with no XLA flags and no mode set, whose jaxlib counts as known (whichever is
    installed: what is tested here is the decision, not the list)."""
    for name in ("XLA_FLAGS", xla_cpu.ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    major, minor = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("jaxlib")).groups()
    monkeypatch.setattr(xla_cpu, "KNOWN_JAXLIB", ((int(major), int(minor)),))
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


@pytest.mark.parametrize("spaces", ["", "  "])
def test_nothing_when_xla_flags_names_a_file_of_flags(cpu_env, tmp_path, spaces):
    """XLA reads an `XLA_FLAGS` that does not start with `-` as a file's name: a flag appended
    to it would make the name one that cannot be opened (XLA then aborts the process)."""
    flags = tmp_path / "flags.txt"
    flags.write_text("--xla_cpu_use_fusion_emitters=true\n")
    cpu_env.setenv("XLA_FLAGS", f"{spaces}{flags}")
    cpu_env.setattr(xla_cpu.hostmem, "jax_started", lambda: False)  # as before JAX starts
    assert xla_cpu.flags_to_add() == [] and xla_cpu.apply() == []
    assert os.environ["XLA_FLAGS"] == f"{spaces}{flags}"


@pytest.mark.parametrize("env", [{xla_cpu.ENV: "xla"}, {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu,cpu"}])
def test_nothing_with_xla_defaults_asked_or_on_an_accelerator_host(cpu_env, env):
    for name, value in env.items():
        cpu_env.setenv(name, value)
    assert xla_cpu.flags_to_add() == []


def test_nothing_with_a_jaxlib_not_known_to_have_the_flags(cpu_env):
    cpu_env.setattr(xla_cpu, "KNOWN_JAXLIB", ((0, 10),))
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
