"""Grading a solution against a test file: a verdict the candidate cannot forge.

Threat model. The candidate's code is hostile and runs with the tests in one sandboxed process
(that is what "run the tests against the solution" means): it may exit 0 before the tests run,
patch `sys.exit`, builtins, `math.isclose`, `unittest` or any harness function, return an object
whose `__eq__` always says True, print fake results, try to edit the test file, write anywhere,
leave a daemon behind, or take over the harness entirely and write whatever it likes to the result
channel. None of these may turn into a pass.

Design. The trusted parent never runs candidate-controlled code and never sends the expected
side of an assertion to the sandbox:

1. The parent parses the test file with `ast` (`plan.py`) and splits every assertion into probes
   (candidate-dependent subexpressions, e.g. `f(2)`) and a skeleton (literals, comparisons and a
   few pure functions, e.g. `_p0 == 4`). Only the probes reach the sandbox; the test file itself
   never does, so editing it is pointless.
2. In the sandbox the harness runs the solution, then the rewritten tests, and reports each
   probe's value as tagged JSON over a pipe; only builtin data types can be reported (read through
   their builtin base methods), so a rigged `__eq__` never runs in the comparison.
3. The parent decodes the values into fresh builtin objects and evaluates the skeletons itself. A
   test passes only if its unit reported running to its end, every check it reported held and
   every check it must reach was reported; a missing or malformed frame is a failure, so exiting,
   crashing or timing out early fails every test not yet reported.

Whatever the candidate writes to the channel, it can only make the parent compare *values it
chose* with expectations it never saw: a pass requires producing the right values, i.e. solving
the problem. The residual risk is expectations the test file computes in code instead of writing
as literals (`expected = f_ref(x)`; `assert f(x) == expected`): those are probes too, computed in the
candidate's process, and a candidate that takes over the interpreter could report equal values.
The sandbox does not hide the host's readable files: keep datasets with expected outputs
unreadable to the sandbox uid.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import json
import math
import pathlib
import re

from tpurl.sandbox.cases import TRUSTED_BUILTINS, TRUSTED_MATH, Case, Check, Plan, plan_tests
from tpurl.sandbox.config import SandboxConfig
from tpurl.sandbox.confine import CONFINE_FAILED
from tpurl.sandbox.process import Execution, SandboxError
from tpurl.sandbox.runner import run_python

HARNESS_SOURCE = pathlib.Path(__file__).with_name("harness.py").read_text()
_MAX_DEPTH = 100


@dataclasses.dataclass(frozen=True)
class CaseResult:
    name: str
    passed: bool
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Per-test results; `error` says what went wrong for the run as a whole (the solution raised,
    the time ran out, the process died), None when every test ran."""

    cases: tuple[CaseResult, ...]
    seconds: float
    error: str | None
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def reward(self) -> float:
        """The fraction of tests passed."""
        return sum(c.passed for c in self.cases) / len(self.cases) if self.cases else 0.0


def grade(solution: str, tests: str | Plan, *, config: SandboxConfig, entry_point: str | None = None,
          modules: tuple[str, ...] = ("solution",)) -> Verdict:
    """Run `solution` against `tests` (a test file's source or its `Plan`) in the sandbox. The
    solution is importable under each name in `modules`. Raises PlanError for an unusable test file
    and SandboxError when the sandbox itself fails; anything the solution does is a verdict."""
    plan = tests if isinstance(tests, Plan) else plan_tests(tests, entry_point=entry_point)
    job = json.dumps({"solution": solution, "modules": list(modules), "units": list(plan.units)}).encode()
    return judge(plan, run_python(HARNESS_SOURCE, config=config, stdin=job, channel=True))


