"""The math grader on GSM8K- and MATH-style (reference, completion) pairs, with math-verify and
with the built-in normalizer: the verdicts, the several-boxes rule, the bounded check on and off
the main thread, and the grader named in the task."""

import json
import signal
import threading
import time

import pytest

from tpurl.tasks import math_grading, math_verify_worker
from tpurl.tasks.math_grading import MathGrader, builtin_match, extract_answer

CAS = "needs algebra"  # the builtin normalizer has none: math-verify's cases only

# (answer_format, reference, completion, the right verdict[, CAS]).
CASES = [
    ("boxed", "0.5", r"so \boxed{\frac{1}{2}}", True),
    ("boxed", "0.5", r"\boxed{1/2}", True),
    ("boxed", "0.5", r"\boxed{\dfrac12}", True),
    ("boxed", r"\frac{1}{2}", r"\boxed{0.5}", True),
    ("boxed", "1/4", r"\boxed{\frac14}", True),
    ("boxed", r"-\frac{1}{2}", r"\boxed{-0.5}", True),
    ("boxed", "2.5", r"\boxed{\frac{5}{2}}", True),
    ("boxed", "1.5", r"\boxed{3/2}", True),
    ("boxed", r"\frac{3}{4}", r"\boxed{0.75}", True),
    ("boxed", r"2\sqrt{2}", r"\boxed{\sqrt{8}}", True, CAS),
    ("boxed", r"\sqrt{8}", r"\boxed{2\sqrt{2}}", True, CAS),
    ("boxed", r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt3}{2}}", True, CAS),
    ("boxed", "x+1", r"\boxed{1+x}", True, CAS),
    ("boxed", "x^2+2x+1", r"\boxed{(x+1)^2}", True, CAS),
    ("boxed", "1000000", r"\boxed{10^6}", True),
    ("boxed", "10^{6}", r"\boxed{1,000,000}", True),
    ("boxed", "-3", r"\boxed{- 3}", True),
    ("boxed", "[2,5)", r"\boxed{[2, 5)}", True),
    ("boxed", r"(-\infty, 2]", r"\boxed{(-\infty,2]}", True),
    ("boxed", r"3\pi", r"\boxed{3 \pi}", True),
    ("boxed", r"\{1,2,3\}", r"\boxed{\{3, 2, 1\}}", True),
    ("boxed", r"\{1,2\}", r"\boxed{\{1, 2, 3\}}", False),
    ("boxed", "5", r"\boxed{x = 5}", True),
    ("boxed", "y=2x+3", r"\boxed{y = 2x + 3}", True),
    ("boxed", "12", r"\boxed{12\text{ cm}}", True),
    ("boxed", "8", r"\boxed{8 \text{ cm}^2}", True),
    ("boxed", "100", r"\boxed{100 \text{ dollars}}", True),
    ("boxed", "25", r"\boxed{25\%}", True),
    ("boxed", "18", r"\boxed{\$18}", True),
    ("boxed", "90", r"\boxed{90^\circ}", True),
    ("boxed", "60", r"\boxed{60^{\circ}}", True),
    ("boxed", "1000", r"\boxed{1{,}000}", True),
    ("boxed", "1000", r"\boxed{1\,000}", True),
    ("boxed", "42", r"The answer is $\boxed{42}$.", True),
    ("boxed", "9", r"\boxed{9.}", True),
    ("boxed", "3", r"\boxed{3}", True),
    ("boxed", "7", r"first \boxed{7}; checking again, \boxed{7}", True),
    ("boxed", "7", r"\boxed{7.0}, that is \boxed{7}", True),
    ("boxed", "3", r"\boxed{3} or \boxed{4} or \boxed{5}", False),
    ("boxed", "4", r"\boxed{3} or \boxed{4}", False),
    ("boxed", "3", r"\boxed{4}", False),
    ("boxed", "(1,2)", r"\boxed{(2,1)}", False),
    ("boxed", "12", r"\boxed{12.0001}", False),
    ("boxed", "5", r"\boxed{50}", False),
    ("boxed", "-5", r"\boxed{5}", False),
    ("boxed", r"\frac{1}{3}", r"\boxed{0.333}", False),
    ("boxed", "2", r"\boxed{2x}", False),
    ("boxed", r"\pi", r"\boxed{3.14}", False),
    ("boxed", "17", r"\boxed{17", False),
    ("boxed", "10", "no box here: 10", False),
    ("boxed", "4", r"\boxed{4 or 5}", False),
    ("hash", "72", "8 boxes of 9.\n#### 72", True),
    ("hash", "72", "8 boxes of 9.\n#### 72\nBecause 8 boxes of 9 make 72.", True),
    ("hash", "72", "#### 72 because 8 x 9 = 72", True),
    ("hash", "72", "#### **72**", True),
    ("hash", "5", "#### 5 apples", True),
    ("hash", "25", "#### 25%", True),
    ("hash", "18", "#### $18.00", True),
    ("hash", "1234", "#### 1,234", True),
    ("hash", "0.5", "#### 1/2", True),
    ("hash", "72", "#### 27", False),
    ("hash", "72", "#### 72.5", False),
    ("hash", "3", "#### 3 or 4", False),
    ("hash", "15", "#### 15\nwait, no:\n#### 16", False),
    ("hash", "10", "#### 10 - 2 = 8", False),
]


