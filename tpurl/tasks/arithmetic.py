"""Multi-digit addition: the built-in task of the embedded demo.

Prompt `"57+8="`, answer `"65"` (or its digits reversed, least significant first, when
`reverse_answer`: the order in which carries propagate, much easier for a small model to learn).
Operands are drawn uniformly from `[0, 10**digits)`. With `pad_operands`, operands are zero-padded
to `digits` characters and the answer to `digits + 1` (`"07+45=052"`): every digit then sits at a
fixed position, which a small model learns far faster than variable-width numbers. The held-out split is a fixed set of
`num_eval` distinct operand pairs drawn from `seed`; the training stream rejects those pairs, so the
two splits are disjoint by construction, and training problem `i` depends only on `(seed, i)`.

Warm-start demonstrations (`demonstration`) come from a simulated teacher that, with probability
`teacher_overflow_error`, drops the leading digit of a sum that has more digits than the operands
(`"57+68="` -> `"25"` instead of `"125"`): a model imitating it learns the skill together with the
flaw (its most likely answer to such problems is wrong, a right one is among its samples), which
is what RL with the exact-match reward then has to remove. Graders always use the true answer.

Reward components: `correct` (the completion is exactly the answer and the sequence stopped),
`format` (the completion is a non-empty digit string that stopped before the length limit) and
`digits` (partial credit: the fraction of answer positions whose digit is right, over the longer of
completion and answer, so extra or missing digits cost; a dense signal for a weak policy).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from tpurl.config_types import check_types
from tpurl.tasks.base import FINISH_REASONS, Problem, Reward, TaskBase, check_eos
from tpurl.tokenizer import CharTokenizer, Tokenizer

ALPHABET = "0123456789+="


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionConfig:
    """Addition task parameters. `num_eval` held-out problems must leave room for training ones."""

    digits: int = 2
    num_eval: int = 200
    seed: int = 0
    reverse_answer: bool = False
    pad_operands: bool = False
    correct_weight: float = 1.0
    format_weight: float = 0.1
    digits_weight: float = 0.0
    extra_new_tokens: int = 2
    teacher_overflow_error: float = 0.0

    @property
    def max_new_tokens(self) -> int:
        # The longest answer has digits + 1 characters; leave room for eos and a little slack so
        # that a wrong, longer answer is still visible in the logs.
        return self.digits + 1 + self.extra_new_tokens

    def __post_init__(self):
        check_types(self)
        if not 1 <= self.digits <= 9:
            raise ValueError(f"AdditionConfig.digits={self.digits} must be in 1..9")
        space = 10 ** (2 * self.digits)
        if not 0 < self.num_eval <= space // 4:
            raise ValueError(f"AdditionConfig.num_eval={self.num_eval} must be in 1..{space // 4} "
                             f"(a quarter of the {space} operand pairs) so that training problems remain")
        if min(self.correct_weight, self.format_weight, self.digits_weight) < 0:
            raise ValueError("AdditionConfig: reward weights must be >= 0")
        if not 0.0 <= self.teacher_overflow_error <= 1.0:
            raise ValueError(f"AdditionConfig.teacher_overflow_error={self.teacher_overflow_error} must be in [0, 1]")
        if self.extra_new_tokens < 1:
            raise ValueError(f"AdditionConfig.extra_new_tokens={self.extra_new_tokens} must be >= 1 (room for eos)")


class AdditionTask(TaskBase):
    """`a+b=` -> digits of a+b, with `correct` and `format` reward components."""

    name = "addition"
    version = "addition-v1"
    grader = "exact-match-v1"
    reward_components = ("correct", "format", "digits")
    stop_strings: tuple[str, ...] = ()

    def __init__(self, cfg: AdditionConfig = AdditionConfig(), *, tokenizer: Tokenizer | None = None):
        """`tokenizer`: e.g. a pretrained model's `HFTokenizer` (it needs an EOS token, the stop
        token of every completion); None: the built-in character tokenizer."""
        self.cfg = cfg
        if tokenizer is not None:
            check_eos(tokenizer, "AdditionTask")
        self._tokenizer = CharTokenizer(ALPHABET) if tokenizer is None else tokenizer

    @property
    def max_prompt_len(self) -> int:
        chars = 2 * self.cfg.digits + 2  # a + b =
        if isinstance(self._tokenizer, CharTokenizer):
            return chars + 1  # bos
        # A subword tokenizer never needs more tokens than ASCII characters (byte-level BPE merges
        # bytes); one more for a prefix token some tokenizers add (SentencePiece's "▁"), and BOS.
        return chars + 2

    def encode_prompt(self, problem: Problem) -> list[int]:
        return self._tokenizer.encode(problem.prompt, add_bos=True)

    def data_report(self) -> list[str]:
        return []  # problems are generated: nothing is dropped

    @property
    def data_files(self) -> tuple[str, ...]:
        return ()

    def _format_sum(self, total: int) -> str:
        d = self.cfg.digits
        text = f"{total:0{d + 1}d}" if self.cfg.pad_operands else str(total)
        return text[::-1] if self.cfg.reverse_answer else text

    def make_problem(self, a: int, b: int) -> Problem:
        d = self.cfg.digits
        if self.cfg.pad_operands:
            x, y, total = f"{a:0{d}d}", f"{b:0{d}d}", f"{a + b:0{d + 1}d}"
        else:
            x, y, total = str(a), str(b), str(a + b)
        return Problem(uid=f"{a}+{b}", prompt=f"{x}+{y}=", answer=total[::-1] if self.cfg.reverse_answer else total)

    @cached_property
    def _eval_pairs(self) -> list[tuple[int, int]]:
        rng = np.random.default_rng([self.cfg.seed, 0])
        hi, seen, pairs = 10 ** self.cfg.digits, set(), []
        while len(pairs) < self.cfg.num_eval:
            a, b = (int(x) for x in rng.integers(0, hi, 2))
            if (a, b) not in seen:
                seen.add((a, b))
                pairs.append((a, b))
        return pairs

    @cached_property
    def _eval_set(self) -> frozenset[tuple[int, int]]:
        return frozenset(self._eval_pairs)

    def eval_problems(self) -> list[Problem]:
        return [self.make_problem(a, b) for a, b in self._eval_pairs]

    def train_problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"AdditionTask.train_problem: index must be >= 0, got {index}")
        rng = np.random.default_rng([self.cfg.seed, 1, index])
        hi = 10 ** self.cfg.digits
        while True:  # rejection keeps the splits disjoint; held-out is <= 1/4 of the space
            a, b = (int(x) for x in rng.integers(0, hi, 2))
            if (a, b) not in self._eval_set:
                return self.make_problem(a, b)

    def demonstration(self, problem: Problem, index: int) -> str:
        """The warm-start target for training problem `index`: the answer, or (with probability
        `teacher_overflow_error`, deterministic in `(seed, index)`) the answer without the leading
        digit of an overflowing sum."""
        p = self.cfg.teacher_overflow_error
        a, b = (int(x) for x in problem.prompt[:-1].split("+"))
        if a + b < 10 ** self.cfg.digits or p == 0.0 or np.random.default_rng([self.cfg.seed, 2, index]).random() >= p:
            return problem.answer
        text = self._format_sum(a + b)
        return text[:-1] if self.cfg.reverse_answer else text[1:]

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward:
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"AdditionTask.score: finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
        stopped = finish_reason == "stop"
        well_formed = stopped and completion.isdigit()
        correct = stopped and completion == problem.answer
        matches = sum(a == b for a, b in zip(completion, problem.answer)) if stopped else 0
        digits = matches / max(len(completion), len(problem.answer))
        comps = {"correct": float(correct), "format": float(well_formed), "digits": float(digits)}
        total = (self.cfg.correct_weight * comps["correct"] + self.cfg.format_weight * comps["format"]
                 + self.cfg.digits_weight * comps["digits"])
        return Reward(components=comps, total=total)
