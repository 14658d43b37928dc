"""Math with a Python tool: the model writes code, the sandbox runs it, its output comes back.

The problems, prompts and final-answer grading are the `math` task's (JSONL, chat-templated,
`tpurl.tasks.math`). A model turn that ends at `tool_stop` (default `</python>`; the engine stops
there, possibly inside the turn's last token) is a tool call:
the code is the text after the turn's last `tool_start` (default `<python>`; the whole turn when
there is none), run in the sandbox (`tpurl.sandbox.run_python`: a fresh process under limits, no
network). Its stdout (or, when it fails, the tail of stderr, or `timeout`), cut to
`max_output_chars`, is the observation, rendered as a `tool` turn through the chat template when
the tokenizer has one (the suffix that closes the assistant's turn and opens the next), else with
`observation_template`. A turn that ends at EOS is the answer, graded by the math grader.

Termination: the answer turn, `limits.max_turns`, `limits.max_tool_calls`, or the token budget.
Reward components: `correct` and `format` (the math task's, of the answer turn), `tool_calls`
(calls made) and `tool_error` (1 if a call exited non-zero or timed out). A sandbox that fails
itself ends the episode; the error is in its info (the run goes on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpurl.sandbox import SandboxConfig, run_python, sandbox_mechanisms
from tpurl.tasks.base import Problem, Reward
from tpurl.tasks.env import EpisodeLimits, ToolEpisode
from tpurl.tasks.math import MathConfig, MathTask

_SENTINEL = "\u241e"  # marks where the assistant's text ends in a rendered chat (never in real text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonToolConfig(MathConfig):
    """The `python_tool` environment: `MathConfig`'s data and grading plus the tool's markers,
    output cap, observation template (without a chat template), sandbox limits and episode limits."""

    tool_start: str = "<python>"
    tool_stop: str = "</python>"
    max_output_chars: int = 512
    observation_template: str = "\n<output>\n{output}\n</output>\n"
    sandbox: SandboxConfig = SandboxConfig(timeout_s=5.0, memory_mb=512)
    limits: EpisodeLimits = EpisodeLimits(max_turns=4, max_tool_calls=3)

    def __post_init__(self):
        super().__post_init__()
        if not self.tool_stop:
            raise ValueError("PythonToolConfig.tool_stop must be a non-empty string (it ends a tool call)")
        if self.max_output_chars < 1:
            raise ValueError(f"PythonToolConfig.max_output_chars={self.max_output_chars} must be >= 1")
        if "{output}" not in self.observation_template:
            raise ValueError("PythonToolConfig.observation_template must contain {output}")


class PythonToolEpisode(ToolEpisode):
    """One problem's episode: code turns run in the sandbox, the answer turn graded."""

    def __init__(self, env: PythonToolEnv, problem: Problem):
        super().__init__(env.cfg.limits, call_end=env.cfg.tool_stop)
        self.env, self.problem = env, problem

    def call(self, text: str) -> tuple[list[int], bool]:
        cfg = self.env.cfg
        body = text[:-len(cfg.tool_stop)]
        code = body.rsplit(cfg.tool_start, 1)[1] if cfg.tool_start and cfg.tool_start in body else body
        run = run_python(code, config=cfg.sandbox)
        failed = run.timed_out or run.returncode != 0
        if run.timed_out:
            output = "timeout"
        else:
            output = (run.stderr if failed else run.stdout).decode("utf-8", "replace")
        output = output[-cfg.max_output_chars:] if failed else output[:cfg.max_output_chars]
        return self.env.observation_ids(output), failed

    def finish(self, text: str, finish_reason: str) -> Reward:
        graded = self.env.score(self.problem, self.answer or "", finish_reason if self.answer is not None else "length")
        return Reward(components={**graded.components, **self.tool_components()}, total=graded.total,
                      error=graded.error)


class PythonToolEnv(MathTask):
    """Math problems with a sandboxed Python tool (see the module docstring)."""

    name = "python_tool"
    version = "python-tool-v2"
    reward_components = ("correct", "format", "tool_calls", "tool_error")

    @property
    def grader(self) -> str:
        return f"{self.checker.name}+sandbox"

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.cfg.tool_stop,)

    def start(self, problem: Problem) -> PythonToolEpisode:
        return PythonToolEpisode(self, problem)

    @property
    def tool_workers(self) -> int:
        """Tool calls in flight at once: the sandbox's pool size (`SandboxConfig.workers`)."""
        return self.cfg.sandbox.num_workers

    def describe(self) -> dict[str, Any]:
        """The math task's description plus the isolation the tool's code runs under."""
        return {**super().describe(), "sandbox": sandbox_mechanisms(self.cfg.sandbox)}

    def observation_ids(self, output: str) -> list[int]:
        """The token ids of a tool result: a `tool` turn of the chat template (closing the
        assistant's turn, opening the next), or `observation_template` without one."""
        tok = self.tokenizer
        if self.cfg.chat and getattr(tok, "chat_template", None) is not None:
            before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
            rendered = tok.apply_chat_template(before + [{"role": "tool", "content": output}],
                                               add_generation_prompt=True)
            if _SENTINEL in rendered:
                return tok.encode(rendered.split(_SENTINEL, 1)[1])
        return tok.encode(self.cfg.observation_template.format(output=output))
