"""Your data, your reward: rows of a JSONL file or a Hugging Face dataset, scored by a function of
your own named by import path (`CustomConfig.reward_fn = "my_pkg.rewards:score"`).

The prompt is `prompt_template` filled with the row's fields by name (`"{question}"`, `"Solve:
{problem}"`), rendered through the tokenizer's chat template as in every data task (`jsonl.py`).
The reward function (`reward_fn.py` for the forms it may take) gets that filled text, the
completion's text and the whole row:

    def score(prompt: str, completion: str, row: dict) -> float | dict[str, float]

`reward_weights` names the reward components and their weights in the total (a dict in gin,
`{"correct": 1.0, "format": 0.1}`); a function returning a number has one component. A completion
cut off at `max_new_tokens` gets zero reward without a call unless `score_truncated`. `answer_key`
names the row's reference answer, when it has one: it is the problem's answer in the trajectory
log and the warm start's demonstration.

The function runs in the training process: it is the user's own code, not a model's (code a model
writes goes to the sandbox, as in the `code` task). A call that raises, hangs past `timeout_s` or
returns a NaN is that sample's zero reward with its error in the trajectory; the run goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Sequence

from tpurl.tasks.base import FINISH_REASONS, Problem, Reward
from tpurl.tasks.imports import is_import_path
from tpurl.tasks.jsonl import JsonlConfig, JsonlTask, template_fields
from tpurl.tasks.reward_fn import RewardFunction, check_reward_weights
from tpurl.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomConfig(JsonlConfig):
    """The `custom` task (see the module docstring and `JsonlConfig` for the shared fields)."""

    TEMPLATE_FIELD: ClassVar[str | None] = None  # any of the row's fields
    reward_fn: str | None = None
    reward_weights: tuple[tuple[str, float], ...] = (("reward", 1.0),)
    answer_key: str | None = None
    batched: bool = False
    score_truncated: bool = False
    timeout_s: float = 30.0
    workers: int = 8

    def __post_init__(self):
        if isinstance(self.reward_weights, Mapping):  # gin's dict, kept in order as pairs
            object.__setattr__(self, "reward_weights", tuple(self.reward_weights.items()))
        super().__post_init__()
        object.__setattr__(self, "reward_weights", tuple(tuple(p) for p in self.reward_weights))
        if self.reward_fn is not None and not is_import_path(self.reward_fn):
            raise ValueError(f"CustomConfig.reward_fn={self.reward_fn!r} is not an import path; write "
                             "'package.module:function'")
        check_reward_weights(self.reward_weights, "CustomConfig.reward_weights")
        if not template_fields(self.prompt_template, "CustomConfig.prompt_template"):
            raise ValueError(f"CustomConfig.prompt_template={self.prompt_template!r} names no field of the rows; "
                             "write e.g. '{prompt}'")
        if not 0 < self.timeout_s <= 86400 or self.workers < 1:
            raise ValueError(f"CustomConfig: need 0 < timeout_s <= 86400 and workers >= 1, got {self.timeout_s}, "
                             f"{self.workers}")


class CustomTask(JsonlTask):
    """Rows scored by the user's reward function (see the module docstring)."""

    name = "custom"
    version = "custom-v1"
    stop_strings: tuple[str, ...] = ()

    def __init__(self, cfg: CustomConfig, *, tokenizer: Tokenizer | None):
        if cfg.reward_fn is None:
            raise ValueError("TaskConfig.name='custom' needs CustomConfig.reward_fn, e.g. 'my_pkg.rewards:score'")
        self.weights = dict(cfg.reward_weights)
        self.reward = RewardFunction(cfg.reward_fn, tuple(self.weights), batched=cfg.batched,
                                     timeout_s=cfg.timeout_s, workers=cfg.workers)
        self._rows: dict[str, tuple[str, dict]] = {}  # uid -> (the filled template, the row)
        super().__init__(cfg, tokenizer=tokenizer)

    @property
    def grader(self) -> str:
        return self.cfg.reward_fn

    @property
    def reward_components(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def row_keys(self) -> tuple[list[str], tuple[str, ...], tuple[str, ...]]:
        fields = template_fields(self.cfg.prompt_template, "CustomConfig.prompt_template")
        answer = (self.cfg.answer_key,) if self.cfg.answer_key else ()
        return list(dict.fromkeys(fields + answer)), fields + answer, ("prompt_template",) + (
            ("answer_key",) if answer else ())

    def make_problem(self, row: dict, uid: str) -> tuple[Problem, str | None]:
        fields = template_fields(self.cfg.prompt_template, "CustomConfig.prompt_template")
        asked = self.cfg.prompt_template.format(**{k: row[k] for k in fields})
        answer = row[self.cfg.answer_key] if self.cfg.answer_key else None
        self._rows[uid] = (asked, row)
        return Problem(uid=uid, prompt=self.render_text(asked), answer=answer or ""), answer

    def demonstration(self, problem: Problem, index: int) -> str:
        answer = self._train_item(index)[2]
        if answer is None:
            raise ValueError("CustomTask: a warm start needs each row's answer; set CustomConfig.answer_key or "
                             "SFTConfig.steps=0")
        return answer

    def score(self, problem: Problem, completion: str, finish_reason: str) -> Reward:
        return self.score_batch([problem], [completion], [finish_reason])[0]

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[Reward]:
        """Every sample's reward; the reward function sees the ones that stopped (all of them with
        `score_truncated`)."""
        for reason in finish_reasons:
            if reason not in FINISH_REASONS:
                raise ValueError(f"CustomTask.score: finish_reason {reason!r} is not one of {FINISH_REASONS}")
        called = [i for i, r in enumerate(finish_reasons) if r == "stop" or self.cfg.score_truncated]
        scored = self.reward([self._rows[problems[i].uid][0] for i in called], [completions[i] for i in called],
                             [dict(self._rows[problems[i].uid][1]) for i in called])
        out = [self._reward(None, None) for _ in problems]
        for i, s in zip(called, scored):
            out[i] = self._reward(s.components, s.error)
        return out

    def _reward(self, components: Mapping[str, float] | None, error: str | None) -> Reward:
        comps = dict(components) if components is not None else {n: 0.0 for n in self.weights}
        return Reward(components=comps, total=sum(self.weights[n] * v for n, v in comps.items()), error=error)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "reward_fn": self.cfg.reward_fn, "reward_weights": self.weights}
