"""The process sandbox: fresh directory, empty environment, limits, capped output, timeouts that kill
the whole tree, no network, no writes outside, a bounded pool, and graceful fallbacks. Assertions
that need a mechanism this machine lacks are skipped with the reason, and only then: where the
machine has it (`machine.supports`, probed without the sandbox's detection) it must be in force."""

import json
import os
import socket
import tempfile
import threading
import time
import uuid

import pytest

from helpers import leftover_processes, nothing_left_behind  # noqa: F401 (a fixture)
from machine import require, supports
from tpurl.sandbox import SandboxConfig, SandboxPool, run_python, runner, sandbox_mechanisms

CFG = SandboxConfig(timeout_s=5.0, memory_mb=256, file_size_mb=1, max_processes=8, output_bytes=4096)


pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def _need(key: str, *absent: str, why: str):
    if not require(sandbox_mechanisms(CFG), key, *absent, why=why):
        pytest.skip(f"no {why} on this machine: {sandbox_mechanisms(CFG)}")


def test_every_mechanism_this_machine_supports_is_in_force():
    mech, can = sandbox_mechanisms(CFG), supports()
    expected = {"network": "netns", "pid": "pidns", "filesystem": "read-only, private /tmp"}
    for key, value in expected.items():
        assert not can[key] or mech[key] == value, (key, mech)
    assert not can["uid"] or mech["uid"] == f"{CFG.uid_base}+", mech
    assert not can["processes"] or mech["processes"] != "none", mech


def test_a_downgrade_fails_instead_of_skipping(monkeypatch):
    """The network namespace lost (here: unshare not found) on a machine that has it is a failure."""
    if not supports()["network"]:
        pytest.skip("this machine has no network namespaces to lose")
    monkeypatch.setattr(runner, "UNSHARE", "no-such-unshare")
    with pytest.raises(AssertionError, match="silent downgrade"):
        require(sandbox_mechanisms(CFG), "network", "none", why="network isolation")


def test_limits_are_in_force_inside_the_sandbox():
    """Read back by the sandboxed program itself: each limit it runs under, its uid, and its view
    of the network and of its pid namespace."""
    code = ("import json, os, resource\nnames = ['CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE', 'NPROC']\n"
            "print(json.dumps({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names}))")
    limits = json.loads(run_python(code, config=CFG).stdout)
    assert limits["CPU"] == [CFG.cpu_limit] * 2 and limits["AS"] == [CFG.memory_mb << 20] * 2
    assert limits["FSIZE"] == [CFG.file_size_mb << 20] * 2 and limits["CORE"] == [0, 0]
    assert limits["NOFILE"] == [256, 256]
    if sandbox_mechanisms(CFG)["processes"] == "rlimit_nproc":
        assert limits["NPROC"] == [CFG.max_processes] * 2


def test_config_errors_name_the_field():
    for bad, field in ((dict(timeout_s=0), "timeout_s"), (dict(memory_mb=8), "memory_mb"),
                       (dict(max_processes=0), "max_processes"), (dict(workers=0), "workers"),
                       (dict(python="python3"), "python"), (dict(uid_base=0), "uid_base")):
        with pytest.raises(ValueError, match=f"SandboxConfig.{field}="):
            SandboxConfig(**bad)
    assert SandboxConfig(timeout_s=2.5).cpu_limit == 4 and SandboxConfig(cpu_seconds=7).cpu_limit == 7


def test_mechanisms_report_what_a_run_sees():
    mech = sandbox_mechanisms(CFG)
    assert set(mech) >= {"network", "pid", "uid", "processes", "filesystem", "cleanup", "python", "limits"}
    ex = run_python("import errno, json, os, socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', 9))\n"
                    "    net = 'open'\nexcept OSError as e:\n    net = errno.errorcode[e.errno]\n"
                    "print(json.dumps([os.getpid(), os.getuid(), net]))", config=CFG)
    pid, uid, net = json.loads(ex.stdout)
    assert (pid == 1) == (mech["pid"] == "pidns")
    assert (net == "ENETUNREACH") == (mech["network"] == "netns")
    assert (CFG.uid_base is not None and uid >= CFG.uid_base) == mech["uid"].endswith("+")


def test_fresh_directory_and_empty_environment(monkeypatch):
    monkeypatch.setenv("TPURL_TEST_SECRET", "hunter2")
    code = "import json, os\nopen('mine.txt', 'w').write('x')\nprint(json.dumps([os.getcwd(), dict(os.environ)]))"
    first, second = (json.loads(run_python(code, config=CFG).stdout) for _ in range(2))
    assert first[0] != second[0] and not os.path.exists(first[0])  # a new directory each time, removed after
    assert set(first[1]) <= {"PATH", "LC_CTYPE"}, first[1]  # LC_CTYPE: Python's own UTF-8 locale coercion
    assert "hunter2" not in json.dumps(first)


def test_output_is_capped_and_never_blocks_the_writer():
    code = "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(block)\n" \
           "sys.stdout.flush()\nsys.stderr.write('e' * 10000)\nprint('done', file=sys.stderr)"
    start = time.monotonic()
    ex = run_python(code, config=CFG)
    assert ex.returncode == 0 and not ex.timed_out  # the 100 MB writer finished: nothing blocked it
    assert len(ex.stdout) == len(ex.stderr) == CFG.output_bytes and set(ex.truncated) == {"stdout", "stderr"}
    assert time.monotonic() - start < 15


def test_timeout_kills_the_whole_process_tree():
    code = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        while True:\n            pass\n" \
           "time.sleep(60)"
    ex = run_python(code, config=CFG.replace(timeout_s=1.5))
    assert ex.timed_out and ex.seconds < 1.5 + 5  # the wall clock, plus the kill and cleanup on a loaded machine


