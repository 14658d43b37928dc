"""Tasks (environments) and their rewards; `make_task(TaskConfig)` builds one by name."""

from __future__ import annotations

import dataclasses

from tpurl.tasks.arithmetic import AdditionConfig, AdditionTask
from tpurl.tasks.base import Problem, Reward, Task, train_batch

TASKS = {"addition": AdditionTask}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task to run; `addition` takes its parameters from `addition`."""

    name: str = "addition"
    addition: AdditionConfig = AdditionConfig()

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"TaskConfig.name={self.name!r} is not a known task; use one of {sorted(TASKS)}")


def make_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg`."""
    if cfg.name == "addition":
        return AdditionTask(cfg.addition)
    raise ValueError(f"TaskConfig.name={cfg.name!r} is not a known task; use one of {sorted(TASKS)}")


__all__ = ["AdditionConfig", "AdditionTask", "Problem", "Reward", "Task", "TaskConfig", "TASKS", "make_task",
           "train_batch"]
