"""Which isolation this machine allows (probed once per configuration), and running code with it.

`detect(config)` tries the strongest setup first and keeps the first one a probe execution
confirms (the probe reports its pid, its uid and what connecting to 127.0.0.1 does):

1. `unshare --net --pid --kill-child --mount-proc` (with `--map-root-user` when not root): no
   network, a pid namespace, a read-only filesystem with a private `/tmp`;
2. the same without the private filesystem; 3. `unshare --net` alone; 4. no wrapper.

For each, as root and with `SandboxConfig.uid_base` set, it first tries dropping to a sandbox uid
(so RLIMIT_NPROC binds and nothing of root's is writable) with each candidate interpreter: the
configured one, or this one and then the system `python3`s (an interpreter under a 0700 home
cannot be read once the uid is dropped). Without a uid drop, processes are capped by a pids
cgroup when one is writable, else by RLIMIT_NPROC over the caller's own uid when not root.
`sandbox_mechanisms(config)` reports the result for run manifests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
import threading

from tpurl.sandbox.config import SandboxConfig
from tpurl.sandbox.process import Execution, Mechanism, SandboxError, execute

UNSHARE = "unshare"  # found on SYSTEM_PATH; tests point it elsewhere to see the fallbacks
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_PROBE = """import errno, json, os, socket
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(2)
try:
    s.connect(("127.0.0.1", 9))
    net = "open"
except OSError as e:
    net = errno.errorcode.get(e.errno, str(e.errno))
caps = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff:"))
print(json.dumps({"pid": os.getpid(), "uid": os.getuid(), "net": net, "caps": int(caps, 16)}))
"""
_PROBE_TIMEOUT_S = 30.0  # the first execution on a loaded machine can be slow
_detected: dict[tuple, Mechanism] = {}
_lock = threading.Lock()


def detect(config: SandboxConfig) -> Mechanism:
    """The strongest isolation that works here for `config` (probed once, then cached)."""
    key = (config.python, config.uid_base, UNSHARE)
    with _lock:
        if key not in _detected:
            _detected[key] = _probe_all(config)
        return _detected[key]


def sandbox_mechanisms(config: SandboxConfig | None = None) -> dict:
    """What isolates sandboxed code on this machine: network, pid, uid, process limit, filesystem,
    cleanup, the interpreter and the limits (see `Mechanism.describe`)."""
    config = config or SandboxConfig()
    return detect(config).describe(config)


def run_python(source: str, *, config: SandboxConfig, stdin: bytes = b"", channel: bool = False) -> Execution:
    """Run Python `source` (untrusted is fine) in a fresh sandbox; see `tpurl.sandbox`.

    With `channel`, the program finds a write-only pipe's file descriptor in the global
    `CHANNEL_FD`; what it writes there comes back as `Execution.channel`."""
    return execute(detect(config), config, source, stdin=stdin, channel=channel)


class SandboxPool(concurrent.futures.ThreadPoolExecutor):
    """A `concurrent.futures` executor for sandboxed work: at most `config.num_workers` tasks (each
    one execution, e.g. `run_python` or `grade`) run at once, so many gradings share the CPUs
    without oversubscribing them."""

    def __init__(self, config: SandboxConfig):
        super().__init__(max_workers=config.num_workers, thread_name_prefix="tpurl-sandbox")
        self.config = config


def _candidate_pythons(config: SandboxConfig) -> list[str]:
    if config.python is not None:
        return [config.python]
    found = [sys.executable] + [p for p in SYSTEM_PYTHONS if os.path.exists(p)]
    seen, out = set(), []
    for p in found:
        if os.path.realpath(p) not in seen:
            seen.add(os.path.realpath(p))
            out.append(p)
    return out


def _cgroup_root() -> str | None:
    """A pids cgroup directory this process may create groups in (cgroup v1 or v2), or None."""
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        test = os.path.join(root, f"tpurl-sandbox-probe-{os.getpid()}")
        try:
            os.mkdir(test)
        except OSError:
            continue
        try:
            if os.path.exists(os.path.join(test, "pids.max")):
                return root
        finally:
            os.rmdir(test)
    return None


def _probe_all(config: SandboxConfig) -> Mechanism:
    root = os.geteuid() == 0
    unshare = shutil.which(UNSHARE, path=SYSTEM_PATH)
    variants: list[tuple[tuple[str, ...], bool]] = []
    if unshare:
        user = () if root else ("--map-root-user",)
        full = (unshare, *user, "--net", "--pid", "--kill-child", "--mount-proc")
        variants += [(full, True), (full, False), ((unshare, *user, "--net"), False)]
    variants.append(((), False))
    pythons = _candidate_pythons(config)
    cgroup = _cgroup_root() if root else None
    shared = "rlimit_nproc_shared" if not root else ("cgroup_pids" if cgroup else "none")
    failures = []
    for wrapper, private in variants:
        tries = [(py, True) for py in pythons] if root and config.uid_base is not None else []
        for python, drop in tries + [(pythons[0], False)]:
            mech = Mechanism(wrapper=wrapper, python=python, network="none", pid="none", private_tmp=private,
                             uid_drop=drop, processes="rlimit_nproc" if drop else shared, cgroup_root=cgroup)
            found = _probe(mech, config, failures)
            if found is not None:
                return found
    raise SandboxError("sandbox: no way to run sandboxed Python here; tried " + "; ".join(failures[-3:]))


def _probe(mech: Mechanism, config: SandboxConfig, failures: list[str]) -> Mechanism | None:
    """`mech` with network and pid filled in from what a probe execution saw, or None if it fails."""
    probe_config = config.replace(timeout_s=max(config.timeout_s, _PROBE_TIMEOUT_S), cpu_seconds=None)
    where = f"{mech.python} via {' '.join(mech.wrapper) or 'no wrapper'}"
    try:
        ex = execute(mech, probe_config, _PROBE)
    except SandboxError as e:
        failures.append(f"{where}: {e}")
        return None
    try:
        seen = json.loads(ex.stdout) if ex.returncode == 0 else None
    except ValueError:
        seen = None
    if seen is None or (mech.uid_drop and seen["uid"] < config.uid_base):
        why = ex.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {ex.returncode}"]
        failures.append(f"{where}: {why[0]}")
        return None
    return Mechanism(wrapper=mech.wrapper, python=mech.python,
                     network="netns" if seen["net"] == "ENETUNREACH" else "none",
                     pid="pidns" if seen["pid"] == 1 and "--pid" in mech.wrapper else "none",
                     private_tmp=mech.private_tmp, uid_drop=mech.uid_drop, processes=mech.processes,
                     cgroup_root=mech.cgroup_root, root=seen["uid"] == 0, capabilities=seen["caps"] != 0)
