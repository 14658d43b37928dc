"""A test file nesting an expression deeper than Python's parser or the planner can follow is a
PlanError (the code task drops that row as ungradable; `tpurl grade-code` prints one line), never a
RecursionError or MemoryError escaping `plan_tests`."""

import pytest

from tpurl.sandbox.cases import PlanError, plan_tests


@pytest.mark.parametrize("source, message", [
    ("assert f(1) == " + "-" * 20_000 + "1", "too deeply for Python's parser"),  # the parser's MemoryError
    ("assert f(1) == 1" + " + 1" * 30_000, "too deeply for Python's parser"),  # its RecursionError
    ("assert f(1) == " + "-" * 900 + "f(1)", "too deeply to grade"),  # parses; the planner's recursion
])
def test_deeply_nested_checks(source, message):
    with pytest.raises(PlanError, match=f"^tests: an expression is nested {message}; write it flatter$"):
        plan_tests(source)


def test_moderate_nesting_still_plans():
    plan = plan_tests("assert f(1) == " + "-" * 50 + "f(1)")
    assert len(plan.cases) == 1 and plan.checks[0].probes == 2  # both calls of f
