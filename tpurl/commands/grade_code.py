"""`tpurl grade-code`: grade one solution file against one test file in the sandbox.

    tpurl grade-code --solution FILE --tests FILE [--json] [--entry-point NAME] [--timeout S]
    tpurl grade-code --mechanisms

The test file holds MBPP-style asserts, pytest-style test functions or unittest classes (see
`tpurl.sandbox.cases`); the tests can import the solution as `solution` or by its file name. Prints
one line per test and a summary, or with `--json` one JSON document
`{"passed": bool, "reward": float, "seconds": float, "error": str | null}` (reward: the fraction of
tests passed; passed: all of them). `--mechanisms` prints the isolation in force on this machine.
Exit status: 0 all tests passed, 1 graded but not all passed, 2 nothing graded (a missing or
unreadable file, an unusable test file, a sandbox that cannot run), with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tpurl.sandbox.cases import PlanError, plan_tests
from tpurl.sandbox.config import SandboxConfig
from tpurl.sandbox.grading import grade
from tpurl.sandbox.process import SandboxError
from tpurl.sandbox.runner import sandbox_mechanisms


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpurl grade-code", description=__doc__.split("\n\n")[0])
    p.add_argument("--solution", help="the candidate's Python file")
    p.add_argument("--tests", help="the test file (asserts, test_* functions or unittest classes)")
    p.add_argument("--entry-point", help="HumanEval style: call the tests' check() with this function")
    p.add_argument("--timeout", type=float, default=SandboxConfig().timeout_s, help="wall-clock seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--mechanisms", action="store_true", help="print the sandbox's isolation on this machine")
    return p


def _fail(message: str) -> int:
    print(f"tpurl grade-code: {message}", file=sys.stderr)
    return 2


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = SandboxConfig(timeout_s=args.timeout)
        if args.mechanisms:
            print(json.dumps(sandbox_mechanisms(config), indent=2))
            return 0
        if not args.solution or not args.tests:
            return _fail("--solution and --tests are required")
        solution, tests = _read(args.solution), _read(args.tests)
        plan = plan_tests(tests, entry_point=args.entry_point)
        stem = os.path.splitext(os.path.basename(args.solution))[0]
        verdict = grade(solution, plan, config=config,
                        modules=("solution",) + ((stem,) if stem.isidentifier() and stem != "solution" else ()))
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    except UnicodeDecodeError as e:
        return _fail(f"not UTF-8 text: {e}")
    except PlanError as e:
        return _fail(f"{args.tests}: {e}")
    except (ValueError, SandboxError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps({"passed": verdict.passed, "reward": verdict.reward, "seconds": round(verdict.seconds, 3),
                          "error": verdict.error}))
    else:
        for case in verdict.cases:
            print(f"{'PASS' if case.passed else 'FAIL'} {case.name}" + (f": {case.error}" if case.error else ""))
        passed = sum(c.passed for c in verdict.cases)
        print(f"{passed}/{len(verdict.cases)} passed, reward {verdict.reward:.3f}, {verdict.seconds:.2f} s"
              + (f"; {verdict.error}" if verdict.error else ""))
    return 0 if verdict.passed else 1
