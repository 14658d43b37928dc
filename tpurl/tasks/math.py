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
permutation. Rows are dropped when the task is built, counted per reason (`describe`) and
reported (`data_report`, which `tpurl train` prints): a prompt longer than `max_prompt_tokens` (as
verl's `filter_overlong_prompts`), a reference answer that `reference_format` cannot extract
(nothing to grade against), a question or answer that is null or not text (numbers are written
out). A line that is not UTF-8, not JSON, not an object or lacks a key is an error naming the
file and line.
"""

from __future__ import annotations

import collections
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


def _text(value) -> str | None:
    """A question or answer field as text: a string as it is, a number written out; None for
    anything else (null, a list, an object), which has no text to train on."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _read_jsonl(path: str, question_key: str, answer_key: str) -> tuple[list[tuple[str, str]], int]:
    """The (question, answer) rows of a JSONL file, and how many rows were dropped for a null or
    non-text question or answer."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"MathConfig: {path} does not exist")
    items, not_text = [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid UTF-8 ({e.reason} at byte {e.start} of the line); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n} is a JSON {type(row).__name__}, not an object with {question_key!r} "
                                 f"and {answer_key!r} fields; write one object per line")
            missing = [k for k in (question_key, answer_key) if k not in row]
            if missing:
                raise ValueError(f"{path}:{n} has no {missing} field (has {sorted(row)}); set "
                                 "MathConfig.question_key / answer_key")
            question, answer = _text(row[question_key]), _text(row[answer_key])
            if question is None or answer is None:
                not_text += 1
                continue
            items.append((question, answer))
    if not items:
        raise ValueError(f"{path} holds no problems" + (f": all {not_text} rows have a null or non-text "
                                                        f"{question_key!r} or {answer_key!r}" if not_text else ""))
    return items, not_text


# Why rows are dropped (keys of `MathTask.dropped`), as `data_report` words them.
DROP_REASONS = {
    "not_text": "with a null or non-text question or answer",
    "no_answer": "with no reference answer that MathConfig.reference_format={reference_format!r} can extract",
    "overlong": "with a prompt longer than MathConfig.max_prompt_tokens={max_prompt_tokens}",
}


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
        # Rows read and dropped (by reason) per data file.
        self.rows: dict[str, int] = {}
        self.dropped: dict[str, collections.Counter] = {}
        train = self._read(cfg.train_file)
        if cfg.eval_file is not None:
            held_out = self._read(cfg.eval_file)
        else:
            if cfg.num_eval >= len(train):
                raise ValueError(f"MathConfig.num_eval={cfg.num_eval} leaves no training problems of the "
                                 f"{len(train)} in {cfg.train_file}; lower it or give an eval_file")
            chosen = set(np.random.default_rng([cfg.seed, 0]).choice(len(train), cfg.num_eval, replace=False).tolist())
            held_out = [x for i, x in enumerate(train) if i in chosen]
            train = [x for i, x in enumerate(train) if i not in chosen]
        self._ids: dict[str, list[int]] = {}  # prompt ids by problem uid, tokenized once
        self._order: tuple[int, np.ndarray | None] = (-1, None)
        self._train = self._fitting(train, "train", cfg.train_file)
        self._eval = self._fitting(held_out, "eval", cfg.eval_file or cfg.train_file)

    def _read(self, path: str) -> list[tuple[str, str]]:
        items, not_text = _read_jsonl(path, self.cfg.question_key, self.cfg.answer_key)
        self.rows[path] = self.rows.get(path, 0) + len(items) + not_text
        self.dropped.setdefault(path, collections.Counter())["not_text"] += not_text
        return items

    def _fitting(self, items: list[tuple[str, str]], split: str, path: str) -> list[tuple[Problem, list[int], str]]:
        """(problem, prompt ids, raw answer) of the items of `path` with a reference answer and a
        prompt that fits `max_prompt_tokens`; the others are counted in `dropped[path]`."""
        kept, dropped = [], collections.Counter()
        for i, (question, raw) in enumerate(items):
            reference = (extract_answer(raw, self.cfg.reference_format) or "").strip()
            if not reference:  # nothing to grade against: an empty answer would count as correct
                dropped["no_answer"] += 1
                continue
            problem = Problem(uid=f"{split}:{i}", prompt=self.render(question), answer=reference)
            ids = self._prompt_ids(problem.prompt)
            if len(ids) > self.cfg.max_prompt_tokens:
                dropped["overlong"] += 1
                continue
            self._ids[problem.uid] = ids
            kept.append((problem, ids, raw))
        self.dropped[path] += dropped
        if not kept:
            raise ValueError(f"MathTask: none of the {len(items)} {split} rows of {path} is usable: "
                             f"{self._reasons(dropped)}")
        return kept

    def _reasons(self, dropped: collections.Counter) -> str:
        words = {k: v.format(reference_format=self.cfg.reference_format, max_prompt_tokens=self.cfg.max_prompt_tokens)
                 for k, v in DROP_REASONS.items()}
        return ", ".join(f"{n} {words[k]}" for k, n in sorted(dropped.items()) if n)

    def data_report(self) -> list[str]:
        """One line per data file that lost rows: how many, out of how many, and why."""
        return [f"math task: dropped {sum(d.values())} of the {self.rows[path]} rows of {path}: {self._reasons(d)}"
                for path, d in self.dropped.items() if sum(d.values())]

    @property
    def data_files(self) -> tuple[str, ...]:
        """The files the problems come from (their checksums go into the run manifest)."""
        return tuple(self.rows)

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
        total = sum(self.dropped.values(), collections.Counter())
        return {"train": len(self._train), "eval": len(self._eval), "dropped_overlong": total["overlong"],
                "dropped_no_answer": total["no_answer"], "dropped_not_text": total["not_text"]}
