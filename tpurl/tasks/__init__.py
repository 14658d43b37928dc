"""Tasks and environments and their rewards; `make_task(TaskConfig)` builds one by name.

A task is single-turn (prompt -> completion -> `score`); an environment (`env.py`) runs episodes
of several turns (tool calls answered by observations). `TaskConfig.name` is a built-in name of
`TASKS` or the import path of a user's class (`"my_pkg.tasks:MyTask"`): one with the methods of
`Task` (or `Environment`), built as `MyTask(config, tokenizer=tokenizer)`, where `config` is
`MyTask.Config(**TaskConfig.options)` when the class has a `Config` (a dataclass), else the
options as a dict, and `tokenizer` the one `TaskConfig.tokenizer` names (None: the task brings its
own). The built-in `custom` task takes a reward function by import path instead (`custom.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from tpurl.config_types import check_types
from tpurl.tasks.agent import AgentConfig, AgentTask
from tpurl.tasks.arithmetic import AdditionConfig, AdditionTask
from tpurl.tasks.base import Problem, Reward, Task, train_batch
from tpurl.tasks.calculator import CalculatorConfig, CalculatorEnv
from tpurl.tasks.code import CodeConfig, CodeTask
from tpurl.tasks.custom import CustomConfig, CustomTask
from tpurl.tasks.env import Environment, Episode, EpisodeLimits, episode_for, is_multi_turn
from tpurl.tasks.imports import import_object, is_import_path, source_file
from tpurl.tasks.math import MathConfig, MathTask
from tpurl.tasks.python_tool import PythonToolConfig, PythonToolEnv

# name -> task class; `TaskConfig.<name>` holds that task's parameters.
TASKS = {"addition": AdditionTask, "math": MathTask, "code": CodeTask, "custom": CustomTask,
         "calculator": CalculatorEnv, "python_tool": PythonToolEnv, "agent": AgentTask}
# What a class named by import path must have (an environment has `start` in place of `score`).
_TASK_METHODS = ("encode_prompt", "train_problem", "eval_problems")


def task_class(name: str) -> type:
    """The task class `name` names: a built-in one, or a user's by import path (imported here)."""
    if name in TASKS:
        return TASKS[name]
    if not is_import_path(name):
        raise ValueError(f"TaskConfig.name={name!r} is not a known task; use one of {sorted(TASKS)} or the import "
                         "path of your own task class, 'package.module:Class'")
    cls = import_object(name, "TaskConfig.name")
    missing = [m for m in _TASK_METHODS if not hasattr(cls, m)]
    if not isinstance(cls, type) or missing or not (hasattr(cls, "score") or hasattr(cls, "start")):
        what = f"lacks {missing or ['score (or start)']}" if isinstance(cls, type) else f"is a {type(cls).__name__}"
        raise ValueError(f"TaskConfig.name={name!r} {what}; name a task class (see tpurl.tasks.Task)")
    return cls


def _task_params(cls: type, options: Mapping[str, Any], name: str):
    """The config a user's task class is built with (see the module docstring)."""
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        return dict(options)
    try:
        return config_cls(**options)
    except TypeError as e:
        raise ValueError(f"TaskConfig.options={dict(options)!r} for {name}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task to run: a name in `TASKS` (the task takes its parameters from the field of that
    name) or a task class's import path (its parameters: `options`, a dict in gin).

    `tokenizer`: a Hugging Face tokenizer directory (`tokenizer.json`, e.g. the checkpoint's of
    `RLConfig.init_from`, which is the default there) to tokenize prompts and completions with;
    None: the task's built-in character tokenizer (for models trained from scratch)."""

    name: str = "addition"
    addition: AdditionConfig = AdditionConfig()
    math: MathConfig = MathConfig()
    code: CodeConfig = CodeConfig()
    custom: CustomConfig = CustomConfig()
    calculator: CalculatorConfig = CalculatorConfig()
    python_tool: PythonToolConfig = PythonToolConfig()
    agent: AgentConfig = AgentConfig()
    options: tuple[tuple[str, Any], ...] = ()
    tokenizer: str | None = None

    def replace(self, **changes) -> TaskConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_new_tokens(self) -> int:
        """The rollout length of the named task (known from the config, without building the task)."""
        return self.params.max_new_tokens

    @property
    def params(self):
        """The named task's own config (`addition`, `math`, ...; a user's class's, from `options`)."""
        if self.name in TASKS:
            return getattr(self, self.name)
        return _task_params(task_class(self.name), dict(self.options), self.name)

    def __post_init__(self):
        if isinstance(self.options, Mapping):  # gin's dict, kept as pairs (a frozen config is hashable)
            object.__setattr__(self, "options", tuple(self.options.items()))
        check_types(self)
        object.__setattr__(self, "options", tuple(tuple(p) for p in self.options))
        if self.options and self.name in TASKS and not (self.name == "agent" and self.agent.source not in TASKS):
            raise ValueError(f"TaskConfig.options are for a task class named by import path; {self.name!r} takes "
                             f"its parameters from TaskConfig.{self.name}")
        self.params  # noqa: B018 - imports a user's class and checks its options: one line, at once
        if self.name == "agent" and self.agent.source not in TASKS and not is_import_path(self.agent.source):
            raise ValueError(f"AgentConfig.source={self.agent.source!r} is not a known task; use one of "
                             f"{sorted(set(TASKS) - {'agent'})} or a task class's import path")


def user_code(cfg: TaskConfig) -> dict[str, str | None]:
    """The user's code the task runs, by import path: its source file (for the run manifest)."""
    paths = [cfg.name] if cfg.name not in TASKS else []
    if cfg.name == "custom" and cfg.custom.reward_fn:
        import_object(cfg.custom.reward_fn, "CustomConfig.reward_fn")
        paths.append(cfg.custom.reward_fn)
    if cfg.name == "agent" and cfg.agent.agent:
        import_object(cfg.agent.agent, "AgentConfig.agent")
        paths.append(cfg.agent.agent)
    return {p: source_file(p) for p in paths}


def make_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg` (a data task reads and tokenizes its files here: build it once)."""
    tokenizer = None
    if cfg.tokenizer is not None:
        from tpurl.tokenizer import load_hf_tokenizer

        try:
            tokenizer = load_hf_tokenizer(cfg.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"TaskConfig.tokenizer: {e}") from None
    if cfg.name == "agent":
        return AgentTask(cfg.agent, make_task(cfg.replace(name=cfg.agent.source, options=cfg.options)))
    return task_class(cfg.name)(cfg.params, tokenizer=tokenizer)


__all__ = ["AdditionConfig", "AdditionTask", "AgentConfig", "AgentTask", "CalculatorConfig", "CalculatorEnv", "CodeConfig", "CodeTask",
           "CustomConfig", "CustomTask", "task_class", "user_code",
           "Environment", "Episode", "EpisodeLimits", "episode_for", "is_multi_turn", "MathConfig", "MathTask",
           "PythonToolConfig", "PythonToolEnv", "Problem", "Reward", "Task", "TaskConfig", "TASKS", "make_task", "train_batch"]
