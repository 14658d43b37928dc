"""Multiplication with a calculator tool: the multi-turn environment of the tool-use demo.

Prompt `"47*86="`. The model may call the calculator by writing an expression in brackets; the
turn ends at `]` (a stop string), the environment evaluates it and answers with the result and a
`|` (observation tokens, never trained on), and the model's next turn gives the answer::

    47*86=  [47*86]  4042|  4042<eos>
    prompt  turn 1   tool   turn 2 (the answer)

A turn that ends at EOS gives the answer directly (a small model cannot multiply two-digit
numbers reliably: that is what the tool is for). Termination: the answer turn, `max_turns`,
`max_tool_calls` (a call beyond it ends the episode unanswered) or the token budget.

Reward components: `correct` (the answer turn is exactly the product and the episode stopped),
`format` (the answer is a non-empty digit string), `tool_calls` (calls made), `tool_error`
(1 if a call was malformed: the tool then answers `?|`). `total = correct_weight * correct +
format_weight * format`. Episode info: `tool_calls`, `tool_errors`, `turns` (logged per step).

Warm-start demonstrations come from an imperfect teacher that calls the tool with probability
`teacher_tool_rate` and otherwise answers from a rough estimate (the product with its last two
digits wrong): imitating it, a model calls the tool on only some problems, which RL on `correct`
then has to make a habit. The held-out split is a fixed set of operand pairs; the training stream
rejects them, so the splits are disjoint.

`CalculatorConfig.chat=True` is the same task in a chat format with OpenAI function calling, for
agents (`tpurl.tasks.calculator_chat`: its tokenizer, prompts and demonstrations; the agent
task's `source`); its own environment path is the bracket format's alone.
"""

from __future__ import annotations

import dataclasses
import re
from functools import cached_property

import numpy as np

from tpurl.config_types import check_types
from tpurl.tasks import calculator_chat
from tpurl.tasks.base import FINISH_REASONS, Problem, Reward, TaskBase
from tpurl.tasks.env import EpisodeLimits, ToolEpisode
from tpurl.tokenizer import CharTokenizer, Tokenizer

