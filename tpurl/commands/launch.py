"""`tpurl launch`: run a tpurl command as N cooperating local processes (multi-process on one machine).

    tpurl launch -n 2 --devices-per-process 4 -- train --gin_file configs/test_tiny.gin

Starts N copies of `python -m tpurl COMMAND ...`, each told how to join the run through
`TPURL_COORDINATOR_ADDRESS` (a free localhost port), `TPURL_NUM_PROCESSES` and `TPURL_PROCESS_ID`
(read by `tpurl.sharding.distributed`). `--devices-per-process K` gives each process K fake CPU
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=K`, `JAX_PLATFORMS=cpu`): the way to try
a multi-process run without accelerators. Every output line is forwarded with its process's prefix
(`[p0] ...`) and kept in that process's log (`p0.log` in a `tpurl-launch-*` temporary directory,
removed when every process succeeds).

The launcher supervises: when a process fails, it stops the others, prints one line of its own
(which process, its status, its log) and exits with that status; it exits 0 when all succeed. A
SIGTERM, SIGINT or SIGHUP to the launcher (`timeout`, systemd, Slurm and Kubernetes stop jobs with
SIGTERM) is passed on to every process, which get `STOP_GRACE_S` to end before they are killed, and
it exits with 128 + the signal's number (a signal it was started ignoring, as under `nohup`, stays
ignored). Stopping a process stops its process group, so what it started goes with it. The
processes never outlive the launcher: on Linux each is also killed when the launcher dies without
a chance to stop them (SIGKILL, `PR_SET_PDEATHSIG`). What those processes start in turn is not
covered by that: tpurl's grader workers end when their parent does (their input closes), sandboxed
programs at their limits.

For several machines, start one process per machine with those variables (or JAX's own
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) yourself, or let a cluster
manager do it: on Cloud TPU, Slurm and Open MPI JAX finds the topology by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Sequence

from tpurl.commands.common import ArgumentParser

# After one process fails, how long the others may take to end by themselves (their own error
# lines, and process 0's status, reach the launcher) before they are stopped.
SETTLE_S = 3.0
STOP_GRACE_S = 10.0  # how long a stopped process gets to exit before it is killed


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and `bind(0)` (Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now, outside the ephemeral range.

    A port from `bind(0)` lies in the range the kernel also gives outgoing connections: in the
    seconds before the coordinator binds it, another process's connection (gloo opens many) may
    take it, the coordinator then fails to start, and the other processes wait for it forever."""
    low, high = _ephemeral_range()
    outside = [p for p in range(1024, 65536) if not low <= p <= high]
    # Unprivileged ports above the well-known services' first, where any exist.
    candidates = [p for p in outside if p >= 10000] or outside
    if not candidates:
        raise OSError(f"tpurl launch: every port is in the ephemeral range {low}-{high}; narrow "
                      "/proc/sys/net/ipv4/ip_local_port_range to leave the coordinator a port")
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("tpurl launch: no free TCP port for the coordinator in 64 tries outside the ephemeral range; "
                  "free some ports or narrow /proc/sys/net/ipv4/ip_local_port_range")


