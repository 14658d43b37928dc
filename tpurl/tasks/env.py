"""Environments: episodes of one or more model turns, with explicit termination and named rewards.

An episode starts from a problem (its prompt is the initial observation). Each model turn is an
action: the engine decodes until the turn ends (EOS, or one of the environment's stop strings,
e.g. the end of a tool call), then hands the turn to the episode (`Episode.observe`). The episode
answers with observation token ids (a tool result, rendered with the chat template where the
tokenizer has one), which the engine appends to the sequence by a prefill at its position, or with
None: the episode is over. Termination is explicit: the episode ends when the model gives its
answer (a turn without a tool call), when `EpisodeLimits.max_turns` or `max_tool_calls` is
reached, or when the engine's token budget (`max_new_tokens`, model and environment tokens
together) runs out (`finish_reason="length"`). `Episode.finish` then grades the whole transcript
into a `Reward` of named components; `Episode.info` holds what the trajectory log keeps (tool
calls, tool errors, turns).

A task without `start` is single-turn: `episode_for` wraps it as a one-step environment whose
reward is exactly `task.score` (today's tasks, unchanged results).

Failures of untrusted parts are contained per sample: an `observe` or `finish` that raises ends or
grades that episode with zero reward and records the error (`run_observe`, `run_finish`); the
run goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from tpurl.config_types import check_types
from tpurl.tasks.base import Problem, Reward, Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Explicit termination of a multi-turn episode: at most `max_turns` model turns and
    `max_tool_calls` tool calls (the turn that reaches either is the last)."""

    max_turns: int = 4
    max_tool_calls: int = 3

    def __post_init__(self):
        check_types(self)
        if self.max_turns < 1 or self.max_tool_calls < 0:
            raise ValueError(f"EpisodeLimits: need max_turns >= 1 and max_tool_calls >= 0, got {self.max_turns}, "
                             f"{self.max_tool_calls}")


class Episode(Protocol):
    """One sample's episode (see the module docstring)."""

    info: dict[str, Any]

    def observe(self, turn_ids: Sequence[int], turn_text: str) -> list[int] | None:
        """The environment's answer to a model turn: observation ids to append, or None (over)."""
        ...

    def finish(self, text: str, finish_reason: str) -> Reward:
        """The reward of the whole transcript (`text`: everything after the prompt)."""
        ...


DEFAULT_TOOL_WORKERS = 8


class Environment(Task, Protocol):
    """A task whose episodes may span several turns. Its turns (tool calls) run on at most
    `tool_workers(env)` threads beside decoding: an environment's `tool_workers` attribute (e.g.
    the Python tool's sandbox pool size), else `DEFAULT_TOOL_WORKERS`."""

    def start(self, problem: Problem) -> Episode: ...


class OneStep:
    """The one-step episode of a single-turn task: no observation, reward `task.score`."""

    def __init__(self, task: Task, problem: Problem):
        self.task, self.problem = task, problem
        self.info: dict[str, Any] = {}

    def observe(self, turn_ids: Sequence[int], turn_text: str) -> list[int] | None:
        return None

    def finish(self, text: str, finish_reason: str) -> Reward:
        return self.task.score(self.problem, text, finish_reason)


def is_multi_turn(task: Task) -> bool:
    return hasattr(task, "start")


def tool_workers(task: Task) -> int:
    """How many of an environment's turns may run at once (see `Environment`)."""
    return int(getattr(task, "tool_workers", DEFAULT_TOOL_WORKERS))


def episode_for(task: Task, problem: Problem) -> Episode:
    """A new episode of `problem` (a one-step episode for a single-turn task)."""
    return task.start(problem) if is_multi_turn(task) else OneStep(task, problem)


def run_observe(episode: Episode, turn_ids: Sequence[int], turn_text: str) -> list[int] | None:
    """`episode.observe` as a list of token ids, with an exception (or an observation that is not
    token ids) ending the episode and recorded in its info."""
    try:
        obs = episode.observe(turn_ids, turn_text)
        return None if obs is None else [int(t) for t in obs]
    except Exception as e:  # an environment's failure is that sample's, not the run's
        episode.info["error"] = f"observe: {type(e).__name__}: {e}"
        return None


def run_finish(episode: Episode, components: Sequence[str], text: str, finish_reason: str) -> Reward:
    """`episode.finish`, with an exception giving every component 0; the error (or the one the
    grader reported in `Reward.error`) is recorded in the info."""
    try:
        reward = episode.finish(text, finish_reason)
    except Exception as e:  # a grader's failure is that sample's, not the run's
        episode.info["error"] = f"finish: {type(e).__name__}: {e}"
        return Reward(components={name: 0.0 for name in components}, total=0.0)
    if reward.error is not None:
        episode.info["error"] = reward.error
    return reward


class ToolEpisode:
    """An episode whose turns are tool calls or the answer: a turn that contains `call_end` (where
    the engine stopped it) is a call, answered by `call` until `limits` end the episode; any other
    turn is the answer (`self.answer`). Subclasses define `call` and `finish`; `info` counts the
    turns, calls and failed calls, and `tool_components` turns them into reward components."""

    def __init__(self, limits: EpisodeLimits, call_end: str):
        self.limits, self.call_end = limits, call_end
        self.answer: str | None = None
        self.info: dict[str, Any] = {"tool_calls": 0, "tool_errors": 0, "turns": 0}

    def observe(self, turn_ids: Sequence[int], turn_text: str) -> list[int] | None:
        self.info["turns"] += 1
        end = turn_text.rfind(self.call_end)  # the stop string may end inside the turn's last token
        if end < 0:
            self.answer = turn_text
            return None
        if self.info["tool_calls"] >= self.limits.max_tool_calls or self.info["turns"] >= self.limits.max_turns:
            return None  # out of calls or turns: the episode ends unanswered
        self.info["tool_calls"] += 1
        observation, failed = self.call(turn_text[:end + len(self.call_end)])
        self.info["tool_errors"] += int(failed)
        return observation

    def call(self, text: str) -> tuple[list[int], bool]:
        """The observation ids answering the call that ends `text`, and whether the call failed."""
        raise NotImplementedError

    def tool_components(self) -> dict[str, float]:
        return {"tool_calls": float(self.info["tool_calls"]), "tool_error": float(self.info["tool_errors"] > 0)}

