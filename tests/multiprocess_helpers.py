"""Starting N local JAX processes for a test, as `tpurl launch` does: fake CPU devices, gloo
collectives, and the `TPURL_*` variables that `tpurl.sharding.distributed.initialize` joins with."""

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

from tpurl.commands.launch import free_port, process_env
from xla_flags import cpu_xla_flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def cpu_env(devices: int) -> dict[str, str]:
    """This environment without any multi-process settings, with `devices` fake CPU devices and
    the repository on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPURL_", "JAX_COORDINATOR"))}
    # PYTHONFAULTHANDLER: a process that hangs prints its stacks when the runner aborts it.
    env.update(XLA_FLAGS=cpu_xla_flags(devices), JAX_PLATFORMS="cpu",
               PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


def run_workers(args: list[str], *, num_processes: int, devices_per_process: int, timeout: float = 300,
                grace: float = 15) -> list[str]:
    """Run `python ARGS` as `num_processes` joined processes; assert that each exits 0 and return
    their stdouts (process 0 first). When one fails, the others get `grace` seconds to end (they
    usually wait for it in a collective); then, as at the timeout, every process still running is
    aborted and the assertion shows where each was."""
    address = f"127.0.0.1:{free_port()}"
    # Output goes to files, not pipes: a process blocked on a full pipe that nobody reads yet would
    # stall the others in a collective.
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(num_processes)]
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=err, text=True,
                              env=process_env(cpu_env(devices_per_process), address=address,
                                              num_processes=num_processes, process_id=i,
                                              devices_per_process=devices_per_process))
             for i, (out, err) in enumerate(files)]
    for p in procs:
        _no_core_dump(p)
    try:
        if not _wait_all(procs, timeout, grace):
            raise AssertionError(f"the processes did not all finish (within {timeout} s, or {grace} s after one "
                                 "failed); where each was:\n" + _where_stuck(procs, files))
        outs = []
        for i, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0), err.seek(0)
            assert p.returncode == 0, f"process {i} failed:\n{err.read()[-3000:]}"
            outs.append(out.read())
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in files:
            out.close(), err.close()


def _no_core_dump(proc: subprocess.Popen) -> None:
    """The SIGABRT that shows a stuck process's stacks must not write a core file (set from here:
    code run in the child before exec, `preexec_fn`, may deadlock a multithreaded parent's fork)."""
    try:
        resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))
    except (AttributeError, OSError):  # no prlimit (not Linux), or the process already ended
        pass


def _wait_all(procs, timeout: float, grace: float) -> bool:
    """Wait until every process has exited (True), the timeout passes, or `grace` seconds after one
    failed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return True
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.1)
    return False


def _where_stuck(procs, files) -> str:
    """Every process's Python stacks (faulthandler, on SIGABRT) and the tail of its stderr."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
    report = []
    for i, (p, (_, err)) in enumerate(zip(procs, files)):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        err.seek(0)
        report.append(f"--- process {i} (exit {p.poll()}):\n{err.read()[-4000:]}")
    return "\n".join(report)


def last_json(out: str):
    """The last JSON object line a worker printed (gloo prints its own lines to stdout too)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
