"""The task (environment) interface: problems, reference answers, reward components, termination.

A task is single-turn: the policy sees `Problem.prompt`, generates until it emits a stop token /
stop string or runs out of `max_new_tokens` (termination; the stop token is the tokenizer's EOS
unless the task sets `stop_at_eos = False`, `stop_token_ids`), and `Task.score` turns the completion
into a `Reward` whose components are all kept (the loop logs every one; the scalar `total` is what
advantages are computed from). Problems come from two disjoint splits: an endless, deterministic
training stream indexed by a cursor (so a resumed run sees exactly the problems it would have
seen) and a fixed held-out list used only for evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

from tpurl.tokenizer import Tokenizer

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer. `uid` is stable across runs and splits."""

    uid: str
    prompt: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Reward:
    """Every reward component by name and the weighted total the advantages use; `error`: why
    the grader could not score the sample (its components are then 0), kept in its trajectory."""

    components: Mapping[str, float]
    total: float
    error: str | None = None


class Task(Protocol):
    """What the RL loop needs from an environment."""

    name: str
    version: str  # bump when prompts, splits or grading change: results are comparable only within a version
    # Optional: `stop_at_eos = False` turns off stopping at the tokenizer's EOS (`stop_token_ids`).

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def reward_components(self) -> tuple[str, ...]: ...

    @property
    def stop_strings(self) -> tuple[str, ...]: ...

    @property
    def max_new_tokens(self) -> int: ...

    def encode_prompt(self, problem: Problem) -> list[int]:
        """The prompt's token ids as the policy sees them (BOS, chat template and all)."""
        ...

    def train_problem(self, index: int) -> Problem: ...

    def eval_problems(self) -> Sequence[Problem]: ...

    def demonstration(self, problem: Problem, index: int) -> str:
        """The supervised warm-start target for training problem `index` (usually the answer)."""
        ...

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward: ...

    def data_report(self) -> list[str]:
        """What a person should know about the data before training on it, one line each (rows
        dropped, with counts per reason); empty when there is nothing to say."""
        ...

    @property
    def data_files(self) -> tuple[str, ...]:
        """The files the problems are read from (none for generated tasks)."""
        ...


class TaskBase:
    """The accessors every built-in task shares: it keeps its config in `cfg` (with a
    `max_new_tokens`) and its tokenizer in `_tokenizer`."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens


def check_eos(tokenizer: Tokenizer, task: str) -> None:
    """Every completion ends with the tokenizer's EOS token (the engine's stop token): refuse a
    tokenizer without one."""
    if tokenizer.eos_id is None:
        raise ValueError(f"{task}: the tokenizer has no eos_token, which ends every completion; set eos_token in "
                         "its tokenizer_config.json")


def stop_token_ids(task: Task) -> tuple[int, ...]:
    """The token ids that end a completion: the tokenizer's EOS, or none for a task whose
    `stop_at_eos` attribute is False (fixed-length completions, as a benchmark's: every sample runs
    to `max_new_tokens`). A task without the attribute stops at EOS."""
    return (task.tokenizer.eos_id,) if getattr(task, "stop_at_eos", True) else ()


def train_batch(task: Task, cursor: int, num_prompts: int) -> tuple[list[Problem], int]:
    """The `num_prompts` training problems starting at `cursor`, and the advanced cursor."""
    if cursor < 0 or num_prompts <= 0:
        raise ValueError(f"train_batch: need cursor >= 0 and num_prompts > 0, got {cursor}, {num_prompts}")
    return [task.train_problem(cursor + i) for i in range(num_prompts)], cursor + num_prompts


NO_SANDBOX = "none"


def sandbox_of(task) -> str:
    """The isolation a task's tools and graders run in (its `describe()["sandbox"]`), or "none"
    for a task that runs no untrusted code (and may have no `describe`)."""
    return dict(task.describe()).get("sandbox", NO_SANDBOX) if hasattr(task, "describe") else NO_SANDBOX
