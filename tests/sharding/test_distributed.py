"""Where a process learns how to join a multi-process run (`DistributedConfig`, the launcher's and
JAX's environment variables, a managed cluster), and `tpurl launch`'s environment, output and
failure handling. No JAX runtime is started here (see tests/rl/test_multiprocess_run.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tpurl.commands.launch import launch, process_env
from tpurl.sharding.distributed import DistributedConfig, Topology, resolve

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCHER = {"TPURL_COORDINATOR_ADDRESS": "127.0.0.1:1234", "TPURL_NUM_PROCESSES": "2", "TPURL_PROCESS_ID": "1"}
JAX_ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}


def test_single_process_without_settings():
    assert resolve(DistributedConfig(), {}) is None
    for one in ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, {"TPU_WORKER_HOSTNAMES": "localhost"},
                {"SLURM_NTASKS": "4"}, {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}):
        assert resolve(DistributedConfig(), one) is None, one  # one process (or not started by srun)


def test_precedence_config_then_launcher_then_jax_then_cluster():
    cfg = DistributedConfig(coordinator_address="h:1", num_processes=3, process_id=2)
    assert resolve(cfg, {**LAUNCHER, **JAX_ENV}) == Topology(coordinator_address="h:1", num_processes=3,
                                                              process_id=2, source="DistributedConfig")
    assert resolve(DistributedConfig(), {**LAUNCHER, **JAX_ENV}) == Topology(
        coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1, source="TPURL_COORDINATOR_ADDRESS")
    assert resolve(DistributedConfig(), JAX_ENV) == Topology(coordinator_address="10.0.0.1:99", num_processes=4,
                                                             process_id=3, source="JAX_COORDINATOR_ADDRESS")
    for cluster in ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, {"SLURM_NTASKS": "8", "SLURM_PROCID": "3"},
                    {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}):
        found = resolve(DistributedConfig(), cluster)
        assert found == Topology(coordinator_address=None, num_processes=None, process_id=None,
                                 source="cluster detection"), cluster


def test_off_and_one_process_never_initialize():
    assert resolve(DistributedConfig(mode="off"), LAUNCHER) is None
    assert resolve(DistributedConfig(coordinator_address="h:1", num_processes=1, process_id=0), {}) is None


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(mode="maybe"), {}, "DistributedConfig.mode='maybe'"),
    (dict(num_processes=2), {}, "give coordinator_address, num_processes and process_id together"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), {}, "must be 'HOST:PORT'"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, "process_id=2 must be in [0, 2)"),
    (dict(mode="on"), {}, "nothing says how to join"),
    (dict(), {**LAUNCHER, "TPURL_PROCESS_ID": "one"}, "TPURL_PROCESS_ID must be integers"),
    (dict(), {**LAUNCHER, "TPURL_PROCESS_ID": "2"}, "TPURL_COORDINATOR_ADDRESS: process_id=2 must be in [0, 2)"),
])
def test_bad_settings_are_one_line_errors(kwargs, env, message):
    with pytest.raises(ValueError) as e:
        resolve(DistributedConfig(**kwargs), env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_process_env_sets_the_join_variables_and_device_count():
    env = process_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8", "KEEP": "x"},
                      address="127.0.0.1:5", num_processes=2, process_id=1, devices_per_process=4)
    assert env["KEEP"] == "x" and env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert resolve(DistributedConfig(), env) == Topology(coordinator_address="127.0.0.1:5", num_processes=2,
                                                         process_id=1, source="TPURL_COORDINATOR_ADDRESS")
    assert "JAX_PLATFORMS" not in process_env({}, address="a:1", num_processes=2, process_id=0,
                                              devices_per_process=None)


# Process 1 fails at once; process 0 would run for 10 minutes (and then leave a file) unless stopped.
WORKER = textwrap.dedent("""
    import os, sys, time
    pid = int(os.environ["TPURL_PROCESS_ID"])
    print(f"hello from {pid} of {os.environ['TPURL_NUM_PROCESSES']}", flush=True)
    if pid == 1:
        sys.exit(3)
    time.sleep(600)
    open(sys.argv[1], "w").close()
