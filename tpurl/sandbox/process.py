"""One sandboxed execution: launch, feed, collect capped output, kill everything, clean up.

`execute(mechanism, config, source)` runs Python `source` in a fresh temporary directory with an
empty environment (only a minimal PATH), under the isolation `mechanism` describes (which
`tpurl.sandbox.runner` probes once per configuration), and returns an `Execution`. The child is

    [unshare --net --pid --kill-child --mount-proc] PYTHON -I -B -c PROLOGUE+SOURCE SETTINGS

where the prologue (`confine.py`) confines the process before `source` runs. The parent writes
`stdin` and reads stdout, stderr and the optional result channel through one selector loop, keeps
the first `output_bytes` (`result_bytes` for the channel) of each and drops the rest without
blocking the writer. When the program exits or the wall clock runs out, everything it started is
killed: the process group, the pid namespace (its init dies, so does every process in it), the
pids cgroup and every process of the sandbox uid, whichever are in force, and the function returns
only once they are gone; then the temporary directory is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from tpurl.sandbox.config import SandboxConfig

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
UID_RANGE = 1024  # sandbox uids: uid_base .. uid_base + UID_RANGE - 1, one per concurrent execution
_MAX_PROGRAM = 120_000  # bytes; one argv string may hold at most 128 KiB
_DRAIN_S = 1.0  # after the program exits, how long its leftovers may keep the pipes open
_KILL_WAIT_S = 5.0
_CONFINE_SOURCE = pathlib.Path(__file__).with_name("confine.py").read_text()
_cgroup_serial = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, could not clean up): not the code's fault."""


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """How executions are isolated on this machine (see `runner.detect`)."""

    wrapper: tuple[str, ...]  # argv prefix, e.g. ("/usr/bin/unshare", "--net", ...), or ()
    python: str
    network: str  # "netns" (no network at all) or "none"
    pid: str  # "pidns" (the sandbox's processes die with its init) or "none" (process group only)
    private_tmp: bool  # read-only filesystem but the working directory and a private /tmp
    uid_drop: bool  # runs as its own uid from SandboxConfig.uid_base
    processes: str  # "rlimit_nproc" (own uid), "cgroup_pids", "rlimit_nproc_shared" (caller's uid), "none"
    cgroup_root: str | None = None
    root: bool = False  # the code runs as uid 0 (in its user namespace)
    capabilities: bool = False  # ... and holds capabilities (they could not be dropped)

    def describe(self, config: SandboxConfig) -> dict:
        """What is in force, for run manifests."""
        return {
            "network": self.network, "pid": self.pid,
            "uid": f"{config.uid_base}+" if self.uid_drop else "none" + (
                "" if not self.root else " (root)" if self.capabilities else " (root without capabilities)"),
            "processes": self.processes,
            "filesystem": "read-only, private /tmp" if self.private_tmp else ("uid permissions" if self.uid_drop
                                                                              else "none"),
            "cleanup": "pid namespace" if self.pid == "pidns" else " + ".join(
                ["process group"] + (["cgroup"] if self.processes == "cgroup_pids" else [])
                + (["uid"] if self.uid_drop else [])),
            "python": self.python, "wrapper": " ".join(self.wrapper) or None,
            "limits": {"timeout_s": config.timeout_s, "cpu_s": config.cpu_limit, "memory_mb": config.memory_mb,
                       "file_size_mb": config.file_size_mb, "max_processes": config.max_processes,
                       "output_bytes": config.output_bytes},
        }


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one execution did. `returncode` is negative for a signal; `truncated` names the streams
    cut at their cap."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    channel: bytes
    truncated: tuple[str, ...]
    timed_out: bool
    seconds: float


class _Capped:
    def __init__(self, cap: int):
        self.cap, self.parts, self.kept, self.total = cap, [], 0, 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.kept < self.cap:
            self.parts.append(chunk[:self.cap - self.kept])
            self.kept += len(self.parts[-1])

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)


