"""Adversarial candidates against the code grader. Each candidate is wrong (or leaves something behind)
and uses one trick; graded in the sandbox it must get no false pass, finish in bounded time and leave
no file or process behind, and this test process must survive it. A control runs the same candidate
the naive way (solution and tests in one unsandboxed process, exit status 0 = pass) and shows that
the trick works there, so each case really exercises the defence."""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable

import pytest

from helpers import kill_marked, leftover_dirs, leftover_processes
from machine import require
from tpurl.sandbox import SandboxConfig, sandbox_mechanisms
from tpurl.sandbox.grading import grade

CFG = SandboxConfig(timeout_s=2.0, memory_mb=256, max_processes=8, output_bytes=4096, file_size_mb=1)
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"
WRONG = "def add(a, b):\n    return a - b\n"
TIME_BOUND_S = 15.0  # the 2 s wall clock, the kill and the cleanup, on a loaded 2-core machine


@dataclasses.dataclass
class Attack:
    solution: str
    tests: str = ADD_TESTS
    # What a run left behind or leaked (checked after the sandboxed run and after the control).
    violations: Callable[[], list[str]] = lambda: []
    control: bool = True  # safe to run unsandboxed (a fork or memory bomb is not)
    # The mechanism the defence relies on, and its values that mean it is missing on a machine;
    # `harmful_without`: do not even run the candidate there.
    needs: tuple[str, tuple[str, ...]] | None = None
    harmful_without: bool = False
    cleanup: Callable[[], None] = lambda: None  # undo what the unsandboxed control left


def _canaries(paths: list[str]) -> Callable[[], list[str]]:
    return lambda: [p for p in paths if os.path.exists(p)]


def _remove(paths: list[str]) -> None:
    for p in paths:
        if os.path.exists(p):
            os.remove(p)


