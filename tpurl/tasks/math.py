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

Splits: the eval file is the held-out split; without one, `num_eval` problems of the training
file (a seeded choice) are held out and never trained on. The training stream is endless and
deterministic: index `i` is item `order_e[i % n]` of epoch `e = i // n`, each epoch a seeded
permutation. Prompts longer than `max_prompt_tokens` are dropped when the task is built (as verl's
`filter_overlong_prompts`); `dropped_overlong` counts them, and `dropped_no_answer` the rows whose
reference answer cannot be extracted (nothing to grade against).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from functools import cached_property
from typing import Any

import numpy as np

from tpurl.config_types import check_types
from tpurl.tasks.base import FINISH_REASONS, Problem, Reward, check_eos
from tpurl.tokenizer import Tokenizer

ANSWER_FORMATS = ("boxed", "hash", "last_number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig:
    """The `math` task (see the module docstring). `train_file` is required when the task is used."""

    train_file: str | None = None
    eval_file: str | None = None
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}\nPut the final answer in \\boxed{{}}."
    system_prompt: str | None = None
    chat: bool = True
    answer_format: str = "boxed"
    reference_format: str = "raw"
    num_eval: int = 200
    max_prompt_tokens: int = 512
    max_new_tokens: int = 512
    seed: int = 0
    correct_weight: float = 1.0
    format_weight: float = 0.0

    def __post_init__(self):
        check_types(self)
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"MathConfig.answer_format={self.answer_format!r}; use one of {ANSWER_FORMATS}")
        if self.reference_format not in ANSWER_FORMATS + ("raw",):
            raise ValueError(f"MathConfig.reference_format={self.reference_format!r}; use 'raw' or one of "
                             f"{ANSWER_FORMATS}")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"MathConfig.prompt_template={self.prompt_template!r} has no {{question}} field")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1 or self.num_eval < 1:
            raise ValueError("MathConfig: max_prompt_tokens, max_new_tokens and num_eval must be >= 1")
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
    if not _NUMBER.fullmatch(answer):
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


def _read_jsonl(path: str, question_key: str, answer_key: str) -> list[tuple[str, str]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"MathConfig: {path} does not exist")
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
            missing = [k for k in (question_key, answer_key) if k not in row]
            if missing:
                raise ValueError(f"{path}:{n} has no {missing} field (has {sorted(row)}); set "
                                 "MathConfig.question_key / answer_key")
            items.append((str(row[question_key]), str(row[answer_key])))
    if not items:
        raise ValueError(f"{path} holds no problems")
    return items


class MathTask:
    """Problems from JSONL, graded by final-answer match (see the module docstring)."""

    name = "math"
    version = "math-jsonl-v1"
    grader = "final-answer-match-v1"
    reward_components = ("correct", "format")
    stop_strings: tuple[str, ...] = ()

    def __init__(self, cfg: MathConfig, *, tokenizer: Tokenizer | None):
        if cfg.train_file is None:
            raise ValueError("TaskConfig.name='math' needs MathConfig.train_file (a JSONL of questions and answers)")
        if tokenizer is None:
            raise ValueError("TaskConfig.name='math' needs a subword tokenizer: set TaskConfig.tokenizer (a Hugging "
                             "Face tokenizer directory) or RLConfig.init_from")
        check_eos(tokenizer, "MathTask")
        if cfg.chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("MathConfig.chat=True but the tokenizer has no chat template; add one "
                             "(tokenizer_config.json or chat_template.jinja) or set MathConfig.chat=False")
        self.cfg = cfg
        self._tokenizer = tokenizer
        train = _read_jsonl(cfg.train_file, cfg.question_key, cfg.answer_key)
        if cfg.eval_file is not None:
            held_out = _read_jsonl(cfg.eval_file, cfg.question_key, cfg.answer_key)
        else:
            if cfg.num_eval >= len(train):
                raise ValueError(f"MathConfig.num_eval={cfg.num_eval} leaves no training problems of the "
                                 f"{len(train)} in {cfg.train_file}; lower it or give an eval_file")
            chosen = set(np.random.default_rng([cfg.seed, 0]).choice(len(train), cfg.num_eval, replace=False).tolist())
            held_out = [x for i, x in enumerate(train) if i in chosen]
            train = [x for i, x in enumerate(train) if i not in chosen]
        self.dropped_overlong = self.dropped_no_answer = 0
        self._ids: dict[str, list[int]] = {}  # prompt ids by problem uid, tokenized once
        self._order: tuple[int, np.ndarray | None] = (-1, None)
        self._train = self._fitting(train, "train")
        self._eval = self._fitting(held_out, "eval")

    def _fitting(self, items: list[tuple[str, str]], split: str) -> list[tuple[Problem, list[int], str]]:
        """(problem, prompt ids, raw answer) of the items whose prompt fits `max_prompt_tokens`."""
        kept = []
        for i, (question, raw) in enumerate(items):
            reference = (extract_answer(raw, self.cfg.reference_format) or "").strip()
            if not reference:  # nothing to grade against: an empty answer would count as correct
                self.dropped_no_answer += 1
                continue
            problem = Problem(uid=f"{split}:{i}", prompt=self.render(question), answer=reference)
            ids = self._prompt_ids(problem.prompt)
            if len(ids) > self.cfg.max_prompt_tokens:
                self.dropped_overlong += 1
                continue
            self._ids[problem.uid] = ids
            kept.append((problem, ids, raw))
        if not kept:
            raise ValueError(f"MathTask: no {split} prompt fits MathConfig.max_prompt_tokens="
                             f"{self.cfg.max_prompt_tokens}; raise it")
        return kept

    def render(self, question: str) -> str:
        """The prompt text of a question: the template, through the chat template when `chat`."""
        text = self.cfg.prompt_template.format(question=question)
        if not self.cfg.chat:
            return text
        messages = ([{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else [])
        return self._tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}],
                                                   add_generation_prompt=True)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens

    @cached_property
    def max_prompt_len(self) -> int:
        return max(len(ids) for _, ids, _ in self._train + self._eval)

    def _prompt_ids(self, text: str) -> list[int]:
        # A chat template writes the model's BOS itself where it has one (as transformers'
        # `apply_chat_template(tokenize=True)` assumes); plain text gets BOS here.
        return self._tokenizer.encode(text) if self.cfg.chat else self._tokenizer.encode(text, add_bos=True)

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Prompt token ids (tokenized when the task was built)."""
        ids = self._ids.get(problem.uid)
        return list(ids) if ids is not None else self._prompt_ids(problem.prompt)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the training split (the current one is kept: a step's
        problems are consecutive indices)."""
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.cfg.seed, 1, epoch]).permutation(len(self._train)))
        return self._order[1]

    def _train_item(self, index: int) -> tuple[Problem, list[int], str]:
        if index < 0:
            raise ValueError(f"MathTask.train_problem: index must be >= 0, got {index}")
        n = len(self._train)
        return self._train[int(self._epoch_order(index // n)[index % n])]

    def train_problem(self, index: int) -> Problem:
        return self._train_item(index)[0]

    def eval_problems(self) -> list[Problem]:
        return [p for p, _, _ in self._eval]

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

    def describe(self) -> dict[str, Any]:
        """Split sizes and filtering, for the run manifest."""
        return {"train": len(self._train), "eval": len(self._eval), "dropped_overlong": self.dropped_overlong,
                "dropped_no_answer": self.dropped_no_answer}
