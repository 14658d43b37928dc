"""Tasks (environments) and their rewards; `make_task(TaskConfig)` builds one by name."""

from __future__ import annotations

import dataclasses

from tpurl.config_types import check_types
from tpurl.tasks.arithmetic import AdditionConfig, AdditionTask
from tpurl.tasks.base import Problem, Reward, Task, train_batch
from tpurl.tasks.math import MathConfig, MathTask

TASKS = {"addition": AdditionTask, "math": MathTask}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task to run; `addition` and `math` take their parameters from the field of that name.

    `tokenizer`: a Hugging Face tokenizer directory (`tokenizer.json`, e.g. the checkpoint's of
    `RLConfig.init_from`, which is the default there) to tokenize prompts and completions with;
    None: the task's built-in character tokenizer (for models trained from scratch)."""

    name: str = "addition"
    addition: AdditionConfig = AdditionConfig()
    math: MathConfig = MathConfig()
    tokenizer: str | None = None

    def replace(self, **changes) -> TaskConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_new_tokens(self) -> int:
        """The rollout length of the named task (known from the config, without building the task)."""
        return self.math.max_new_tokens if self.name == "math" else self.addition.max_new_tokens

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
    if cfg.name == "addition":
        return AdditionTask(cfg.addition, tokenizer=tokenizer)
    if cfg.name == "math":
        return MathTask(cfg.math, tokenizer=tokenizer)
    raise ValueError(f"TaskConfig.name={cfg.name!r} is not a known task; use one of {sorted(TASKS)}")


__all__ = ["AdditionConfig", "AdditionTask", "MathConfig", "MathTask", "Problem", "Reward", "Task", "TaskConfig",
           "TASKS", "make_task", "train_batch"]