def execute(mech: Mechanism, config: SandboxConfig, source: str, *, stdin: bytes = b"",
            channel: bool = False) -> Execution:
    """Run `source` once under `mech` and `config` (see the module docstring)."""
    program = (_CONFINE_SOURCE + "\nCHANNEL_FD = confine(json.loads(sys.argv[1]))\n"
               + f"exec(compile({source!r}, '<sandbox>', 'exec'),"
               + " {'__name__': '__main__', 'CHANNEL_FD': CHANNEL_FD})\n")
    if len(program.encode()) > _MAX_PROGRAM:
        raise ValueError(f"sandbox: the program is {len(program.encode())} bytes, over {_MAX_PROGRAM}; pass large "
                         "inputs on stdin")
    start = time.monotonic()
    sinks = {"stdout": _Capped(config.output_bytes), "stderr": _Capped(config.output_bytes),
             "channel": _Capped(config.result_bytes)}
    with _claimed_uid(mech, config) as uid, _workdir(uid) as workdir, _cgroup(mech, config) as cgroup:
        settings = {"workdir": workdir, "private_tmp": mech.private_tmp, "tmpfs_mb": config.tmpfs_mb, "uid": uid,
                    "cgroup": cgroup, "limits": _limits(mech, config)}
        read_end, write_end = os.pipe() if channel else (None, None)
        settings["channel_fd"] = write_end
        proc = None
        try:
            argv = [*mech.wrapper, mech.python, "-I", "-B", "-c", program, json.dumps(settings)]
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        cwd=workdir, env=ENV, pass_fds=() if write_end is None else (write_end,),
                                        start_new_session=True)
            except OSError as e:
                raise SandboxError(f"sandbox: could not start {argv[0]}: {e}") from None
            if write_end is not None:
                os.close(write_end)
                write_end = None
            fds = {proc.stdout.fileno(): sinks["stdout"], proc.stderr.fileno(): sinks["stderr"]}
            if read_end is not None:
                fds[read_end] = sinks["channel"]
            timed_out = _collect(proc, stdin, fds, start + config.timeout_s,
                                 on_exit=lambda: _terminate(proc, mech, uid, cgroup))
        finally:
            if proc is not None:
                try:
                    _terminate(proc, mech, uid, cgroup)
                finally:
                    proc.wait()
                    for f in (proc.stdin, proc.stdout, proc.stderr):
                        with contextlib.suppress(OSError):
                            f.close()
            for fd in (read_end, write_end):
                if fd is not None:
                    os.close(fd)
    return Execution(returncode=proc.returncode, stdout=sinks["stdout"].data, stderr=sinks["stderr"].data,
                     channel=sinks["channel"].data, truncated=tuple(k for k, s in sinks.items() if s.total > s.cap),
                     timed_out=timed_out, seconds=time.monotonic() - start)


def _limits(mech: Mechanism, config: SandboxConfig) -> dict:
    nproc = None
    if mech.processes == "rlimit_nproc":
        nproc = config.max_processes
    elif mech.processes == "rlimit_nproc_shared":  # the limit counts all of this user's threads
        nproc = _threads_of_uid(os.getuid()) + config.max_processes
    return {"cpu": config.cpu_limit, "as": config.memory_mb << 20, "fsize": config.file_size_mb << 20,
            "nofile": 256, "core": 0, "nproc": nproc}