def _serve(token: bytes) -> int:
    """A one-shot TCP server on 127.0.0.1 that sends `token`; returns its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(10)

    def run():
        try:
            while True:
                conn, _ = server.accept()
                conn.sendall(token)
                conn.close()
        except OSError:
            server.close()
    threading.Thread(target=run, daemon=True).start()
    return server.getsockname()[1]


def _attack(name: str, tmp_path, monkeypatch) -> Attack:
    tag = uuid.uuid4().hex
    if name == "infinite_loop":
        return Attack("def add(a, b):\n    while True:\n        pass\n", control=False)
    if name == "fork_bomb":
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        return Attack(bomb + WRONG, control=False, needs=("processes", ("none",)), harmful_without=True)
    if name == "memory_bomb":
        return Attack("hog = []\ntry:\n    while True:\n        hog.append(bytearray(50 << 20))\n"
                      "except MemoryError:\n    pass\n" + WRONG, control=False)
    if name == "output_flood":
        return Attack("import sys\nfor _ in range(100):\n    sys.stdout.write('PASSED ' * 150000)\n" + WRONG,
                      control=False)
    if name == "write_outside":
        shared = tmp_path / "world_writable"
        shared.mkdir()
        shared.chmod(0o777)
        paths = [str(shared / "canary"), f"/tmp/canary-{tag}", f"/var/tmp/canary-{tag}", f"/dev/shm/canary-{tag}"]
        code = f"for p in {paths + [f'../canary-{tag}']!r}:\n    try:\n        open(p, 'w').write('x')\n" \
               "    except OSError:\n        pass\n"
        host = paths + [str(tmp_path / f"canary-{tag}")]  # "../" of the control's directory; the sandbox's is /tmp
        return Attack(code + WRONG, violations=_canaries(host),
                      needs=("filesystem", ("none", "uid permissions")), cleanup=lambda: _remove(host))
    if name == "environment_secret":
        secret = f"hunter2-{tag}"
        monkeypatch.setenv("TPURL_TEST_SECRET", secret)
        code = ("import os\ndef get_secret():\n    found = os.environ.get('TPURL_TEST_SECRET')\n"
                "    for pid in os.listdir('/proc'):\n        try:\n"
                "            env = open('/proc/%s/environ' % pid, 'rb').read().split(b'\\0')\n"
                "        except OSError:\n            continue\n"
                "        found = found or next((e[18:].decode() for e in env if e.startswith(b'TPURL_TEST_SECRET=')),"
                " None)\n    return found\n")
        return Attack(code, tests=f"assert get_secret() == {secret!r}\n")
    if name == "network":
        token = f"token-{tag}"
        port = _serve(token.encode())
        code = ("import socket\ndef fetch():\n    try:\n"
                f"        return socket.create_connection(('127.0.0.1', {port}), timeout=2).recv(100).decode()\n"
                "    except OSError:\n        return None\n")
        return Attack(code, tests=f"assert fetch() == {token!r}\n", needs=("network", ("none",)))
    if name == "exit_before_tests":
        return Attack("import os\nos._exit(0)\n" + WRONG)
    if name == "patch_exit":
        return Attack("import atexit, os, sys\nsys.exit = lambda *a: None\nsys.excepthook = lambda *a: None\n"
                      "atexit.register(lambda: os._exit(0))\n" + WRONG)
    if name == "patch_assert_helpers":
        return Attack("import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0.0\n",
                      tests="import math\nassert math.isclose(area(1), 3.14159, rel_tol=1e-3)\n"
                            "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\n")
    if name == "patch_unittest":
        patch = "".join(f"unittest.TestCase.{m} = lambda *a, **k: None\n" for m in ("assertEqual", "assertTrue"))
        return Attack("import unittest\n" + patch + WRONG,
                      tests="import unittest\nclass TestAdd(unittest.TestCase):\n    def test_add(self):\n"
                            "        self.assertEqual(add(2, 3), 5)\n        self.assertTrue(add(1, 1) == 2)\n"
                            "if __name__ == '__main__':\n    unittest.main()\n")
    if name == "always_equal":
        return Attack("class Liar:\n    def __eq__(self, other):\n        return True\n"
                      "class LyingInt(int):\n    def __eq__(self, other):\n        return True\n"
                      "def add(a, b):\n    return Liar() if a > 0 else LyingInt(a - b)\n")
    if name == "edit_tests":
        tests_file = tmp_path / "shared" / "tests.py"
        tests_file.parent.mkdir()
        tests_file.parent.chmod(0o777)
        tests_file.write_text(ADD_TESTS)
        tests_file.chmod(0o666)
        code = f"for p in ('tests.py', '../tests.py', {str(tests_file)!r}):\n    try:\n" \
               "        open(p, 'w').write('')\n    except OSError:\n        pass\n" + WRONG
        return Attack(code, tests=tests_file.read_text(), needs=("filesystem", ("none", "uid permissions")),
                      violations=lambda: [] if tests_file.read_text() == ADD_TESTS else [f"{tests_file} edited"])
    if name == "fake_results":
        forged = b"".join(f'{{"t": "{t}", "i": {i}, "ok": true}}\n'.encode() for t in ("unit",) for i in range(3))
        forged = b'{"t": "solution", "ok": true}\n' + forged + b'{"t": "check", "i": 0, "c": 0, "v": [true]}\n'
        return Attack("import os\nprint('3 passed, 0 failed\\nAll tests passed')\n"
                      f"for fd in range(3, 64):\n    try:\n        os.write(fd, {forged!r})\n    except OSError:\n"
                      "        pass\nos._exit(0)\n")
    if name == "daemon":
        marker = f"tpurl-daemon-{tag}"
        code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
                "    os._exit(0)\n")
        return Attack(code + WRONG, violations=lambda: leftover_processes(marker, wait_s=0.5),
                      needs=("cleanup", ("process group",)), cleanup=lambda: kill_marked(marker))
    raise KeyError(name)


ATTACKS = ["infinite_loop", "fork_bomb", "memory_bomb", "output_flood", "write_outside", "environment_secret",
           "network", "exit_before_tests", "patch_exit", "patch_assert_helpers", "patch_unittest", "always_equal",
           "edit_tests", "fake_results", "daemon"]


def naive_grade(solution: str, tests: str, workdir) -> bool:
    """The approach the sandbox replaces: solution then tests in one process; exit status 0 = pass."""
    (workdir / "solution.py").write_text(solution)
    (workdir / "tests.py").write_text(tests)
    program = "exec(open('solution.py').read())\nexec(open('tests.py').read())\n"
    try:
        run = subprocess.run([sys.executable, "-c", program], cwd=workdir, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return run.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ATTACKS)
def test_attack_gets_no_false_pass(name, tmp_path, monkeypatch):
    attack = _attack(name, tmp_path, monkeypatch)
    missing = None
    if attack.needs is not None and not require(sandbox_mechanisms(CFG), attack.needs[0], *attack.needs[1],
                                                why=f"the defence {name} relies on"):
        missing = (f"{attack.needs[0]} is {sandbox_mechanisms(CFG)[attack.needs[0]]!r} on this machine: the defence "
                   "this case relies on is missing")
        if attack.harmful_without:
            pytest.skip(missing)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        start = time.monotonic()
        verdict = grade(attack.solution, attack.tests, config=CFG)
        assert time.monotonic() - start < TIME_BOUND_S
        assert leftover_processes() == [] and leftover_dirs() == []
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 100 * 1024  # KiB: output capped
        if missing:
            pytest.skip(missing)
        assert not verdict.passed and verdict.reward == 0.0, verdict
        assert attack.violations() == []
    finally:
        attack.cleanup()


@pytest.mark.parametrize("name", [n for n in ATTACKS if n not in ("infinite_loop", "fork_bomb", "memory_bomb",
                                                                   "output_flood")])
def test_control_naive_grading_is_fooled(name, tmp_path, monkeypatch):
    attack = _attack(name, tmp_path, monkeypatch)
    workdir = tmp_path / "naive"
    workdir.mkdir()
    try:
        passed = naive_grade(attack.solution, attack.tests, workdir)
        violations = attack.violations()
    finally:
        attack.cleanup()
    assert passed or violations, f"the naive grader resisted {name}: the case does not exercise the defence"
