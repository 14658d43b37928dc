"""Tasks and environments and their rewards; `make_task(TaskConfig)` builds one by name.

A task is single-turn (prompt -> completion -> `score`); an environment (`env.py`) runs episodes
of several turns (tool calls answered by observations). Both are registered in `TASKS`."""

from __future__ import annotations

import dataclasses

from tpurl.config_types import check_types
from tpurl.tasks.arithmetic import AdditionConfig, AdditionTask
from tpurl.tasks.base import Problem, Reward, Task, train_batch
from tpurl.tasks.calculator import CalculatorConfig, CalculatorEnv
from tpurl.tasks.code import CodeConfig, CodeTask
from tpurl.tasks.env import Environment, Episode, EpisodeLimits, episode_for, is_multi_turn
from tpurl.tasks.math import MathConfig, MathTask
from tpurl.tasks.python_tool import PythonToolConfig, PythonToolEnv

# name -> task class; `TaskConfig.<name>` holds that task's parameters.
TASKS = {"addition": AdditionTask, "math": MathTask, "code": CodeTask, "calculator": CalculatorEnv,
         "python_tool": PythonToolEnv}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task to run (a name in `TASKS`); the task takes its parameters from the field of that name.

    `tokenizer`: a Hugging Face tokenizer directory (`tokenizer.json`, e.g. the checkpoint's of
    `RLConfig.init_from`, which is the default there) to tokenize prompts and completions with;
    None: the task's built-in character tokenizer (for models trained from scratch)."""

    name: str = "addition"
    addition: AdditionConfig = AdditionConfig()
    math: MathConfig = MathConfig()
    code: CodeConfig = CodeConfig()
    calculator: CalculatorConfig = CalculatorConfig()
    python_tool: PythonToolConfig = PythonToolConfig()
    tokenizer: str | None = None

    def replace(self, **changes) -> TaskConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_new_tokens(self) -> int:
        """The rollout length of the named task (known from the config, without building the task)."""
        return self.params.max_new_tokens

    @property
    def params(self):
        """The named task's own config (`addition`, `math` or `code`)."""
        return getattr(self, self.name)

    def __post_init__(self):
        check_types(self)
        if self.name not in TASKS:
            raise ValueError(f"TaskConfig.name={self.name!r} is not a known task; use one of {sorted(TASKS)}")


def make_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg` (a data task reads and tokenizes its files here: build it once)."""
    tokenizer = None
    if cfg.tokenizer is not None:
        from tpurl.tokenizer import load_hf_tokenizer

        try:
            tokenizer = load_hf_tokenizer(cfg.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"TaskConfig.tokenizer: {e}") from None
    return TASKS[cfg.name](cfg.params, tokenizer=tokenizer)


__all__ = ["AdditionConfig", "AdditionTask", "CalculatorConfig", "CalculatorEnv", "CodeConfig", "CodeTask",
           "Environment", "Episode", "EpisodeLimits", "episode_for", "is_multi_turn", "MathConfig", "MathTask",
           "PythonToolConfig", "PythonToolEnv", "Problem", "Reward", "Task", "TaskConfig", "TASKS", "make_task", "train_batch"]
