"""`tpurl grade-code`: the JSON document, the text report, exit codes, one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from helpers import leftover_dirs, leftover_processes
from tpurl.commands import main as tpurl_cli
from tpurl.commands import grade_code as cli


@pytest.fixture
def files(tmp_path):
    (tmp_path / "my_add.py").write_text("def add(a, b):\n    return a + b if a >= 0 else 0\n")
    (tmp_path / "tests.py").write_text("from my_add import add\n\nassert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
                                       "assert add(-2, 1) == -1\nassert add(0, 0) == 0\n")
    (tmp_path / "all_pass.py").write_text("assert add(1, 2) == 3\n")
    (tmp_path / "broken.py").write_text("assert add(1,\n")
    yield tmp_path
    assert leftover_processes() == [] and leftover_dirs() == []


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_document_and_exit_codes(files, capsys):
    rc, out, err = run(capsys, "--solution", files / "my_add.py", "--tests", files / "tests.py", "--json")
    doc = json.loads(out)
    assert rc == 1 and err == "" and set(doc) == {"passed", "reward", "seconds", "error"}
    assert doc["passed"] is False and doc["reward"] == 0.75 and doc["error"] is None and doc["seconds"] > 0
    rc, out, _ = run(capsys, "--solution", files / "my_add.py", "--tests", files / "all_pass.py", "--json")
    assert rc == 0 and json.loads(out)["passed"] is True and json.loads(out)["reward"] == 1.0
    rc, out, _ = run(capsys, "--solution", files / "my_add.py", "--tests", files / "tests.py")
    assert rc == 1 and out.splitlines()[2] == "FAIL line 5: add(-2, 1) == -1: got 0"
    assert out.splitlines()[-1].startswith("3/4 passed, reward 0.750")


def test_a_solution_that_does_not_run_is_graded_not_rejected(files, capsys):
    (files / "syntax.py").write_text("def add(a, b) return a\n")
    rc, out, _ = run(capsys, "--solution", files / "syntax.py", "--tests", files / "all_pass.py", "--json")
    assert rc == 1 and json.loads(out)["reward"] == 0.0 and "SyntaxError" in json.loads(out)["error"]


@pytest.mark.parametrize("argv, message", [
    (["--solution", "{d}/missing.py", "--tests", "{d}/tests.py"], "missing.py: No such file or directory"),
    (["--solution", "{d}/my_add.py", "--tests", "{d}/broken.py"], "broken.py: tests: line 1: '(' was never closed"),
    (["--solution", "{d}/my_add.py"], "--solution and --tests are required"),
    (["--solution", "{d}/my_add.py", "--tests", "{d}/tests.py", "--timeout", "0"], "SandboxConfig.timeout_s=0.0"),
])
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv, message):
    rc, out, err = run(capsys, *[a.format(d=files) for a in argv])
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err


def test_registered_in_the_tpurl_command_and_no_traceback(files):
    assert "grade-code" in tpurl_cli.COMMANDS
    proc = subprocess.run([sys.executable, "-m", "tpurl", "grade-code", "--solution", str(files / "nope.py"),
                           "--tests", str(files / "tests.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
