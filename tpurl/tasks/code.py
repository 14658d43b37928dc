"""Code generation graded by unit tests in the sandbox: JSONL problems, a chat prompt, test rewards.

Each row holds a problem statement (`prompt_key`) and its tests (`tests_key`: test code, or a list
of assert strings such as MBPP's `test_list`), optionally a reference solution (`reference_key`:
the warm-start demonstration, written as a code block) and an entry point (`entry_point_key`:
HumanEval's `check(candidate)` is called with it). Tests may be MBPP-style asserts, pytest-style
functions or unittest classes (`tpurl.sandbox.cases`); they are parsed when the task is built and
rows whose tests cannot be graded are dropped (`dropped_bad_tests`). Splits, prompts and the
training stream are `tpurl.tasks.jsonl`'s, the prompt template filled with `{prompt}`.

The code of a completion is its last fenced block labelled python/py (or unlabelled), else the text
after an unclosed fence, else the whole completion. It runs against the problem's tests in the
sandbox, the same path as `tpurl grade-code` (`tpurl.sandbox.grading`: the verdict cannot be
forged by the code). Reward components:

    correct       every test passed
    passed_frac   the fraction of tests passed
    format        the code parses (a completion that does not, or that ran out of tokens, is not
                  run and gets 0 everywhere)
    grader_error  grading raised or timed out; the sample's other components are then 0 and the
                  run goes on

`score_batch` grades many completions at once through a `SandboxPool` of `sandbox.workers`.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import re
from concurrent.futures import Future
from typing import Any, Sequence

from tpurl.sandbox import Plan, PlanError, SandboxConfig, SandboxPool, Verdict, grade, plan_tests, sandbox_mechanisms
from tpurl.tasks.base import FINISH_REASONS, Problem, Reward
from tpurl.tasks.jsonl import JsonlConfig, JsonlTask
from tpurl.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n", re.I)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeConfig(JsonlConfig):
    """The `code` task (see the module docstring and `JsonlConfig` for the shared fields). `sandbox`:
    the limits of one grading and how many run at once."""

    prompt_key: str = "prompt"
    tests_key: str = "tests"
    reference_key: str = "reference"
    entry_point_key: str = "entry_point"
    prompt_template: str = "{prompt}\nWrite the solution as one Python code block."
    correct_weight: float = 1.0
    passed_frac_weight: float = 0.0
    format_weight: float = 0.0
    sandbox: SandboxConfig = SandboxConfig()

    def __post_init__(self):
        super().__post_init__()
        if min(self.correct_weight, self.passed_frac_weight, self.format_weight) < 0:
            raise ValueError("CodeConfig: reward weights must be >= 0")
        if not isinstance(self.sandbox, SandboxConfig):
            raise ValueError(f"CodeConfig.sandbox must be a SandboxConfig, got {type(self.sandbox).__name__}")


def extract_code(completion: str) -> str:
    """The code of a completion: the last python/py/unlabelled fenced block, else what follows an
    unclosed opening fence, else the whole text."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion)]
    if blocks:
        return blocks[-1]
    opening = list(_OPEN_FENCE.finditer(completion))
    return completion[opening[-1].end():] if opening else completion


def parses(code: str) -> bool:
    """Whether `code` is non-empty Python that parses (nothing is compiled or run)."""
    if not code.strip():
        return False
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _Graded:
    plan: Plan
    entry_point: str | None
    reference: str | None


class CodeTask(JsonlTask):
    """Problems from JSONL, graded by their unit tests in the sandbox (see the module docstring)."""

    name = "code"
    version = "code-jsonl-v1"
    grader = "sandbox-unit-tests-v1"
    reward_components = ("correct", "passed_frac", "format", "grader_error")
    stop_strings: tuple[str, ...] = ()
    KEY_FIELDS = ("prompt_key", "tests_key")
    TEXT_FIELDS = ("prompt_key",)
    DROP_REASONS = {"bad_tests": "whose tests cannot be graded"}

    def __init__(self, cfg: CodeConfig, *, tokenizer: Tokenizer | None):
        self._graded: dict[str, _Graded] = {}
        super().__init__(cfg, tokenizer=tokenizer)
        self._pool = SandboxPool(cfg.sandbox)

    def make_problem(self, row: dict, uid: str) -> tuple[Problem, _Graded] | str:
        tests = row[self.cfg.tests_key]
        tests = "\n".join(tests) if isinstance(tests, list) else str(tests)
        entry_point = row.get(self.cfg.entry_point_key) or None
        try:
            plan = plan_tests(tests, entry_point=entry_point)
        except PlanError:
            return "bad_tests"
        reference = row.get(self.cfg.reference_key)
        graded = _Graded(plan=plan, entry_point=entry_point, reference=None if reference is None else str(reference))
        self._graded[uid] = graded
        prompt = self.render(prompt=str(row[self.cfg.prompt_key]))
        return Problem(uid=uid, prompt=prompt, answer=graded.reference or ""), graded

    def demonstration(self, problem: Problem, index: int) -> str:
        """The warm-start target of training problem `index`: its reference solution as a code block."""
        reference = self._train_item(index)[2].reference
        if reference is None:
            raise ValueError(f"CodeTask.demonstration: the training data has no {self.cfg.reference_key!r} field; "
                             "set CodeConfig.reference_key")
        return f"```python\n{reference.rstrip()}\n```"

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward:
        return self.score_batch([problem], [completion], [finish_reason])[0]

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[Reward]:
        """Score many completions, grading them concurrently (at most `sandbox.workers` at once)."""
        if not len(problems) == len(completions) == len(finish_reasons):
            raise ValueError(f"CodeTask.score_batch: {len(problems)} problems, {len(completions)} completions, "
                             f"{len(finish_reasons)} finish reasons")
        futures: list[Future | None] = []
        for problem, completion, reason in zip(problems, completions, finish_reasons):
            if reason not in FINISH_REASONS:
                raise ValueError(f"CodeTask.score: finish_reason {reason!r} is not one of {FINISH_REASONS}")
            if problem.uid not in self._graded:
                raise ValueError(f"CodeTask.score: problem {problem.uid!r} is not one of this task's")
            code = extract_code(completion) if reason == "stop" else ""
            futures.append(self._pool.submit(self._grade, problem.uid, code) if parses(code) else None)
        return [self._reward(f) for f in futures]

    def _grade(self, uid: str, code: str) -> Verdict:
        graded = self._graded[uid]
        return grade(code, graded.plan, config=self.cfg.sandbox, entry_point=graded.entry_point)

    def _reward(self, future: Future | None) -> Reward:
        comps = {"correct": 0.0, "passed_frac": 0.0, "format": 0.0, "grader_error": 0.0}
        if future is not None:
            try:
                verdict = future.result()
            except Exception as e:  # noqa: BLE001 -- a grader failure costs one sample, not the run
                log.warning("CodeTask: grading failed: %s", e)
                verdict = None
            if verdict is None or verdict.timed_out:
                comps["grader_error"] = 1.0
            else:
                comps.update(correct=float(verdict.passed), passed_frac=verdict.reward, format=1.0)
        total = (self.cfg.correct_weight * comps["correct"] + self.cfg.passed_frac_weight * comps["passed_frac"]
                 + self.cfg.format_weight * comps["format"])
        return Reward(components=comps, total=total)

    def describe(self) -> dict[str, Any]:
        """Split sizes, dropped rows and the sandbox's isolation, for the run manifest."""
        return {**super().describe(), "sandbox": sandbox_mechanisms(self.cfg.sandbox)}