def judge(plan: Plan, ex: Execution) -> Verdict:
    """The verdict on one execution of the harness (see the module docstring)."""
    frames = _frames(ex.channel)
    solution = [f for f in frames if f.get("t") == "solution"]
    units: dict[int, list[dict]] = {}
    checks: dict[int, list[dict]] = {}
    for f in frames:
        if f.get("t") in ("unit", "check") and isinstance(f.get("i"), int):
            (units if f["t"] == "unit" else checks).setdefault(f["i"], []).append(f)
    error = _run_error(ex, solution, units, len(plan.units))
    ran = len(solution) == 1 and solution[0].get("ok") is True
    cases = tuple(_judge_case(plan, c, units.get(c.unit, []), checks.get(c.unit, [])) if ran else
                  CaseResult(c.name, False, "the solution did not run") for c in plan.cases)
    setup = sorted(set(units) - {c.unit for c in plan.cases})
    failed_setup = next((units[i][0].get("error") for i in setup if units[i][0].get("ok") is False), None)
    if error is None and failed_setup and not all(c.passed for c in cases):
        error = f"test setup raised {str(failed_setup)[:300]}"
    return Verdict(cases=cases, seconds=ex.seconds, error=error, timed_out=ex.timed_out)


def _frames(channel: bytes) -> list[dict]:
    out = []
    for line in channel.split(b"\n"):
        try:
            frame = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a malformed, cut-off or absurdly nested frame says nothing
        if isinstance(frame, dict):
            out.append(frame)
    return out


def _run_error(ex: Execution, solution: list[dict], units: dict, num_units: int) -> str | None:
    status = f"signal {-ex.returncode}" if (ex.returncode or 0) < 0 else f"exit status {ex.returncode}"
    stderr = ex.stderr.decode(errors="replace").strip().splitlines()
    if ex.returncode == CONFINE_FAILED and not solution and stderr and stderr[-1].startswith("sandbox:"):
        raise SandboxError(stderr[-1])
    if ex.timed_out:
        return f"timed out after {ex.seconds:.1f} s"
    if len(solution) != 1:
        return f"the process ended before reporting on the solution ({status})"
    if solution[0].get("ok") is not True:
        return f"the solution raised {str(solution[0].get('error'))[:300]}"
    if any(i not in units for i in range(num_units)):
        return f"the process ended before the tests finished ({status})"
    return None


def _judge_case(plan: Plan, case: Case, unit: list[dict], checks: list[dict]) -> CaseResult:
    seen = set()
    for frame in checks:
        c = frame.get("c")
        check = plan.checks[c] if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < len(plan.checks) \
            else None
        if check is None:
            return CaseResult(case.name, False, "reported an unknown check")
        why = _fails(check, frame)
        if why is not None:
            return CaseResult(case.name, False, f"{_where(case, check)}{check.text}: {why}")
        seen.add(c)
    if len(unit) != 1:
        return CaseResult(case.name, False, "did not finish" if not unit else "reported twice")
    if unit[0].get("ok") is not True:
        return CaseResult(case.name, False, f"raised {str(unit[0].get('error'))[:300]}")
    missing = sorted(case.required - seen)
    if missing:
        check = plan.checks[missing[0]]
        return CaseResult(case.name, False, f"{_where(case, check)}{check.text}: never checked")
    return CaseResult(case.name, True)


def _where(case: Case, check: Check) -> str:
    return "" if case.name == f"line {check.line}" else f"line {check.line}: "


def _fails(check: Check, frame: dict) -> str | None:
    """Why `check` does not hold for the values in `frame`, or None when it holds."""
    if "error" in frame:
        return str(frame["error"])[:300]
    try:
        values = [decode(v) for v in frame.get("v")]
    except (ValueError, TypeError, OverflowError, RecursionError):
        return "malformed values"
    if check.skeleton is None:
        return _raise_fails(check, values)
    if len(values) != check.probes:
        return "malformed values"
    try:
        holds = eval(check.skeleton, {"__builtins__": {}}, {**TRUSTED, **{f"_p{i}": v for i, v in enumerate(values)}})
        holds = bool(holds)
    except Exception as e:  # noqa: BLE001 -- a comparison that raises does not hold
        return f"{type(e).__name__}: {e}"[:300]
    return None if holds else f"got {_short(values[0] if len(values) == 1 else values)}"


