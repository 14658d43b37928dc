"""Grading: MBPP-style and pytest-style test files give the right per-test verdicts; the plan keeps
expected values out of the sandbox; forged, missing or malformed result frames never pass; values
cross the channel as plain builtin data only."""

import json

import pytest

from helpers import nothing_left_behind  # noqa: F401 (a fixture)
from tpurl.sandbox import SandboxConfig
from tpurl.sandbox.cases import PlanError, plan_tests
from tpurl.sandbox.grading import decode, grade, judge
from tpurl.sandbox.harness import encode
from tpurl.sandbox.process import Execution

CFG = SandboxConfig(timeout_s=5.0, memory_mb=256, max_processes=8, output_bytes=4096)
GOOD = "def add(a, b):\n    return a + b\n"
MBPP = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(0, 0) == 0\nassert add(1, 1) == 2\n"
PYTEST = '''
import math
import unittest

import pytest
from solution import add


def check_sum(a, b, want):
    assert add(a, b) == want


def test_plain():
    assert add(2, 3) == 5
    check_sum(1, 2, 3)


@pytest.mark.parametrize("a, b, want", [(1, 2, 3), (2, 2, 4), (-3, 3, 0)])
def test_parametrized(a, b, want):
    assert add(a, b) == want


def test_raises():
    with pytest.raises(TypeError):
        add(1, "x")


def test_approx_and_builtins():
    assert add(0.1, 0.2) == pytest.approx(0.3)
    assert math.isclose(add(0.1, 0.2), 0.3)
    assert sorted([add(2, 1), add(0, 1)]) == [1, 3] and True
    assert not add(0, 0)


class TestAdd(unittest.TestCase):
    def setUp(self):
        self.one = 1

    def test_methods(self):
        self.assertEqual(add(self.one, 1), 2)
        self.assertAlmostEqual(add(0.1, 0.2), 0.3)
        self.assertRaises(TypeError, add, 1, "x")
        with self.assertRaisesRegex(TypeError, "unsupported|can only"):
            add(1, "x")
'''


pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def _passed(verdict):
    return [c.passed for c in verdict.cases]


def test_mbpp_style_correct_wrong_and_partial():
    right = grade(GOOD, MBPP, config=CFG)
    assert right.passed and right.reward == 1.0 and right.error is None
    wrong = grade("def add(a, b):\n    return a * b\n", MBPP, config=CFG)
    assert _passed(wrong) == [False, False, True, False] and wrong.reward == 0.25 and not wrong.passed
    assert "got 6" in wrong.cases[0].error
    partial = grade("def add(a, b):\n    return abs(a + b)\n", "assert add(2, 3) == 5\nassert add(-5, 1) == -4\n",
                    config=CFG)
    assert _passed(partial) == [True, False] and partial.reward == 0.5


def test_pytest_style_functions_parametrize_raises_approx_and_unittest():
    right = grade(GOOD, PYTEST, config=CFG)
    assert right.passed, right
    names = [c.name for c in right.cases]
    assert names == ["test_plain", "test_parametrized[0]", "test_parametrized[1]", "test_parametrized[2]",
                     "test_raises", "test_approx_and_builtins", "TestAdd.test_methods"]
    # Off by one for negative sums: fails exactly the tests that add a negative number.
    wrong = grade("def add(a, b):\n    return a + b + (a < 0 or b < 0)\n", PYTEST, config=CFG)
    assert _passed(wrong) == [True, True, True, False, True, True, True]
    # Returns strings instead of raising: the raises tests fail, the others pass.
    lenient = grade("def add(a, b):\n    return a + b if type(a) == type(b) else 'nan'\n", PYTEST, config=CFG)
    assert _passed(lenient) == [True, True, True, True, False, True, False]


def test_humaneval_check_with_entry_point_and_solution_errors():
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(1, 1) == 2\n"
    assert grade("def plus(a, b):\n    return a + b\n", tests, entry_point="plus", config=CFG).passed
    assert not grade("def plus(a, b):\n    return a - b\n", tests, entry_point="plus", config=CFG).passed
    broken = grade("def add(a, b) return a\n", MBPP, config=CFG)
    assert broken.reward == 0 and broken.error.startswith("the solution raised SyntaxError")
    raises = grade("raise RuntimeError('boom')\n", MBPP, config=CFG)
    assert raises.reward == 0 and "RuntimeError: boom" in raises.error


