"""A task of your own as a class: reverse a short word. tpurl finds it by import path
(`TaskConfig.name = "my_rl.reverse:ReverseTask"`) and builds its `Config` from
`TaskConfig.options`; no registration inside tpurl.

A task class needs `encode_prompt`, `train_problem`, `eval_problems` and `score` (or `start` for a
multi-turn environment), the attributes below, and `demonstration` for a supervised warm start.
"""

from __future__ import annotations

import dataclasses
import random

from tpurl.tasks import Problem, Reward
from tpurl.tokenizer import CharTokenizer

LETTERS = "abcdefgh"


class ReverseTask:
    """`abc>` should be answered `cba`; reward components `correct` and `letters` (the fraction
    of positions right, partial credit that gives a group of wrong answers a signal)."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config:
        length: int = 3
        num_eval: int = 64
        seed: int = 0
        letters_weight: float = 0.5

    name = "reverse"
    version = "reverse-v1"  # bump when prompts, splits or grading change
    grader = "exact-match-v1"
    reward_components = ("correct", "letters")
    stop_strings: tuple[str, ...] = ()
    data_files: tuple[str, ...] = ()

    def __init__(self, config: Config, *, tokenizer=None):
        self.cfg = config
        self.tokenizer = CharTokenizer(LETTERS + ">")  # the run's own: TaskConfig.tokenizer is not needed
        self.max_new_tokens = config.length + 1  # the answer and EOS
        self.max_prompt_len = config.length + 2  # BOS, the word and ">"
        words = sorted({"".join(w) for w in _all_words(config.length)})
        random.Random(config.seed).shuffle(words)
        self._eval, self._train = words[:config.num_eval], words[config.num_eval:]

    def _problem(self, word: str) -> Problem:
        return Problem(uid=word, prompt=word + ">", answer=word[::-1])

    def encode_prompt(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(problem.prompt, add_bos=True)

    def train_problem(self, index: int) -> Problem:
        return self._problem(self._train[index % len(self._train)])

    def eval_problems(self) -> list[Problem]:
        return [self._problem(w) for w in self._eval]

    def demonstration(self, problem: Problem, index: int) -> str:
        return problem.answer

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward:
        done = finish_reason == "stop"
        right = sum(a == b for a, b in zip(completion, problem.answer)) if done else 0
        comps = {"correct": float(done and completion == problem.answer), "letters": right / len(problem.answer)}
        return Reward(components=comps, total=comps["correct"] + self.cfg.letters_weight * comps["letters"])

    def data_report(self) -> list[str]:
        return [f"{len(self._train)} training words, {len(self._eval)} held out"]


def _all_words(length: int):
    if length == 0:
        yield ""
        return
    for head in LETTERS:
        for tail in _all_words(length - 1):
            yield head + tail
