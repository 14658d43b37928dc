"""What tasks whose problems are rows of JSONL files share: reading, splits, prompts, the stream.

Each line of `train_file` (and `eval_file`) is a JSON object. The eval file is the held-out split;
without one, `num_eval` rows of the training file (a seeded choice) are held out and never trained
on. A subclass turns a row into a `Problem` (`make_problem`), or names why the row is unusable;
the prompt is `prompt_template` filled with the row's fields, rendered through the tokenizer's chat
template as one user turn (after an optional system turn) with the assistant's generation prompt,
so the policy sees exactly what it would see in a chat; `chat=False` uses the filled template as
plain text. Prompts longer than `max_prompt_tokens` are dropped when the task is built (as verl's
`filter_overlong_prompts`); `describe()` counts the dropped rows by reason. The training stream
is endless and deterministic: index `i` is item `order_e[i % n]` of epoch `e = i // n`, each epoch
a seeded permutation.

A task's config extends `JsonlConfig` with its row keys, its `prompt_template` and reward weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from tpurl.tasks.base import Problem, check_eos
from tpurl.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """What every JSONL task's config holds (see the module docstring). `train_file` is required
    when the task is used; `prompt_template` must have the field `TEMPLATE_FIELD`."""

    TEMPLATE_FIELD: ClassVar[str] = "prompt"
    train_file: str | None = None
    eval_file: str | None = None
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None
    chat: bool = True
    num_eval: int = 200
    max_prompt_tokens: int = 512
    max_new_tokens: int = 512
    seed: int = 0

    def __post_init__(self):
        name = type(self).__name__
        if "{" + self.TEMPLATE_FIELD + "}" not in self.prompt_template:
            raise ValueError(f"{name}.prompt_template={self.prompt_template!r} has no {{{self.TEMPLATE_FIELD}}} "
                             "field")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1 or self.num_eval < 1:
            raise ValueError(f"{name}: max_prompt_tokens, max_new_tokens and num_eval must be >= 1")


def read_jsonl(path: str, keys: list[str], owner: str, key_fields: tuple[str, ...]) -> list[dict]:
    """The rows of JSONL file `path`, each holding `keys` (blank lines skipped); errors name the
    line and the `owner` config fields that choose the keys."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{owner}: {path} does not exist")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
            missing = [k for k in keys if k not in row]
            if missing:
                raise ValueError(f"{path}:{n} has no {missing} field (has {sorted(row)}); set "
                                 f"{owner}.{' / '.join(key_fields)}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no problems")
    return rows