def test_a_test_must_reach_its_unconditional_checks():
    tests = "def test_skips():\n    if add(1, 1) == 2:\n        return\n    assert add(1, 1) == 2\n\n" \
            "def test_loops():\n    for a in range(3):\n        assert add(a, 0) == a\n"
    plan = plan_tests(tests)
    assert [sorted(c.required) for c in plan.cases] == [[0], [1]]  # the check after the `if` is required
    verdict = grade(GOOD, plan, config=CFG)
    assert _passed(verdict) == [False, True] and "never checked" in verdict.cases[0].error


def test_expected_values_never_reach_the_sandbox():
    plan = plan_tests("import pytest\n\nassert add(1, 2) == 987654\nassert sorted(add(3, 4)) == [112233]\n"
                      "assert math.isclose(add(1, 1), 778899.5, rel_tol=1e-3)\n\n"  # MBPP: math imported by the solution
                      "@pytest.mark.parametrize('x, want', [(5, 445566)])\ndef test_p(x, want):\n"
                      "    assert add(x, 1) == want\n")
    job = json.dumps(plan.units)
    assert all(secret not in job for secret in ("987654", "112233", "778899", "445566")), job
    assert "add(5, 1)" in job  # the input is substituted; the expected value stays in the parent


@pytest.mark.parametrize("tests, why", [
    ("assert add(1,\n", "line 1"),
    ("def helper():\n    pass\n", "no tests found"),
    ("import pytest\n\n@pytest.fixture\ndef data():\n    return 1\n\ndef test_x(data):\n    assert data\n",
     "fixture"),
    ("from pytest import fixture\n", "pytest.fixture is not supported"),
])
def test_unusable_test_files_are_plan_errors(tests, why):
    with pytest.raises(PlanError, match=why):
        plan_tests(tests)


def _execution(frames, returncode=0):
    channel = b"".join(json.dumps(f).encode() + b"\n" for f in frames)
    return Execution(returncode=returncode, stdout=b"", stderr=b"", channel=channel, truncated=(), timed_out=False,
                     seconds=0.1)


def test_forged_or_missing_frames_never_pass():
    plan = plan_tests("assert add(2, 3) == 5\n\ndef test_f():\n    assert add(1, 1) == 2\n")
    solution = {"t": "solution", "ok": True}
    units = [{"t": "unit", "i": i, "ok": True} for i in range(len(plan.units))]
    good = [solution, {"t": "check", "i": 0, "c": 0, "v": [encode(5)]}, units[0],
            {"t": "check", "i": 2, "c": 1, "v": [encode(2)]}, *units[1:]]
    assert judge(plan, _execution(good)).passed  # the honest frames
    forgeries = {
        "units only": [solution, *units],
        "truthy values": [solution, {"t": "check", "i": 0, "c": 0, "v": [True]}, *units],
        "a check reported for another test": [solution, {"t": "check", "i": 2, "c": 0, "v": [encode(5)]}, *units],
        "an unknown check": good + [{"t": "check", "i": 0, "c": 99, "v": [encode(5)]}],
        "a failing check next to a good one": good + [{"t": "check", "i": 0, "c": 0, "v": [encode(4)]}],
        "an untagged number": [solution, {"t": "check", "i": 0, "c": 0, "v": [5]}, *units],
        "a unit reported twice": good + [units[0]],
        "no solution frame": good[1:],
        "two solution frames": [solution] + good,
    }
    for name, frames in forgeries.items():
        assert not judge(plan, _execution(frames)).cases[0].passed, name
    cut = judge(plan, _execution(good[:3], returncode=0))  # the process ended after the first test
    assert _passed(cut) == [True, False] and cut.error.startswith("the process ended before the tests finished")


class _Liar:
    def __eq__(self, other):
        return True


class _LyingInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _LyingList(list):
    def __iter__(self):
        return iter([1, 2, 3])


def test_values_cross_as_plain_builtin_data():
    values = [None, True, 0, -7, 2**200, 1.5, float("inf"), 1 + 2j, "s", b"b", bytearray(b"ba"), [1, (2, 3)],
              {1, 2}, frozenset({3}), {"k": [1.0]}, ()]
    for v in values:
        back = decode(json.loads(json.dumps(encode(v))))
        assert back == v and type(back) is type(v)
    with pytest.raises(TypeError, match="_Liar"):
        encode(_Liar())
    assert decode(encode(_LyingInt(3))) == 3 and type(decode(encode(_LyingInt(3)))) is int  # its real value
    assert decode(encode(_LyingList([7]))) == [7]  # read through list's own iterator, not the override
    for bad in ([5], ["int", 5], ["float", "x"], ["set", [["list", []]]], ["dict", [[1]]], {"a": 1}, ["nope", "1"]):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)
