"""Verifiable math from your own data: JSONL problems, a chat-templated prompt, a final-answer grader.

Each line of `train_file` (and `eval_file`) is a JSON object with a question and a reference
answer (keys `question_key` / `answer_key`, e.g. GSM8K's `question` / `answer`). The prompt is
`prompt_template` filled with the question, rendered through the tokenizer's chat template as one
user turn (after an optional system turn) with the assistant's generation prompt, so the policy
sees exactly what it would see in a chat; `chat=False` uses the filled template as plain text.

Grading (`tpurl.tasks.math_grading`) extracts the final answer from the completion with
`answer_format` (`boxed`: one `\\boxed{...}`, several different boxes are no answer; `hash`: after
the last `####`; `last_number`) and the reference with `reference_format` (`raw`: the answer field
is the answer itself), and compares them as values with `grader`: math-verify when it is installed
(`auto`, the default) or the built-in normalizer (`builtin`), each check bounded by
`grade_timeout_s` (`grade_workers` checks at once). Reward components: `correct` (the extracted answer equals the reference and the
sequence stopped) and `format` (an answer could be extracted and the sequence stopped).

Splits, the training stream, prompt filtering and the report of dropped rows are
`tpurl.tasks.jsonl`'s; the question and answer must be text (a null one is dropped, never trained
on as "None"), and rows whose reference answer cannot be extracted are dropped too
(`dropped_no_answer`: nothing to grade against).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import ClassVar, Sequence

from tpurl.tasks.base import FINISH_REASONS, Problem, Reward
from tpurl.tasks.jsonl import JsonlConfig, JsonlTask
from tpurl.tasks.math_grading import ANSWER_FORMATS, GRADERS, MathGrader, extract_answer
from tpurl.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig(JsonlConfig):
    """The `math` task (see the module docstring and `JsonlConfig` for the shared fields)."""

    TEMPLATE_FIELD: ClassVar[str] = "question"
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}\nPut the final answer in \\boxed{{}}."
    answer_format: str = "boxed"
    reference_format: str = "raw"
    grader: str = "auto"
    grade_timeout_s: float = 3.0
    grade_workers: int = 4
    correct_weight: float = 1.0
    format_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"MathConfig.answer_format={self.answer_format!r}; use one of {ANSWER_FORMATS}")
        if self.reference_format not in ANSWER_FORMATS + ("raw",):
            raise ValueError(f"MathConfig.reference_format={self.reference_format!r}; use 'raw' or one of "
                             f"{ANSWER_FORMATS}")
        if self.grader not in GRADERS:
            raise ValueError(f"MathConfig.grader={self.grader!r}; use one of {GRADERS}")
        if not 0 < self.grade_timeout_s <= 600:
            raise ValueError(f"MathConfig.grade_timeout_s={self.grade_timeout_s}; use a positive number of seconds, "
                             "at most 600 (one answer's check)")
        if self.grade_workers < 1:
            raise ValueError(f"MathConfig.grade_workers={self.grade_workers}; use at least 1")
        if min(self.correct_weight, self.format_weight) < 0:
            raise ValueError("MathConfig: reward weights must be >= 0")


class MathTask(JsonlTask):
    """Problems from JSONL, graded by final-answer match (see the module docstring)."""

    name = "math"
    version = "math-jsonl-v2"
    reward_components = ("correct", "format")
    stop_strings: tuple[str, ...] = ()
    KEY_FIELDS = ("question_key", "answer_key")
    TEXT_FIELDS = ("question_key", "answer_key")
    DROP_REASONS = {"no_answer": "with no reference answer that {owner}.reference_format={reference_format!r} can extract"}

    def __init__(self, cfg: MathConfig, *, tokenizer: Tokenizer | None):
        self.checker = MathGrader(cfg.grader, cfg.grade_timeout_s, cfg.grade_workers, owner=type(cfg).__name__)
        super().__init__(cfg, tokenizer=tokenizer)

    @property
    def grader(self) -> str:
        """The comparison in force and its version (in the manifest): results compare only within one."""
        return self.checker.name

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
        correct, error = self.checker.match(got, problem.answer)
        comps = {"correct": float(correct), "format": float(got is not None)}
        return Reward(components=comps, total=self.cfg.correct_weight * comps["correct"]
                      + self.cfg.format_weight * comps["format"], error=error)

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[Reward]:
        """`score` for each sample, `grade_workers` at once (math-verify's checks run in processes)."""
        if not self.checker.uses_math_verify:
            return [self.score(*args) for args in zip(problems, completions, finish_reasons)]
        with concurrent.futures.ThreadPoolExecutor(self.cfg.grade_workers, thread_name_prefix="tpurl-grade") as pool:
            return list(pool.map(self.score, problems, completions, finish_reasons))