def _verdict(grader: MathGrader, fmt: str, reference: str, completion: str) -> bool:
    return grader.match(extract_answer(completion, fmt), reference)[0]


def _table_score(grader: MathGrader) -> tuple[list[tuple], list[tuple]]:
    """The cases the grader gets wrong: all of them, and those that need no algebra."""
    wrong = [c for c in CASES if _verdict(grader, *c[:3]) != c[3]]
    return wrong, [c for c in wrong if CAS not in c]


def test_the_table_covers_every_kind_of_answer():
    assert len(CASES) >= 60 and sum(not c[3] for c in CASES) >= 15 and sum(CAS in c for c in CASES) >= 4


def test_math_verify_gives_the_right_verdict_on_the_table():
    grader = MathGrader("math_verify", 3.0)
    wrong, _ = _table_score(grader)
    assert len(wrong) <= 0.05 * len(CASES), wrong
    assert grader.name.startswith("math-verify-")


def test_the_builtin_normalizer_is_right_on_every_case_without_algebra():
    grader = MathGrader("builtin", 3.0)
    wrong, without_algebra = _table_score(grader)
    assert without_algebra == [], without_algebra
    assert grader.name == math_grading.BUILTIN_VERSION and 0 < len(wrong) <= sum(CAS in c for c in CASES)


@pytest.mark.parametrize("grader", ["math_verify", "builtin"])
def test_several_different_boxes_are_no_answer(grader):
    g = MathGrader(grader, 3.0)
    for gold in ("3", "4", "5"):
        assert extract_answer(r"\boxed{3} or \boxed{4} or \boxed{5}", "boxed") is None
        assert not _verdict(g, "boxed", gold, r"\boxed{3} or \boxed{4} or \boxed{5}")
    assert extract_answer(r"\boxed{\frac12} so \boxed{0.5}", "boxed") == "0.5"  # equal boxes: one answer


def test_the_builtin_comparison_is_symmetric():
    for fmt, reference, completion, right, *_ in CASES:
        got = extract_answer(completion, fmt)
        assert builtin_match(got, reference) == builtin_match(reference, got)


def test_auto_falls_back_to_builtin_without_math_verify(monkeypatch):
    assert MathGrader("auto", 3.0).uses_math_verify
    monkeypatch.setattr(math_grading, "math_verify_version", lambda: None)  # as if not installed
    assert MathGrader("auto", 3.0).name == math_grading.BUILTIN_VERSION
    with pytest.raises(ValueError, match=r"grader='math_verify' needs math-verify: pip install 'tpurl\[math\]'"):
        MathGrader("math_verify", 3.0)


# sympy cannot finish comparing a tower of powers with 3 in any time a step allows.
TOWER = r"\boxed{10^{10^{10^{10}}}}"


@pytest.mark.slow
def test_a_check_past_its_time_is_killed_and_that_answer_is_wrong_with_the_reason():
    grader = MathGrader("math_verify", 0.5, workers=1)
    assert grader.match(extract_answer(r"\boxed{\sqrt{8}}", "boxed"), r"2\sqrt{2}") == (True, None)  # started
    (worker,) = [grader.workers._idle.get()]
    grader.workers._idle.put(worker)
    start = time.monotonic()
    assert grader.match(extract_answer(TOWER, "boxed"), "3") == (False, "math-verify timed out after 0.5 s")
    assert time.monotonic() - start < 5 and grader.workers.killed == 1 and worker.proc.poll() is not None
    assert grader.match(extract_answer(r"\boxed{\sqrt{8}}", "boxed"), r"2\sqrt{2}") == (True, None)  # a new one


@pytest.mark.slow
def test_checks_from_many_threads_share_the_workers():
    grader = MathGrader("math_verify", 10.0, workers=2)
    pairs = [(rf"\sqrt{{{2 * i * i}}}", rf"{i}\sqrt{{2}}") for i in range(2, 10)]  # algebra: the workers
    out: list = [None] * len(pairs)

    def grade(i):
        out[i] = grader.match(*pairs[i])

    threads = [threading.Thread(target=grade, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == [(True, None)] * len(pairs) and 1 <= grader.workers._started <= 2


@pytest.mark.slow
def test_a_worker_left_alone_in_a_check_ends_by_its_cpu_limit():
    """Without its parent to kill it (the parent died mid-check), a worker ends itself just past
    the check's time: SIGXCPU."""
    worker = math_verify_worker.Worker()
    worker.proc.stdin.write(json.dumps([extract_answer(TOWER, "boxed"), "3", 0.5]) + "\n")
    worker.proc.stdin.flush()
    try:
        assert worker.proc.wait(30) == -signal.SIGXCPU
    finally:
        worker.kill()