def process_env(base: dict[str, str], *, address: str, num_processes: int, process_id: int,
                devices_per_process: int | None) -> dict[str, str]:
    """The environment of process `process_id`: `base` plus the variables that make it join."""
    env = dict(base)
    env.update(TPURL_COORDINATOR_ADDRESS=address, TPURL_NUM_PROCESSES=str(num_processes),
               TPURL_PROCESS_ID=str(process_id))
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _forward(stream: IO[bytes], out: IO[str], log: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copy a process's lines to `out` (prefixed) and its log until the pipe closes. A sink that
    fails (a full disk, a closed terminal, `| head`) is dropped, and the pipe is still drained: a
    process must never block on a full pipe."""
    sinks = [(out, prefix), (log, "")]
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        line = line if line.endswith("\n") else line + "\n"
        with lock:
            for sink in list(sinks):
                try:
                    sink[0].write(sink[1] + line)
                    sink[0].flush()
                except (OSError, ValueError):
                    sinks.remove(sink)
    stream.close()


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the processes still running (their process groups), killing those that are
    still there after `STOP_GRACE_S`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since the check
                os.killpg(p.pid, sig)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it ended since the check
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# Run as `python -c _DIE_WITH_PARENT LAUNCHER_PID PROGRAM ARGS...`: ask the kernel to kill this
# process when the launcher dies (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`, which survives exec), then
# become PROGRAM. A wrapper instead of a `preexec_fn`: that would run Python in a fork of a process
# that may have threads (JAX's, in a test), which can deadlock.
_DIE_WITH_PARENT = """import ctypes, ctypes.util, os, signal, sys
ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _die_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that the process dies with the launcher (see `_DIE_WITH_PARENT`; Linux only)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class _Stopped(Exception):
    """The launcher received a stop signal."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _raise_stopped(sig, frame):
    raise _Stopped(sig)


class _stop_signals:
    """While inside, SIGTERM, SIGINT and SIGHUP raise `_Stopped` in the main thread (elsewhere:
    nothing changes; signals go to the main thread only), but for those the launcher was started
    ignoring (`nohup`: SIGHUP)."""

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is threading.main_thread():  # a signal ignored (nohup) stays ignored
            self.saved = {sig: signal.signal(sig, _raise_stopped) for sig in _STOP_SIGNALS
                          if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        return False


def launch(command: Sequence[str], *, num_processes: int, devices_per_process: int | None = None,
           env: dict[str, str] | None = None, program: Sequence[str] = (sys.executable, "-m", "tpurl")) -> int:
    """Run `program *command` (default: `python -m tpurl COMMAND ...`) as `num_processes` local
    processes of one run (see the module docstring); returns 0 when all succeed, else the status
    of the first that failed (the others are stopped), or 128 + the signal that stopped the launcher."""
    address = f"127.0.0.1:{free_port()}"
    base = dict(os.environ if env is None else env)
    log_dir = tempfile.mkdtemp(prefix="tpurl-launch-")
    logs = [open(os.path.join(log_dir, f"p{i}.log"), "w", encoding="utf-8", errors="replace")
            for i in range(num_processes)]
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        with _stop_signals() as ctx:
            try:
                for i in range(num_processes):
                    procs.append(subprocess.Popen(
                        _die_with_parent([*program, *command]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=process_env(base, address=address, num_processes=num_processes, process_id=i,
                                        devices_per_process=devices_per_process),
                        start_new_session=True))  # its own group: stopping it stops its children too
                threads += _start_forwarding(procs, logs)
                status, said = _wait(procs, log_dir)
            except _Stopped as stop:
                for sig in ctx.saved:  # a second signal must not cut the stopping short
                    signal.signal(sig, signal.SIG_IGN)
                _stop(procs, stop.sig)
                status = 128 + stop.sig
                said = (f"tpurl launch: stopped by {stop}; passed it on to the {len(procs)} processes, which have "
                        f"ended; their logs are in {log_dir}")
            except BaseException:  # a process that could not start (too many open files, ...)
                _stop(procs)
                raise
        for t in threads:
            t.join()
    finally:
        for log in logs:
            log.close()
    if status == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    if said:
        print(said, file=sys.stderr, flush=True)
    return status


def _start_forwarding(procs: list[subprocess.Popen], logs: list[IO[str]]) -> list[threading.Thread]:
    lock = threading.Lock()
    threads = []
    for i, p in enumerate(procs):
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, logs[i], f"[p{i}] ", lock), daemon=True)
            t.start()
            threads.append(t)
    return threads


def _settle(procs: list[subprocess.Popen]) -> dict[int, int]:
    """After a failure, give the others up to `SETTLE_S` to end on their own; their exit codes by
    process index (those still running are absent)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    return {i: p.returncode for i, p in enumerate(procs) if p.returncode is not None}


def _wait(procs: list[subprocess.Popen], log_dir: str) -> tuple[int, str | None]:
    """Wait for all; on a failure stop the rest and return the status of the lowest-numbered
    process that failed on its own (process 0's error is usually the cause: the others then lose
    its coordinator and fail too, sometimes first), with the launcher's line saying so."""
    while True:
        codes = {i: p.poll() for i, p in enumerate(procs)}
        if any(c not in (None, 0) for c in codes.values()):
            codes = _settle(procs)
            _stop(procs)
            first = min(i for i, c in codes.items() if c != 0)
            code = codes[first]
            status = code if code > 0 else 128 - code  # killed by a signal: shell convention
            how = f"exited with status {code}" if code > 0 else f"was killed by {signal.Signals(-code).name}"
            return status, (f"tpurl launch: process {first} {how}; stopped the others; its output is above "
                            f"(prefixed [p{first}]) and in {os.path.join(log_dir, f'p{first}.log')}")
        if all(c == 0 for c in codes.values()):
            return 0, None
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tpurl launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="how many processes to start")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="fake CPU devices per process (sets XLA_FLAGS and JAX_PLATFORMS=cpu)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the tpurl command after '--', e.g. train ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.num_processes < 1:
        parser.error(f"-n {args.num_processes}: give at least 1 process")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process {args.devices_per_process}: give at least 1 device")
    if not command:
        parser.error("no command to run; put it after '--', e.g. tpurl launch -n 2 -- train --gin_file x.gin")
    if command[0] == "launch":
        parser.error("the command to run cannot be 'launch' itself")
    return launch(command, num_processes=args.num_processes, devices_per_process=args.devices_per_process)