def _raise_fails(check: Check, values: list) -> str | None:
    if values == [None]:
        return "nothing was raised"
    if len(values) != 2 or not isinstance(values[0], list) or not isinstance(values[1], str):
        return "malformed values"
    chain, message = values
    if not any(c == want or (want.startswith(".") and isinstance(c, str) and c.endswith(want))
               for want in check.raises for c in chain):
        return f"raised {_short(chain[0] if chain else '?')}"
    if check.match is not None and re.search(check.match, message) is None:
        return f"message {_short(message)} does not match {check.match!r}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def decode(value, depth: int = 0):
    """The builtin value of one tagged-JSON value the harness's `encode` wrote; ValueError when
    malformed. Only fresh builtin objects come out, so comparing them runs no candidate code."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if not (isinstance(value, list) and value and isinstance(value[0], str)):
        raise ValueError("untagged value")
    tag, rest, d = value[0], value[1:], depth + 1
    if tag in ("int", "float", "bytes", "bytearray") and len(rest) == 1 and isinstance(rest[0], str):
        return {"int": lambda s: int(s, 16), "float": float.fromhex, "bytes": bytes.fromhex,
                "bytearray": bytearray.fromhex}[tag](rest[0])
    if tag == "complex" and len(rest) == 2 and all(isinstance(x, str) for x in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag in ("list", "tuple", "set", "frozenset") and len(rest) == 1 and isinstance(rest[0], list):
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(x, d) for x in rest[0])
    if tag == "dict" and len(rest) == 1 and isinstance(rest[0], list) and all(
            isinstance(p, list) and len(p) == 2 for p in rest[0]):
        return {decode(k, d): decode(v, d) for k, v in rest[0]}
    raise ValueError(f"bad tag {tag!r}")


class Approx:
    """`pytest.approx` for numbers and (nested) lists, tuples and dicts of them, evaluated in the parent."""

    def __init__(self, expected, rel=None, abs=None):  # noqa: A002 -- pytest's keyword names
        self.expected = expected
        self.rel = rel if rel is not None else (0.0 if abs is not None else 1e-6)
        self.abs = abs if abs is not None else (0.0 if rel is not None else 1e-12)

    def _close(self, got, want) -> bool:
        if isinstance(want, (list, tuple)):
            return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(self._close, got, want))
        if isinstance(want, dict):
            return isinstance(got, dict) and got.keys() == want.keys() and all(self._close(got[k], want[k])
                                                                                for k in want)
        number = (int, float, complex)
        if isinstance(want, number) and isinstance(got, number) and not isinstance(got, bool):
            if got == want:
                return True
            if math.isinf(builtins.abs(want)) or math.isinf(builtins.abs(got)):
                return False
            return builtins.abs(got - want) <= max(self.rel * builtins.abs(want), self.abs)
        return got == want

    def __eq__(self, other) -> bool:
        return self._close(other, self.expected)

    __hash__ = None

    def __repr__(self) -> str:
        return f"approx({self.expected!r})"


def _almost_equal(first, second, places=None, delta=None) -> bool:
    """unittest's assertAlmostEqual."""
    if first == second:
        return True
    if delta is not None:
        return builtins.abs(first - second) <= delta
    return round(builtins.abs(first - second), 7 if places is None else places) == 0


def _count_equal(first, second) -> bool:
    """unittest's assertCountEqual: the same elements, in any order."""
    first, second = list(first), list(second)
    try:
        return collections.Counter(first) == collections.Counter(second)
    except TypeError:  # unhashable elements
        for x in first:
            if x not in second:
                return False
            second.remove(x)
        return not second


TRUSTED = {**{f"_f_{n}": getattr(builtins, n) for n in TRUSTED_BUILTINS},
           **{f"_f_math_{n}": getattr(math, n) for n in TRUSTED_MATH}, "_f_approx": Approx,
           "_tpurl_almost_equal": _almost_equal, "_tpurl_count_equal": _count_equal,
           "_tpurl_regex": lambda text, regex: re.search(regex, text) is not None}
