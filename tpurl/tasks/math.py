"""Verifiable math from your own data: JSONL problems, a chat-templated prompt, a final-answer grader.

Each line of `train_file` (and `eval_file`) is a JSON object with a question and a reference
answer (keys `question_key` / `answer_key`, e.g. GSM8K's `question` / `answer`). The prompt is
`prompt_template` filled with the question, rendered through the tokenizer's chat template as one
user turn (after an optional system turn) with the assistant's generation prompt, so the policy
sees exactly what it would see in a chat; `chat=False` uses the filled template as plain text.

Grading extracts the final answer from the completion and from the reference with `answer_format`:

    boxed        the content of the last `\\boxed{...}` (braces balanced), as in MATH-style prompts
    hash         the text after the last `####` (GSM8K's reference format)
    last_number  the last number in the text

and compares them after normalization: surrounding whitespace, `$`, a trailing `.` and thousands
separators are dropped; two numbers are equal when they agree to 1e-6 (relative), anything else
compares as text. `reference_format` extracts the reference the same way (`raw`: the answer field
is the answer itself). Reward components: `correct` (the extracted answer equals the reference and
the sequence stopped) and `format` (an answer could be extracted and the sequence stopped).

Splits, the training stream, prompt filtering and the report of dropped rows are
`tpurl.tasks.jsonl`'s; the question and answer must be text (a null one is dropped, never trained
on as "None"), and rows whose reference answer cannot be extracted are dropped too
(`dropped_no_answer`: nothing to grade against).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import ClassVar

from tpurl.tasks.base import FINISH_REASONS, Problem, Reward
from tpurl.tasks.jsonl import JsonlConfig, JsonlTask

ANSWER_FORMATS = ("boxed", "hash", "last_number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig(JsonlConfig):
    """The `math` task (see the module docstring and `JsonlConfig` for the shared fields)."""

    TEMPLATE_FIELD: ClassVar[str] = "question"
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}\nPut the final answer in \\boxed{{}}."
    answer_format: str = "boxed"
    reference_format: str = "raw"
    correct_weight: float = 1.0
    format_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"MathConfig.answer_format={self.answer_format!r}; use one of {ANSWER_FORMATS}")
        if self.reference_format not in ANSWER_FORMATS + ("raw",):
            raise ValueError(f"MathConfig.reference_format={self.reference_format!r}; use 'raw' or one of "
                             f"{ANSWER_FORMATS}")
        if min(self.correct_weight, self.format_weight) < 0:
            raise ValueError("MathConfig: reward weights must be >= 0")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept), None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def extract_answer(text: str, fmt: str) -> str | None:
    """The final answer of `text` in format `fmt` ("raw", or one of `ANSWER_FORMATS`), or None."""
    if fmt == "raw":
        return text
    if fmt == "boxed":
        return last_boxed(text)
    if fmt == "hash":
        return text.rsplit("####", 1)[1] if "####" in text else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    return answer[:-1].rstrip() if answer.endswith(".") else answer


def _as_number(answer: str) -> float | None:
    """The value of a plain decimal number; commas only as thousands separators (`1,234`, not `1,23`)."""
    if not _NUMBER.fullmatch(answer) or ("," in answer and not _GROUPED.fullmatch(answer)):
        return None
    try:
        return float(answer.replace(",", ""))
    except ValueError:
        return None


def answers_match(got: str | None, want: str | None) -> bool:
    """Equal after normalization: numerically to 1e-6 relative when both are numbers, else as text."""
    if not got or not want:
        return False
    got, want = _normalize(got), _normalize(want)
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return got == want


class MathTask(JsonlTask):
    """Problems from JSONL, graded by final-answer match (see the module docstring)."""

    name = "math"
    version = "math-jsonl-v1"
    grader = "final-answer-match-v1"
    reward_components = ("correct", "format")
    stop_strings: tuple[str, ...] = ()
    KEY_FIELDS = ("question_key", "answer_key")
    TEXT_FIELDS = ("question_key", "answer_key")
    DROP_REASONS = {"no_answer": "with no reference answer that {owner}.reference_format={reference_format!r} can extract"}

    def make_problem(self, row: dict, uid: str) -> tuple[Problem, str] | str:
        """The problem of a row and its answer field as written (the demonstration)."""
        raw = row[self.cfg.answer_key]
        reference = (extract_answer(raw, self.cfg.reference_format) or "").strip()
        if not reference:  # nothing to grade against: an empty answer would count as correct
            return "no_answer"
        return Problem(uid=uid, prompt=self.render(question=row[self.cfg.question_key]), answer=reference), raw

    def demonstration(self, problem: Problem, index: int) -> str:
        """The warm-start target of training problem `index`: its answer field as written."""
        return self._train_item(index)[2]

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward:
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"MathTask.score: finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
        stopped = finish_reason == "stop"
        got = extract_answer(completion, self.cfg.answer_format) if stopped else None
        comps = {"correct": float(answers_match(got, problem.answer)), "format": float(got is not None)}
        return Reward(components=comps, total=self.cfg.correct_weight * comps["correct"]
                      + self.cfg.format_weight * comps["format"])
