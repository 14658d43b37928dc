"""What this machine can do for the sandbox, found without the sandbox's own detection: a test that
needs a mechanism asserts it is in force wherever this probe says the machine has it, so a
detection that silently downgrades (a mechanism lost to a bug) fails instead of skipping."""

import functools
import os
import shutil
import subprocess
import sys


def _runs(*argv: str) -> bool:
    try:
        return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def supports() -> dict[str, bool]:
    """Per mechanism of `sandbox_mechanisms`: whether this machine has what it needs."""
    unshare = shutil.which("unshare")
    linux = sys.platform.startswith("linux")
    can = {
        "network": bool(unshare) and _runs(unshare, "--net", "true"),
        "pid": bool(unshare) and _runs(unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "true"),
        "filesystem": bool(unshare) and _runs(unshare, "--mount", "true"),
        "uid": linux and os.geteuid() == 0,  # root can give each execution a uid of its own
        "processes": linux,  # RLIMIT_NPROC
    }
    can["cleanup"] = can["pid"] or can["uid"]  # a daemon is found by its pid namespace or its uid
    return can


def require(mech: dict, key: str, *absent: str, why: str) -> bool:
    """True when the sandbox has the mechanism `key` (its value is not one of `absent`); raises
    AssertionError when it lacks it although the machine supports it; False when the machine
    cannot (the caller skips)."""
    if mech[key] not in absent:
        return True
    assert not supports()[key], (f"the sandbox runs without {why} ({key}={mech[key]!r}) although this machine "
                                 f"supports it: a silent downgrade; {mech}")
    return False
