"""`tpurl launch`: run a tpurl command as N cooperating local processes (multi-process on one machine).

    tpurl launch -n 2 --devices-per-process 4 -- train --gin_file configs/test_tiny.gin

Starts N copies of `python -m tpurl COMMAND ...`, each told how to join the run through
`TPURL_COORDINATOR_ADDRESS` (a free localhost port), `TPURL_NUM_PROCESSES` and `TPURL_PROCESS_ID`
(read by `tpurl.sharding.distributed`). `--devices-per-process K` gives each process K fake CPU
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=K`, `JAX_PLATFORMS=cpu`): the way to try
a multi-process run without accelerators. Every output line is forwarded with its process's prefix
(`[p0] ...`). When a process fails, the others are stopped and `tpurl launch` exits with the failed
process's status; it exits 0 when all succeed.

For several machines, start one process per machine with those variables (or JAX's own
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) yourself, or let a cluster
manager do it: on Cloud TPU, Slurm and Open MPI JAX finds the topology by itself.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
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


def _forward(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes still running (their process groups), killing those that linger."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(command: Sequence[str], *, num_processes: int, devices_per_process: int | None = None,
           env: dict[str, str] | None = None, program: Sequence[str] = (sys.executable, "-m", "tpurl")) -> int:
    """Run `program *command` (default: `python -m tpurl COMMAND ...`) as `num_processes` local
    processes of one run (see the module docstring); returns 0 when all succeed, else the status
    of the first that failed (the others are stopped)."""
    address = f"127.0.0.1:{free_port()}"
    base = dict(os.environ if env is None else env)
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(num_processes):
        p = subprocess.Popen([*program, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=process_env(base, address=address, num_processes=num_processes, process_id=i,
                                             devices_per_process=devices_per_process),
                             start_new_session=True)  # its own group: stopping it stops its children too
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[p{i}] ", lock), daemon=True)
            t.start()
            threads.append(t)
    status = _wait(procs)
    for t in threads:
        t.join()
    return status


def _settle(procs: list[subprocess.Popen]) -> dict[int, int]:
    """After a failure, give the others up to `SETTLE_S` to end on their own; their exit codes by
    process index (those still running are absent)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    return {i: p.returncode for i, p in enumerate(procs) if p.returncode is not None}


def _wait(procs: list[subprocess.Popen]) -> int:
    """Wait for all; on a failure stop the rest and return the status of the lowest-numbered
    process that failed on its own (process 0's error is usually the cause: the others then lose
    its coordinator and fail too, sometimes first)."""
    try:
        while True:
            codes = {i: p.poll() for i, p in enumerate(procs)}
            if any(c not in (None, 0) for c in codes.values()):
                codes = _settle(procs)
                _stop(procs)
                code = codes[min(i for i, c in codes.items() if c != 0)]
                return code if code > 0 else 128 - code  # killed by a signal: shell convention
            if all(c == 0 for c in codes.values()):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


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