class JsonlTask:
    """A task over JSONL rows (see the module docstring). Subclasses set `name`, `KEY_FIELDS` (the
    config fields naming a row's required keys), `DROP_REASONS` and define `make_problem`."""

    name: str
    KEY_FIELDS: tuple[str, ...] = ()
    DROP_REASONS: tuple[str, ...] = ()

    def __init__(self, cfg: JsonlConfig, *, tokenizer: Tokenizer | None):
        owner = type(cfg).__name__
        if cfg.train_file is None:
            raise ValueError(f"TaskConfig.name={self.name!r} needs {owner}.train_file (a JSONL file of problems)")
        if tokenizer is None:
            raise ValueError(f"TaskConfig.name={self.name!r} needs a subword tokenizer: set TaskConfig.tokenizer (a "
                             "Hugging Face tokenizer directory) or RLConfig.init_from")
        check_eos(tokenizer, type(self).__name__)
        if cfg.chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{owner}.chat=True but the tokenizer has no chat template; add one "
                             f"(tokenizer_config.json or chat_template.jinja) or set {owner}.chat=False")
        self.cfg = cfg
        self._tokenizer = tokenizer
        keys = [getattr(cfg, f) for f in self.KEY_FIELDS]
        train = read_jsonl(cfg.train_file, keys, owner, self.KEY_FIELDS)
        if cfg.eval_file is not None:
            held_out = read_jsonl(cfg.eval_file, keys, owner, self.KEY_FIELDS)
        else:
            if cfg.num_eval >= len(train):
                raise ValueError(f"{owner}.num_eval={cfg.num_eval} leaves no training problems of the "
                                 f"{len(train)} in {cfg.train_file}; lower it or give an eval_file")
            chosen = set(np.random.default_rng([cfg.seed, 0]).choice(len(train), cfg.num_eval, replace=False).tolist())
            held_out = [x for i, x in enumerate(train) if i in chosen]
            train = [x for i, x in enumerate(train) if i not in chosen]
        self.dropped = dict.fromkeys(("overlong",) + self.DROP_REASONS, 0)
        self._ids: dict[str, list[int]] = {}  # prompt ids by problem uid, tokenized once
        self._order: tuple[int, np.ndarray | None] = (-1, None)
        self._train = self._fitting(train, "train")
        self._eval = self._fitting(held_out, "eval")

    def make_problem(self, row: dict, uid: str) -> tuple[Problem, Any] | str:
        """(the problem of `row`, what `demonstration` and scoring need of it), or the reason (one
        of `DROP_REASONS`) the row is dropped."""
        raise NotImplementedError

    def _fitting(self, rows: list[dict], split: str) -> list[tuple[Problem, list[int], Any]]:
        """(problem, prompt ids, payload) of the usable rows whose prompt fits `max_prompt_tokens`."""
        kept = []
        for i, row in enumerate(rows):
            made = self.make_problem(row, f"{split}:{i}")
            if isinstance(made, str):
                self.dropped[made] += 1
                continue
            problem, payload = made
            ids = self._prompt_ids(problem.prompt)
            if len(ids) > self.cfg.max_prompt_tokens:
                self.dropped["overlong"] += 1
                continue
            self._ids[problem.uid] = ids
            kept.append((problem, ids, payload))
        if not kept:
            raise ValueError(f"{type(self).__name__}: no {split} problem is left (dropped: {self.dropped}); check the "
                             f"data or raise {type(self.cfg).__name__}.max_prompt_tokens={self.cfg.max_prompt_tokens}")
        return kept

    def render(self, **fields: str) -> str:
        """The prompt text: the template filled with `fields`, through the chat template when `chat`."""
        text = self.cfg.prompt_template.format(**fields)
        if not self.cfg.chat:
            return text
        messages = ([{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else [])
        return self._tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}],
                                                   add_generation_prompt=True)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens

    @cached_property
    def max_prompt_len(self) -> int:
        return max(len(ids) for _, ids, _ in self._train + self._eval)

    def _prompt_ids(self, text: str) -> list[int]:
        # A chat template writes the model's BOS itself where it has one (as transformers'
        # `apply_chat_template(tokenize=True)` assumes); plain text gets BOS here.
        return self._tokenizer.encode(text) if self.cfg.chat else self._tokenizer.encode(text, add_bos=True)

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Prompt token ids (tokenized when the task was built)."""
        ids = self._ids.get(problem.uid)
        return list(ids) if ids is not None else self._prompt_ids(problem.prompt)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the training split (the current one is kept: a step's
        problems are consecutive indices)."""
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.cfg.seed, 1, epoch]).permutation(len(self._train)))
        return self._order[1]

    def _train_item(self, index: int) -> tuple[Problem, list[int], Any]:
        if index < 0:
            raise ValueError(f"{type(self).__name__}.train_problem: index must be >= 0, got {index}")
        n = len(self._train)
        return self._train[int(self._epoch_order(index // n)[index % n])]

    def train_problem(self, index: int) -> Problem:
        return self._train_item(index)[0]

    def eval_problems(self) -> list[Problem]:
        return [p for p, _, _ in self._eval]

    def describe(self) -> dict[str, Any]:
        """Split sizes and dropped rows by reason, for the run manifest."""
        return {"train": len(self._train), "eval": len(self._eval),
                **{f"dropped_{reason}": n for reason, n in self.dropped.items()}}
