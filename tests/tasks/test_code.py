"""The code task: code extraction, disjoint splits, the reference demonstration, every reward component
(correct, wrong, partial, non-code, cut off, grader timeout and failure), concurrent batch scoring and
config errors. The dataset and tokenizer are written here."""

import json
import threading

import pytest

from helpers import jsonl_task_files, nothing_left_behind  # noqa: F401 (a fixture)
from tpurl.sandbox import SandboxConfig, SandboxError
from tpurl.tasks import CodeConfig, CodeTask, TaskConfig, make_task
from tpurl.tasks import code as code_module
from tpurl.tasks.code import extract_code, parses
from tpurl.tokenizer import load_hf_tokenizer

ROWS = [
    {"prompt": "Write add(a, b) returning the sum.", "reference": "def add(a, b):\n    return a + b",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(5, 5) == 10"]},
    {"prompt": "Write mul(a, b) returning the product.", "reference": "def mul(a, b):\n    return a * b",
     "tests": "assert mul(2, 3) == 6\nassert mul(0, 9) == 0\n"},
    {"prompt": "Write rev(s) reversing a string.", "reference": "def rev(s):\n    return s[::-1]",
     "tests": "def test_rev():\n    assert rev('abc') == 'cba'\n\ndef test_empty():\n    assert rev('') == ''\n"},
    {"prompt": "Write is_even(n).", "reference": "def is_even(n):\n    return n % 2 == 0",
     "tests": "def check(candidate):\n    assert candidate(2)\n    assert not candidate(3)\n", "entry_point": "is_even"},
    {"prompt": "Write biggest(xs) returning the largest item.", "reference": "def biggest(xs):\n    return max(xs)",
     "tests": ["assert biggest([1, 5, 2]) == 5", "assert biggest([-3]) == -3"]},
    {"prompt": "Write neg(x).", "reference": "def neg(x):\n    return -x", "tests": ["assert neg(3) == -3"]},
    {"prompt": "A row whose tests cannot be graded.", "reference": "", "tests": "assert (\n"},
]
SANDBOX = SandboxConfig(timeout_s=2.0, memory_mb=256, max_processes=8, workers=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    jsonl_task_files(d, ROWS, [r["prompt"] + r["reference"] for r in ROWS], vocab_size=300)
    (d / "eval.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    return d


pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def _task(files, **changes) -> CodeTask:
    cfg = CodeConfig(train_file=str(files / "train.jsonl"), num_eval=2, sandbox=SANDBOX, **changes)
    return CodeTask(cfg, tokenizer=load_hf_tokenizer(str(files / "tok")))


def _problem(task, name):
    every = [task.train_problem(i) for i in range(len(task._train))] + task.eval_problems()
    return next(p for p in every if name in p.prompt)


def test_code_extraction():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nand an example:\n```py\nf()\n```") == "f()\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\ndef f(): pass\n```\n```text\nnot code\n```") == "def f(): pass\n"
    assert extract_code("cut off:\n```python\ndef f():\n    return 2") == "def f():\n    return 2"
    assert extract_code("def f():\n    return 3\n") == "def f():\n    return 3\n"
    assert parses("def f():\n    return 3\n") and not parses("The answer is 42.") and not parses("  \n")


def test_splits_and_demonstration(files):
    task = _task(files)
    assert {k: v for k, v in task.describe().items() if k != "sandbox"} == {
        "train": 4, "eval": 2, "dropped_overlong": 0, "dropped_bad_tests": 1, "dropped_not_text": 0}
    assert task.describe()["sandbox"]["limits"]["timeout_s"] == SANDBOX.timeout_s
    held = {p.prompt for p in task.eval_problems()}
    stream = [task.train_problem(i) for i in range(12)]
    assert not held & {p.prompt for p in stream} and len({p.uid for p in stream[:4]}) == 4
    with_eval = _task(files, eval_file=str(files / "eval.jsonl"))
    assert [p.answer for p in with_eval.eval_problems()] == [ROWS[0]["reference"]]
    p = task.train_problem(0)
    demo = task.demonstration(p, 0)
    assert demo == f"```python\n{p.answer}\n```" and "<|im_start|>user" in p.prompt
    assert make_task(TaskConfig(name="code", tokenizer=str(files / "tok"),
                                code=CodeConfig(train_file=str(files / "train.jsonl"), num_eval=2))).name == "code"


def _components(reward):
    return dict(reward.components)


def test_scoring_components(files):
    task = _task(files, format_weight=0.1, passed_frac_weight=0.5)
    add = _problem(task, "add(a, b)")
    right = task.score(add, "Sure:\n```python\ndef add(a, b):\n    return a + b\n```", "stop")
    assert _components(right) == {"correct": 1.0, "passed_frac": 1.0, "format": 1.0, "grader_error": 0.0}
    assert right.total == pytest.approx(1.6)
    partial = task.score(add, "```python\ndef add(a, b):\n    return abs(a) + b\n```", "stop")  # fails add(-1, 1)
    assert _components(partial) == {"correct": 0.0, "passed_frac": pytest.approx(2 / 3), "format": 1.0,
                                    "grader_error": 0.0}
    wrong = task.score(add, "def add(a, b):\n    return a - b\n", "stop")  # raw text is code too
    assert _components(wrong) == {"correct": 0.0, "passed_frac": 0.0, "format": 1.0, "grader_error": 0.0}
    zeros = {"correct": 0.0, "passed_frac": 0.0, "format": 0.0, "grader_error": 0.0}
    assert _components(task.score(add, "The answer is 42.", "stop")) == zeros  # not code: not run
    cut = task.score(add, "```python\ndef add(a, b):\n    return a + b\n```", "length")  # ran out of tokens
    assert _components(cut) == zeros
    even = _problem(task, "is_even")  # HumanEval style: check(candidate) with the entry point
    assert task.score(even, "```python\ndef is_even(n):\n    return n % 2 == 0\n```", "stop").components["correct"] == 1


def test_grader_timeout_and_failure_are_grader_errors(files, monkeypatch):
    task = _task(files)
    add = _problem(task, "add(a, b)")
    hang = task.score(add, "```python\ndef add(a, b):\n    while True:\n        pass\n```", "stop")
    assert _components(hang) == {"correct": 0.0, "passed_frac": 0.0, "format": 0.0, "grader_error": 1.0}
    assert hang.total == 0.0

    def broken(*args, **kwargs):
        raise SandboxError("sandbox: could not start")
    monkeypatch.setattr(code_module, "grade", broken)
    failed = task.score(add, "```python\ndef add(a, b):\n    return a + b\n```", "stop")
    assert _components(failed) == {"correct": 0.0, "passed_frac": 0.0, "format": 0.0, "grader_error": 1.0}


def test_score_batch_grades_concurrently_and_matches_score(files, monkeypatch):
    task = _task(files)
    real, active, peak, lock = code_module.grade, [0], [0], threading.Lock()

    def counting(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1
    monkeypatch.setattr(code_module, "grade", counting)
    problems = [task.train_problem(i) for i in range(4)] * 2
    completions = [f"```python\n{p.answer}\n```" for p in problems[:4]] + ["def nothing():\n    pass\n"] * 4
    rewards = task.score_batch(problems, completions, ["stop"] * 8)
    assert [r.components["correct"] for r in rewards] == [1.0] * 4 + [0.0] * 4
    assert 1 < peak[0] <= SANDBOX.workers
    assert [r.components for r in rewards[:1]] == [task.score(problems[0], completions[0], "stop").components]
    with pytest.raises(ValueError, match="finish_reason 'eos'"):
        task.score_batch(problems[:1], completions[:1], ["eos"])


def test_config_errors(files, tmp_path):
    with pytest.raises(ValueError, match="no {prompt} field"):
        CodeConfig(prompt_template="Solve it")
    with pytest.raises(ValueError, match=r"CodeConfig.sandbox=.* must be a SandboxConfig"):
        CodeConfig(sandbox={"timeout_s": 1})
    with pytest.raises(ValueError, match="needs CodeConfig.train_file"):
        make_task(TaskConfig(name="code"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "test_list": []}) + "\n")
    with pytest.raises(ValueError, match=r"has no \['prompt', 'tests'\] field .* set CodeConfig.prompt_key / tests_key"):
        CodeTask(CodeConfig(train_file=str(bad)), tokenizer=load_hf_tokenizer(str(files / "tok")))