""")


@pytest.mark.slow
def test_a_failing_process_stops_the_others(tmp_path, capfd):
    script, survivor = tmp_path / "worker.py", tmp_path / "survived"
    script.write_text(WORKER)
    status = launch([str(survivor)], num_processes=2, program=(sys.executable, str(script)))
    out, err = capfd.readouterr()
    assert status == 3
    assert not survivor.exists()
    assert sorted(out.splitlines()) == ["[p0] hello from 0 of 2", "[p1] hello from 1 of 2"]
    line = err.strip().splitlines()[-1]  # the launcher's own line, after the processes' output
    assert line.startswith("tpurl launch: process 1 exited with status 3; stopped the others; its output is above "
                           "(prefixed [p1]) and in "), err
    assert open(line.rpartition(" and in ")[2]).read() == "hello from 1 of 2\n"


# Each process writes its pid, then: "sleep" sleeps; "die" kills itself with SIGKILL once both are up.
SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    me = int(os.environ["TPURL_PROCESS_ID"])
    open(os.path.join(sys.argv[1], f"{me}.pid"), "w").write(str(os.getpid()))
    print(f"up {me}", flush=True)
    while sys.argv[2] == "die" and me == 1 and not os.path.exists(os.path.join(sys.argv[1], "0.pid")):
        time.sleep(0.05)
    if sys.argv[2] == "die" and me == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _launcher(tmp_path, mode):
    """`launch` in its own process (as `tpurl launch` runs) over two SLEEPER processes; returns it
    and the processes' pids once both are up."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    code = (f"import sys; from tpurl.commands.launch import launch; sys.exit(launch([{str(tmp_path)!r}, {mode!r}], "
            f"num_processes=2, program=(sys.executable, {str(script)!r})))")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": ROOT})
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{i}.pid").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the pid is written before the file is closed
    return launcher, [int((tmp_path / f"{i}.pid").read_text()) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_launcher_ends_every_process(tmp_path, sig):
    """SIGTERM (timeout, systemd, Slurm, Kubernetes) is passed on and the launcher exits 143 with a
    line; SIGKILL gives it no chance, and the kernel ends the processes with it."""
    launcher, pids = _launcher(tmp_path, "sleep")
    assert all(_alive(pid) for pid in pids)
    start = time.monotonic()
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=60)
    while any(_alive(pid) for pid in pids) and time.monotonic() - start < 30:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "a process outlived its launcher"
    if sig == signal.SIGTERM:
        assert launcher.returncode == 143 and time.monotonic() - start < 15, err
        assert err.strip().splitlines()[-1].startswith(
            "tpurl launch: stopped by SIGTERM; passed it on to the 2 processes, which have ended"), err


@pytest.mark.slow
def test_a_killed_process_is_the_launchers_one_line_and_status(tmp_path):
    launcher, pids = _launcher(tmp_path, "die")
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 137, err
    assert err.strip().splitlines() == [err.strip().splitlines()[-1]]  # nothing but the launcher's line
    assert err.startswith("tpurl launch: process 1 was killed by SIGKILL; stopped the others; its output is above "
                          "(prefixed [p1]) and in "), err
    assert sorted(out.splitlines()) == ["[p0] up 0", "[p1] up 1"] and not _alive(pids[0])


def test_all_succeed_is_status_zero(tmp_path, capfd):
    status = launch(["-c", "import os; print(os.environ['TPURL_PROCESS_ID'])"], num_processes=3,
                    program=(sys.executable,))
    assert status == 0 and sorted(capfd.readouterr().out.splitlines()) == ["[p0] 0", "[p1] 1", "[p2] 2"]