ALPHABET = "0123456789*=[]|?"
CALL = re.compile(r"\[(\d{1,6})\*(\d{1,6})\]$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """Operand sizes, splits, the teacher of the warm start, rewards and episode limits."""

    digits: int = 2
    num_eval: int = 200
    seed: int = 0
    teacher_tool_rate: float = 0.3
    correct_weight: float = 1.0
    format_weight: float = 0.1
    limits: EpisodeLimits = EpisodeLimits(max_turns=3, max_tool_calls=2)
    chat: bool = False

    @property
    def max_new_tokens(self) -> int:
        # A call `[a*b]`, its result and `|`, the answer and EOS, with room for one more call. In the
        # chat format a call is `<tool_call>`, the skeleton's three tokens around the operands,
        # `</tool_call>` and `<|end|>`; its result `<|tool|>`, the product, `<|end|><|assistant|>`.
        product = 2 * self.digits
        if self.chat:
            return 2 * ((2 * self.digits + 6) + (product + 3)) + product + 1
        call = 2 * self.digits + 3
        return 2 * (call + product + 1) + product + 1

    def __post_init__(self):
        check_types(self)
        if not 1 <= self.digits <= 4:
            raise ValueError(f"CalculatorConfig.digits={self.digits} must be in 1..4")
        if not 0 < self.num_eval <= 10 ** (2 * self.digits) // 4:
            raise ValueError(f"CalculatorConfig.num_eval={self.num_eval} must be in 1..{10 ** (2 * self.digits) // 4}")
        if not 0.0 <= self.teacher_tool_rate <= 1.0:
            raise ValueError(f"CalculatorConfig.teacher_tool_rate={self.teacher_tool_rate} must be in [0, 1]")
        if min(self.correct_weight, self.format_weight) < 0:
            raise ValueError("CalculatorConfig: reward weights must be >= 0")


class CalculatorEpisode(ToolEpisode):
    """One problem's episode: `[a*b]` calls answered with the product, the answer turn graded."""

    def __init__(self, env: CalculatorEnv, problem: Problem):
        super().__init__(env.cfg.limits, call_end="]")
        self.env, self.problem = env, problem

    def call(self, text: str) -> tuple[list[int], bool]:
        call = CALL.search(text)
        result = "?" if call is None else str(int(call.group(1)) * int(call.group(2)))
        return self.env.tokenizer.encode(result + "|"), call is None

    def finish(self, text: str, finish_reason: str) -> Reward:
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"CalculatorEpisode.finish: finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
        answer = self.answer if self.answer is not None else ""
        stopped = finish_reason == "stop" and self.answer is not None
        comps = {"correct": float(stopped and answer == self.problem.answer),
                 "format": float(stopped and answer.isdigit()), **self.tool_components()}
        cfg = self.env.cfg
        return Reward(components=comps, total=cfg.correct_weight * comps["correct"] + cfg.format_weight * comps["format"])


class CalculatorEnv(TaskBase):
    """`a*b=` -> the product, with a calculator tool (see the module docstring)."""

    name = "calculator"
    version = "calculator-v1"
    grader = "exact-match-v1"
    reward_components = ("correct", "format", "tool_calls", "tool_error")
    stop_strings = ("]",)

    def __init__(self, cfg: CalculatorConfig = CalculatorConfig(), *, tokenizer: Tokenizer | None = None):
        if tokenizer is not None:
            raise ValueError("CalculatorEnv uses its own character tokenizer; leave TaskConfig.tokenizer unset")
        self.cfg = cfg
        self._tokenizer = calculator_chat.chat_tokenizer() if cfg.chat else CharTokenizer(ALPHABET)
        self.version = "calculator-chat-v1" if cfg.chat else "calculator-v1"

    @property
    def max_prompt_len(self) -> int:
        # a * b = and bos; in the chat format `<|user|>`, a * b =, `<|end|><|assistant|>`
        return 2 * self.cfg.digits + (5 if self.cfg.chat else 3)

    def encode_prompt(self, problem: Problem) -> list[int]:
        if self.cfg.chat:
            return calculator_chat.prompt_ids(self._tokenizer, problem)
        return self._tokenizer.encode(problem.prompt, add_bos=True)

    def data_report(self) -> list[str]:
        return []  # generated problems: no data rows to drop

    @property
    def data_files(self) -> tuple[str, ...]:
        return ()

    def start(self, problem: Problem) -> CalculatorEpisode:
        if self.cfg.chat:
            raise ValueError("CalculatorConfig.chat=True is the calculator for agents (TaskConfig.name='agent' with "
                             "AgentConfig.source='calculator'); the calculator environment needs chat=False")
        return CalculatorEpisode(self, problem)

    def make_problem(self, a: int, b: int) -> Problem:
        return Problem(uid=f"{a}*{b}", prompt=f"{a}*{b}=", answer=str(a * b))

    @cached_property
    def _eval_pairs(self) -> list[tuple[int, int]]:
        rng = np.random.default_rng([self.cfg.seed, 0])
        lo, hi = 10 ** (self.cfg.digits - 1), 10 ** self.cfg.digits
        pairs: dict[tuple[int, int], None] = {}
        while len(pairs) < self.cfg.num_eval:
            pairs[tuple(int(x) for x in rng.integers(lo, hi, 2))] = None
        return list(pairs)

    def eval_problems(self) -> list[Problem]:
        return [self.make_problem(a, b) for a, b in self._eval_pairs]

    def train_problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"CalculatorEnv.train_problem: index must be >= 0, got {index}")
        rng = np.random.default_rng([self.cfg.seed, 1, index])
        lo, hi = 10 ** (self.cfg.digits - 1), 10 ** self.cfg.digits
        held_out = set(self._eval_pairs)
        while True:
            a, b = (int(x) for x in rng.integers(lo, hi, 2))
            if (a, b) not in held_out:
                return self.make_problem(a, b)

    def demonstration(self, problem: Problem, index: int) -> list[tuple[str, bool]]:
        """The teacher's transcript for training problem `index` as `(text, the model's?)` segments:
        a tool call, its result (the environment's, not trained on) and the answer; or, with
        probability `1 - teacher_tool_rate`, an estimate with the last two digits wrong."""
        rng = np.random.default_rng([self.cfg.seed, 2, index])
        calls = rng.random() < self.cfg.teacher_tool_rate
        guess = int(problem.answer) // 100 * 100 + int(rng.integers(0, 100))
        if guess == int(problem.answer):
            guess = guess + 1 if guess % 100 < 99 else guess - 1
        if self.cfg.chat:
            return calculator_chat.demonstration(problem, calls, guess)
        if calls:
            return [(f"[{problem.prompt[:-1]}]", True), (problem.answer + "|", False), (problem.answer, True)]
        return [(str(guess), True)]
