"""Joining JAX's multi-controller runtime (`jax.distributed`): where the settings come from, once.

A multi-process tpurl run is N processes running the same program; after
`jax.distributed.initialize` every process sees every process's devices in `jax.devices()` and
builds the same global meshes (`tpurl.sharding.mesh`). `initialize(cfg)` must run before anything
touches a JAX backend; the `tpurl train` entry point calls it right after parsing gin.

Where the coordinator address, the process count and this process's id come from, first found wins:

1. `DistributedConfig` fields (gin: `tpurl.DistributedConfig.coordinator_address = "10.0.0.1:1234"`
   etc.), all three given;
2. tpurl's launcher variables `TPURL_COORDINATOR_ADDRESS`, `TPURL_NUM_PROCESSES`,
   `TPURL_PROCESS_ID` (`tpurl launch` sets them);
3. the standard `JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`;
4. a managed cluster JAX detects by itself (Cloud TPU with several workers, Slurm, Open MPI):
   `jax.distributed.initialize()` without arguments.

With none of these, or one process, the run is single-process and nothing is initialized.
`mode="off"` never initializes; `mode="on"` fails (one line) when nothing says how to.

Joining has a deadline (`DistributedConfig.join_timeout_s`): a process whose coordinator never
answers, or whose peers never come (variables left in a shell from an earlier run, a process that
failed to start), exits with status 2 and one line naming where its settings came from, instead
of waiting (JAX's own timeout aborts the process with a C++ stack trace).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Mapping, NoReturn

import jax

from tpurl.config_types import check_types

MODES = ("auto", "on", "off")
LAUNCHER_VARS = ("TPURL_COORDINATOR_ADDRESS", "TPURL_NUM_PROCESSES", "TPURL_PROCESS_ID")
JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-process run (see the module docstring for the precedence).

    `coordinator_address`: "HOST:PORT" of process 0's coordinator service; `num_processes`: how
    many processes run; `process_id`: this one's id in [0, num_processes). Give all three or none.
    `join_timeout_s`: how long joining may take (every process connected) before the process
    exits with status 2 and one line.
    """

    mode: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    join_timeout_s: float = 300.0

    def __post_init__(self):
        check_types(self)
        if self.mode not in MODES:
            raise ValueError(f"DistributedConfig.mode={self.mode!r}; use one of {MODES}")
        given = [self.coordinator_address is not None, self.num_processes is not None, self.process_id is not None]
        if any(given) and not all(given):
            raise ValueError("DistributedConfig: give coordinator_address, num_processes and process_id together "
                             f"(got {self.coordinator_address!r}, {self.num_processes!r}, {self.process_id!r})")
        if self.num_processes is not None:
            _check_topology("DistributedConfig", self.coordinator_address, self.num_processes, self.process_id)
        if not 0 < self.join_timeout_s <= 86400:
            raise ValueError(f"DistributedConfig.join_timeout_s={self.join_timeout_s} must be in (0, 86400] seconds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """Resolved arguments of `jax.distributed.initialize` (None: let JAX detect the cluster)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str


def _check_topology(where: str, address: str, num: int, pid: int) -> None:
    if not isinstance(address, str) or address.rpartition(":")[2].isdigit() is False:
        raise ValueError(f"{where}: coordinator address {address!r} must be 'HOST:PORT', e.g. '127.0.0.1:1234'")
    if num < 1:
        raise ValueError(f"{where}: num_processes={num} must be at least 1")
    if not 0 <= pid < num:
        raise ValueError(f"{where}: process_id={pid} must be in [0, {num}) for num_processes={num}")


def _from_vars(env: Mapping[str, str], names: tuple[str, str, str]) -> Topology | None:
    """A topology from three environment variables (None when the address is unset)."""
    address, num, pid = (env.get(n) for n in names)
    if not address:
        return None
    try:
        num_i, pid_i = int(num), int(pid)
    except (TypeError, ValueError):
        raise ValueError(f"{names[0]} is set, so {names[1]} and {names[2]} must be integers; got "
                         f"{names[1]}={num!r}, {names[2]}={pid!r}") from None
    _check_topology(names[0], address, num_i, pid_i)
    return Topology(coordinator_address=address, num_processes=num_i, process_id=pid_i, source=names[0])


def _count(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    return int(value) if value.isdigit() else 1


def _managed_cluster(env: Mapping[str, str]) -> bool:
    """Whether JAX's own cluster detection applies with more than one process: several Cloud TPU
    workers, a Slurm job step (`srun`) or an Open MPI job (`mpirun`) of several tasks."""
    tpu_hosts = env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or ""
    return ("," in tpu_hosts or ("SLURM_PROCID" in env and _count(env, "SLURM_NTASKS") > 1)
            or ("OMPI_MCA_orte_hnp_uri" in env and _count(env, "OMPI_COMM_WORLD_SIZE") > 1))


def resolve(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Topology | None:
    """The arguments this process joins with, or None for a single-process run (no I/O, no JAX)."""
    env = os.environ if env is None else env
    if cfg.mode == "off":
        return None
    found = None
    if cfg.num_processes is not None:
        found = Topology(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                         process_id=cfg.process_id, source="DistributedConfig")
    found = found or _from_vars(env, LAUNCHER_VARS) or _from_vars(env, JAX_VARS)
    if found is None and _managed_cluster(env):
        found = Topology(coordinator_address=None, num_processes=None, process_id=None, source="cluster detection")
    if found is None and cfg.mode == "on":
        raise ValueError("DistributedConfig.mode='on' but nothing says how to join: set coordinator_address, "
                         f"num_processes and process_id, or {', '.join(LAUNCHER_VARS)} (tpurl launch does)")
    if found is not None and found.num_processes == 1:
        return None
    return found


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Topology | None:
    """Join the multi-process run `cfg` and the environment describe (see the module docstring);
    a no-op for a single-process run or when already joined. Call before any JAX computation.
    Returns what it joined with (None: single process)."""
    topology = resolve(cfg, env)
    if topology is None or jax.distributed.is_initialized():
        return topology
    watchdog = threading.Timer(cfg.join_timeout_s, _join_timed_out, args=(topology, cfg.join_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:  # JAX's own deadline comes later: it aborts the process with a C++ stack trace
        jax.distributed.initialize(coordinator_address=topology.coordinator_address,
                                   num_processes=topology.num_processes, process_id=topology.process_id,
                                   initialization_timeout=int(cfg.join_timeout_s) + 60)
    finally:
        watchdog.cancel()
    return topology


def _settings(topology: Topology) -> str:
    if topology.source in (LAUNCHER_VARS[0], JAX_VARS[0]):
        names = LAUNCHER_VARS if topology.source == LAUNCHER_VARS[0] else JAX_VARS
        values = (topology.coordinator_address, topology.num_processes, topology.process_id)
        return "the environment's " + ", ".join(f"{n}={v}" for n, v in zip(names, values))
    if topology.source == "DistributedConfig":
        return (f"DistributedConfig (coordinator_address={topology.coordinator_address}, num_processes="
                f"{topology.num_processes}, process_id={topology.process_id})")
    return "the cluster JAX detected"


def _join_timed_out(topology: Topology, seconds: float) -> None:
    """The join's deadline passed: say so in one line and exit with status 2 (the main thread is
    blocked inside JAX and cannot be interrupted)."""
    print(f"tpurl: could not join a multi-process run within {seconds:g} s, as {_settings(topology)} ask; "
          "if no such run is starting, unset them (stale variables of an earlier run), else start every "
          "process of the run (or raise DistributedConfig.join_timeout_s)", file=sys.stderr, flush=True)
    os._exit(2)


def leave(status: int = 0) -> NoReturn:
    """End this process of a multi-process run: flush its output, wait for the other processes at
    the runtime's shutdown barrier, and exit without Python's interpreter teardown. That teardown
    destroys JAX's CPU client, whose thread pool can wait forever for a worker thread that the
    shut-down runtime left blocked (XLA:CPU with gloo, seen at exit under load: both processes in
    `PjRtCpuClient`'s destructor, joining a thread). Whatever a run must keep is written and closed
    before it returns; nothing is left for teardown to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    os._exit(status)