def test_a_daemon_does_not_outlive_its_sandbox():
    _need("cleanup", "process group", why="pid namespace, cgroup or uid to find a daemon by")
    marker = f"tpurl-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\nprint('parent exits')")
    ex = run_python(code, config=CFG)
    assert ex.stdout == b"parent exits\n"
    assert leftover_processes(marker) == []


def test_resource_limits():
    mem = run_python("x = bytearray(512 << 20)", config=CFG)
    assert b"MemoryError" in mem.stderr
    big = run_python("open('big', 'wb').write(b'x' * (2 << 20))", config=CFG)
    assert big.returncode != 0 and (b"File too large" in big.stderr or big.returncode < 0)
    start = time.monotonic()
    cpu = run_python("while True:\n    pass", config=CFG.replace(timeout_s=30, cpu_seconds=1))
    assert not cpu.timed_out and time.monotonic() - start < 15  # RLIMIT_CPU ended it, not the wall clock
    _need("processes", "none", why="process-count limit")
    forks = run_python("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
                       "            time.sleep(5)\n            os._exit(0)\n    except OSError:\n        break\n"
                       "    n += 1\nprint(n)", config=CFG)
    assert int(forks.stdout) < CFG.max_processes


def test_network_is_blocked():
    _need("network", "none", why="network isolation")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        ex = run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                        "    print('connected')\nexcept OSError as e:\n    print('blocked', e)", config=CFG)
    finally:
        server.close()
    assert ex.stdout.startswith(b"blocked"), ex.stdout


def test_writes_outside_the_working_directory_do_not_persist(tmp_path):
    _need("filesystem", "none", "uid permissions", why="read-only filesystem with a private /tmp")
    open_dir = tmp_path / "world_writable"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    tag = uuid.uuid4().hex
    targets = [str(open_dir / "canary"), f"/tmp/canary-{tag}", f"/var/tmp/canary-{tag}", f"../canary-{tag}",
               f"/dev/shm/canary-{tag}"]
    code = f"import os\nfor p in {targets!r} + ['inside']:\n    try:\n        open(p, 'w').write('x')\n" \
           "        print('wrote', p)\n    except OSError as e:\n        print('denied', p, e.strerror)"
    # "../" of the working directory is the temporary directory it was made in
    host = targets[:3] + [os.path.join(tempfile.gettempdir(), f"canary-{tag}"), f"/dev/shm/canary-{tag}"]
    try:
        ex = run_python(code, config=CFG)
        assert b"wrote inside" in ex.stdout
        assert [p for p in host if os.path.exists(p)] == []
    finally:
        for p in host:
            if os.path.exists(p):
                os.remove(p)


def test_pool_runs_at_most_workers_at_once():
    active, peak, lock = [0], [0], threading.Lock()

    def one(_):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return run_python("import time\ntime.sleep(0.3)\nprint('ok')", config=CFG).stdout
        finally:
            with lock:
                active[0] -= 1

    with SandboxPool(CFG.replace(workers=2)) as pool:
        out = list(pool.map(one, range(6)))
    assert out == [b"ok\n"] * 6 and peak[0] == 2


def test_without_unshare_it_falls_back_and_says_so(monkeypatch):
    monkeypatch.setattr(runner, "UNSHARE", "no-such-unshare")
    mech = sandbox_mechanisms(CFG)
    assert mech["network"] == "none" and mech["pid"] == "none" and mech["wrapper"] is None
    ex = run_python("print(6 * 7)", config=CFG)
    assert ex.stdout == b"42\n"
    if mech["cleanup"] == "process group":
        pytest.skip(f"no uid drop or cgroup to find daemons without a pid namespace: {mech}")
    marker = f"tpurl-daemon-{uuid.uuid4().hex}"
    run_python("import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])",
               config=CFG)
    assert leftover_processes(marker) == []


def test_root_without_a_uid_drop_loses_its_capabilities_and_keeps_a_process_limit():
    cfg = CFG.replace(uid_base=None)
    mech = sandbox_mechanisms(cfg)
    if "root" not in mech["uid"]:
        pytest.skip(f"sandboxed code does not run as root on this machine: uid {mech['uid']}")
    assert mech["uid"] == "none (root without capabilities)", mech
    ex = run_python("import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (-1, -1))\n    print('raised')\n"
                    "except (ValueError, OSError):\n    print('refused')", config=cfg)
    assert ex.stdout == b"refused\n"  # the hard limits hold
    if mech["processes"] == "none":
        pytest.skip(f"no process-count limit for root on this machine: {mech}")
    forks = run_python("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
                       "            time.sleep(5)\n            os._exit(0)\n    except OSError:\n        break\n"
                       "    n += 1\nprint(n)", config=cfg)
    assert int(forks.stdout) < cfg.max_processes


def test_shared_uid_process_limit_counts_threads():
    # Without a uid of its own, RLIMIT_NPROC is set over the caller's uid, and the kernel counts
    # that uid's threads, not its processes: a threaded parent (JAX holds dozens) must be counted
    # as such, or the sandboxed code could not start a single process.
    import threading

    from tpurl.sandbox.process import _threads_by_pid, _threads_of_uid

    stop = threading.Event()
    extra = [threading.Thread(target=stop.wait) for _ in range(5)]
    # This process's own count: the uid's other processes (another test worker) come and go meanwhile.
    before = _threads_by_pid(os.getuid())[os.getpid()]
    for t in extra:
        t.start()
    try:
        counts = _threads_by_pid(os.getuid())
        assert counts[os.getpid()] >= before + 5  # the new threads, though no process was added
        assert _threads_of_uid(os.getuid()) >= counts[os.getpid()]
    finally:
        stop.set()
        for t in extra:
            t.join()