def _collect(proc: subprocess.Popen, stdin: bytes, sinks: dict[int, _Capped], deadline: float, on_exit) -> bool:
    """Write `stdin` and read every pipe into its sink until all are closed; True when the deadline
    passed first. Once the program has exited, `on_exit` kills whatever still holds a pipe open."""
    sel = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending, wfd = memoryview(stdin), proc.stdin.fileno()
    if pending:
        os.set_blocking(wfd, False)
        sel.register(wfd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    exited = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return True
            if exited is None and proc.poll() is not None:
                exited = now
                on_exit()
            if exited is not None and now - exited > _DRAIN_S:
                return False
            for key, _ in sel.select(min(0.05, deadline - now)):
                if key.fd == wfd:
                    try:
                        pending = pending[os.write(wfd, pending[:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed its stdin: the rest is not wanted
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(wfd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if chunk:
                    sinks[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
        return False
    finally:
        sel.close()


def _terminate(proc: subprocess.Popen, mech: Mechanism, uid: int | None, cgroup: str | None) -> None:
    """Kill the execution's every process and return once they are gone."""
    init = _child_of(proc.pid) if mech.pid == "pidns" and proc.poll() is None else None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group; the namespace's init gets SIGKILL too
    if cgroup is not None:
        _kill_until_empty(lambda: _read_pids(os.path.join(cgroup, "cgroup.procs")), "its pids cgroup")
    if uid is not None and mech.pid != "pidns":
        _kill_until_empty(lambda: _pids_of_uid(uid), f"uid {uid}")
    if init is not None:
        _wait_gone(init)


def _kill_until_empty(list_pids, what: str) -> None:
    end = time.monotonic() + _KILL_WAIT_S
    while pids := list_pids():
        if time.monotonic() > end:
            raise SandboxError(f"sandbox: processes {pids[:5]} of {what} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _child_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        return int(children[0]) if children else None
    except OSError:
        return next((int(p) for p in os.listdir("/proc") if p.isdigit() and (s := _proc_stat(int(p)))
                     and s[1] == str(pid)), None)


def _wait_gone(pid: int) -> None:
    """Wait until `pid` is dead (a zombie counts: a namespace's init becomes one only after every
    process in its namespace has exited)."""
    end = time.monotonic() + _KILL_WAIT_S
    while (stat := _proc_stat(pid)) is not None and stat[0] not in ("Z", "X"):
        if time.monotonic() > end:
            raise SandboxError(f"sandbox: the pid namespace of init {pid} survives SIGKILL")
        time.sleep(0.005)


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    return list(_threads_by_pid(uid))


def _threads_of_uid(uid: int) -> int:
    """Threads of the live processes whose real uid is `uid`: what RLIMIT_NPROC counts."""
    return sum(_threads_by_pid(uid).values())


def _threads_by_pid(uid: int) -> dict[int, int]:
    """pid -> thread count of the live (not zombie) processes whose real uid is `uid`."""
    found = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:", "Threads:")))
            except (OSError, ValueError):
                continue
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
                found[int(p)] = int(fields.get("Threads", "1"))
    return found


@contextlib.contextmanager
def _claimed_uid(mech: Mechanism, config: SandboxConfig):
    """A sandbox uid no other execution on this machine holds (an flock per uid), or None."""
    if not mech.uid_drop:
        yield None
        return
    locks = os.path.join(tempfile.gettempdir(), "tpurl-sandbox-uids")
    os.makedirs(locks, mode=0o755, exist_ok=True)
    for uid in range(config.uid_base, config.uid_base + UID_RANGE):
        fd = os.open(os.path.join(locks, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            _kill_until_empty(lambda: _pids_of_uid(uid), f"uid {uid}")  # leftovers of a crashed run
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxError(f"sandbox: all {UID_RANGE} sandbox uids from {config.uid_base} are in use")


@contextlib.contextmanager
def _workdir(uid: int | None):
    path = tempfile.mkdtemp(prefix=f"tpurl-sandbox-{os.getpid()}-")
    try:
        if uid is not None:
            os.chown(path, uid, uid)
        yield path
    finally:
        shutil.rmtree(path, onerror=_make_removable)


def _make_removable(func, path, exc_info) -> None:
    """Code that removed its own permissions still gets its files deleted."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_make_removable)
    else:
        os.unlink(path)


@contextlib.contextmanager
def _cgroup(mech: Mechanism, config: SandboxConfig):
    if mech.processes != "cgroup_pids":
        yield None
        return
    path = os.path.join(mech.cgroup_root, f"tpurl-sandbox-{os.getpid()}-{next(_cgroup_serial)}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(config.max_processes))
        yield path
    finally:
        _kill_until_empty(lambda: _read_pids(os.path.join(path, "cgroup.procs")), "its pids cgroup")
        end = time.monotonic() + _KILL_WAIT_S
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:  # busy until the last member is reaped
                if time.monotonic() > end:
                    raise
                time.sleep(0.01)