def test_launch_command_line_errors():
    for argv, message in ((["-n", "0", "--", "train"], "-n 0"), (["-n", "2"], "no command to run"),
                          (["-n", "2", "--", "launch"], "cannot be 'launch'")):
        done = subprocess.run([sys.executable, "-m", "tpurl", "launch", *argv], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("params, message", [
    (["tpurl.RLConfig.steps=2.5"], "RLConfig.steps=2.5 must be an int, not a float"),
    (["tpurl.PlacementConfig.mode='disaggregated'", "tpurl.PlacementConfig.train_devices=1",
      "tpurl.PlacementConfig.device_split='in_order'"],
     "PlacementConfig.device_split='in_order': a multi-process run needs both pools on every process"),
    (["tpurl.PlacementConfig.mode='disaggregated'", "tpurl.PlacementConfig.train_devices=1"],
     "a multi-process disaggregated run needs equal pools"),
    (["tpurl.RLConfig.engine=@tpurl.EngineConfig()", "tpurl.EngineConfig.kv_memory_fraction=0.5"],
     "EngineConfig.kv_memory_fraction cannot size the KV pool of a multi-process run"),
])
def test_a_config_error_stops_a_multiprocess_run_with_one_line_per_process(params, message):
    """Both processes join the run, then reject the config: process 0 says so in one line and the
    launch fails with the CLI's status, without waiting at the runtime's shutdown barrier.
    Process 1 says the same, or dies with process 0's coordinator if that left first."""
    gin = os.path.join(ROOT, "configs", "test_tiny.gin")
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "tpurl", "launch", "-n", "2", "--devices-per-process", "1", "--",
                           "train", "--gin_file", gin, *[a for p in params for a in ("--gin_param", p)]],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = sorted(line for line in done.stderr.splitlines() if "tpurl train" in line)
    assert errors and errors[0].startswith("[p0] tpurl train: config error: "), done.stderr[-3000:]
    for line in errors:  # the same line from each process that got that far
        assert line[len("[pN] "):].startswith("tpurl train: config error: ") and message in line, line


def test_coordinator_port_is_outside_the_ephemeral_range():
    from tpurl.commands.launch import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < 65536 and not low <= p <= high for p in ports), (low, high, ports)


def test_the_test_runner_stops_soon_after_a_process_fails_and_shows_where_the_others_were(tmp_path):
    """One process exits 1 at once while the other would sleep for a minute (as if waiting for it in
    a collective): the runner gives up after its grace period, not at the timeout, and its error
    holds the sleeping process's Python stack."""
    import time

    from multiprocess_helpers import run_workers

    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['TPURL_PROCESS_ID'] == '0':\n    sys.exit(1)\n"
                      "def waiting_for_the_other():\n    time.sleep(60)\n"
                      "waiting_for_the_other()\n")
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_workers([str(script)], num_processes=2, devices_per_process=1, timeout=60, grace=1)
    assert time.monotonic() - start < 30
    assert "waiting_for_the_other" in str(e.value) and "process 0 (exit 1)" in str(e.value)


@pytest.mark.slow
def test_leave_flushes_and_exits_with_the_status_without_teardown(tmp_path):
    """`leave` ends a process at once with its status after flushing its output; the interpreter's
    teardown (atexit handlers, JAX's client destructors, which can hang after a multi-process run)
    does not run."""
    script = tmp_path / "leave.py"
    script.write_text("import atexit, sys\n"
                      "from tpurl.sharding.distributed import leave\n"
                      "atexit.register(lambda: print('teardown ran'))\n"
                      "print('done', end='')\n"
                      "leave(3)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 3 and out.stdout == "done", (out.returncode, out.stdout, out.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("process_id", ["0", "1"])
def test_stale_launcher_variables_are_one_line_past_the_join_deadline(process_id):
    """Variables left in a shell from an earlier run: process 1 finds no coordinator, process 0 no
    peer. Either waited forever before (JAX's own timeout aborts with a C++ stack trace)."""
    from tpurl.commands.launch import free_port

    stale = {"TPURL_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "TPURL_NUM_PROCESSES": "2",
             "TPURL_PROCESS_ID": process_id}
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **stale}
    done = subprocess.run([sys.executable, "-m", "tpurl", "train", "--gin_file",
                           os.path.join(ROOT, "configs", "test_tiny.gin"),
                           "--gin_param", "tpurl.DistributedConfig.join_timeout_s=2"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("tpurl: could not join a multi-process run within 2 s, as the environment's "
                           f"TPURL_COORDINATOR_ADDRESS={stale['TPURL_COORDINATOR_ADDRESS']}, TPURL_NUM_PROCESSES=2, "
                           f"TPURL_PROCESS_ID={process_id} ask; if no such run is starting, unset them"), done.stderr
    assert "Traceback" not in done.stderr and "@ " not in done.stderr, done.stderr[-3000:]
