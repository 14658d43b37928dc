"""What tasks whose problems are rows of data files share: reading, splits, prompts, the stream.

`train_file` (and `eval_file`) is a JSONL file, each line a JSON object, or local Hugging Face
`datasets` data (a `save_to_disk` directory, `.parquet`, `.arrow`; `hf_datasets.py`), whose
columns the task's `*_key` fields name. The held-out split is `eval_file`, else the `eval_split`
of a saved dataset's `train_file` (`train_split` is the one trained on), else `num_eval` rows of
the training data (a seeded choice), never trained on. A subclass turns a row into a `Problem` (`make_problem`), or names why the row is unusable;
the prompt is `prompt_template` filled with the row's fields, rendered through the tokenizer's chat
template as one user turn (after an optional system turn) with the assistant's generation prompt,
so the policy sees exactly what it would see in a chat; `chat=False` uses the filled template as
plain text. The training stream is endless and deterministic: index `i` is item `order_e[i % n]`
of epoch `e = i // n`, each epoch a seeded permutation.

Rows are dropped when the task is built, counted per file and reason (`describe`) and reported
(`data_report`, which `tpurl train` prints): a prompt longer than `max_prompt_tokens` (as verl's
`filter_overlong_prompts`), a text field (`TEXT_FIELDS`) that is null or not text (numbers are
written out), and the subclass's own reasons. A line that is not UTF-8, not JSON, not an object
or lacks a key is an error naming the file and line.

A task's config extends `JsonlConfig` with its row keys, its `prompt_template` and reward weights.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import string
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from tpurl.config_types import check_types
from tpurl.tasks.base import Problem, TaskBase, check_eos
from tpurl.tasks.hf_datasets import is_dataset_path, load_rows
from tpurl.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """What every JSONL task's config holds (see the module docstring). `train_file` is required
    when the task is used; `prompt_template` must have the field `TEMPLATE_FIELD`."""

    TEMPLATE_FIELD: ClassVar[str | None] = "prompt"  # None: any of the row's fields
    train_file: str | None = None
    eval_file: str | None = None
    train_split: str | None = "train"
    eval_split: str | None = None
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None
    chat: bool = True
    num_eval: int = 200
    max_prompt_tokens: int = 512
    max_new_tokens: int = 512
    seed: int = 0

    def __post_init__(self):
        check_types(self)
        name = type(self).__name__
        fields = template_fields(self.prompt_template, f"{name}.prompt_template")
        if self.TEMPLATE_FIELD is not None and self.TEMPLATE_FIELD not in fields:
            raise ValueError(f"{name}.prompt_template={self.prompt_template!r} has no {{{self.TEMPLATE_FIELD}}} "
                             "field")
        other = [f for f in fields if f != self.TEMPLATE_FIELD]
        if self.TEMPLATE_FIELD is not None and other:
            raise ValueError(f"{name}.prompt_template={self.prompt_template!r} names {{{other[0]}}}, which the task "
                             f"does not fill: it fills {{{self.TEMPLATE_FIELD}}} only (write a literal brace as "
                             "{{ or }})")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1 or self.num_eval < 1:
            raise ValueError(f"{name}: max_prompt_tokens, max_new_tokens and num_eval must be >= 1")


def template_fields(template: str, what: str) -> tuple[str, ...]:
    """The row fields `template` fills (`"{a} and {b}"`: a, b); `what` names it in the one-line
    error for a template `str.format` cannot fill (an unmatched brace, a positional `{}`)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{what}={template!r} is not a format string ({e}); write a literal brace as {{{{ or }}}}"
                         ) from None
    if any(not n or n.isdigit() for n in names):
        raise ValueError(f"{what}={template!r} has a positional field ({{}}); name a field of the rows, e.g. "
                         "{question}")
    return tuple(dict.fromkeys(n.split(".")[0].split("[")[0] for n in names))


def text_of(value) -> str | None:
    """A field as text: a string as it is, a number written out; None for anything else (null, a
    list, an object), which has no text to train on."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _parse_line(raw: bytes, path: str, n: int, keys: list[str], owner: str, key_fields: tuple[str, ...]) -> dict | None:
    """Line `n` of `path` as a row holding `keys` (None: a blank line); errors name the file and line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{n} is not valid UTF-8 ({e.reason} at byte {e.start} of the line); save the file "
                         "as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n} is a JSON {type(row).__name__}, not an object with "
                         f"{' and '.join(repr(k) for k in keys)} fields; write one object per line")
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}:{n} has no {missing} field (has {sorted(row)}); set {owner}.{' / '.join(key_fields)}")
    return row


def read_jsonl(path: str, keys: list[str], owner: str, key_fields: tuple[str, ...],
               text_keys: tuple[str, ...] = ()) -> tuple[list[dict], int]:
    """The rows of JSONL file `path`, each holding `keys`, with `text_keys` as text (blank lines
    skipped), and how many rows were dropped for a null or non-text `text_keys` field."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{owner}: {path} does not exist")
    with open(path, "rb") as f:
        parsed = (_parse_line(raw, path, n, keys, owner, key_fields) for n, raw in enumerate(f, 1))
        return _text_rows((row for row in parsed if row is not None), path, text_keys)


def _text_rows(rows, path: str, text_keys: tuple[str, ...]) -> tuple[list[dict], int]:
    """The rows whose `text_keys` are text (as text), and how many were dropped for not being."""
    kept, not_text = [], 0
    for row in rows:
        texts = {k: text_of(row[k]) for k in text_keys}
        if any(v is None for v in texts.values()):
            not_text += 1
            continue
        kept.append({**row, **texts})
    if not kept:
        raise _no_rows(path, not_text, text_keys)
    return kept, not_text


def _no_rows(path: str, not_text: int, text_keys: tuple[str, ...]) -> ValueError:
    return ValueError(f"{path} holds no problems" + (
        f": all {not_text} rows have a null or non-text {' or '.join(repr(k) for k in text_keys)}"
        if not_text else ""))


def read_rows(path: str, keys: list[str], owner: str, key_fields: tuple[str, ...], text_keys: tuple[str, ...],
              split: str | None, split_field: str) -> tuple[list[dict], int]:
    """`read_jsonl` for every kind of data file: JSONL natively, a saved Hugging Face dataset,
    parquet or arrow through `datasets` (`hf_datasets.py`; split `split` where it has several)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{owner}: {path} does not exist; tpurl reads local files only (for a dataset on "
                                "the Hugging Face hub: datasets.load_dataset(NAME).save_to_disk(DIR) where the hub "
                                "is reachable, then pass DIR)")
    if not is_dataset_path(path):
        return read_jsonl(path, keys, owner, key_fields, text_keys)
    return _text_rows(_with_columns(load_rows(path, split, owner, split_field), path, keys, owner, key_fields),
                      path, text_keys)


def _with_columns(rows, path: str, keys: list[str], owner: str, key_fields: tuple[str, ...]):
    """`rows`, each checked to have the `keys` columns (a one-line error names the fields to set)."""
    for row in rows:
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"{path} has no {missing} column (has {sorted(row)}); set {owner}.{' / '.join(key_fields)}")
        yield row


class JsonlTask(TaskBase):
    """A task over JSONL rows (see the module docstring). Subclasses set `name`, `KEY_FIELDS` (the
    config fields naming a row's required keys), `TEXT_FIELDS` (those of them whose values are
    text), `DROP_REASONS` (their own reasons to drop a row, each with how `data_report` words it,
    formatted with the config's fields) and define `make_problem`."""

    name: str
    KEY_FIELDS: tuple[str, ...] = ()
    TEXT_FIELDS: tuple[str, ...] = ()
    DROP_REASONS: dict[str, str] = {}

    def __init__(self, cfg: JsonlConfig, *, tokenizer: Tokenizer | None):
        owner = type(cfg).__name__
        if cfg.train_file is None:
            raise ValueError(f"TaskConfig.name={self.name!r} needs {owner}.train_file (a JSONL file or a local "
                             "Hugging Face dataset of problems)")
        if tokenizer is None:
            raise ValueError(f"TaskConfig.name={self.name!r} needs a subword tokenizer: set TaskConfig.tokenizer (a "
                             "Hugging Face tokenizer directory) or RLConfig.init_from")
        check_eos(tokenizer, type(self).__name__)
        if cfg.chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{owner}.chat=True but the tokenizer has no chat template; add one "
                             f"(tokenizer_config.json or chat_template.jinja) or set {owner}.chat=False")
        self.cfg = cfg
        self._tokenizer = tokenizer
        # Rows read and dropped (by reason) per data source (a file, or a file's split).
        self.rows: dict[str, int] = {}
        self.dropped: dict[str, collections.Counter] = {}
        self._files: dict[str, None] = {}
        train, train_source = self._read(cfg.train_file, cfg.train_split, "train_split")
        if cfg.eval_file is not None or cfg.eval_split is not None:
            held_out, eval_source = self._read(cfg.eval_file or cfg.train_file, cfg.eval_split, "eval_split")
        else:
            eval_source = train_source
            if cfg.num_eval >= len(train):
                raise ValueError(f"{owner}.num_eval={cfg.num_eval} leaves no training problems of the "
                                 f"{len(train)} in {cfg.train_file}; lower it or give an eval_file")
            chosen = set(np.random.default_rng([cfg.seed, 0]).choice(len(train), cfg.num_eval, replace=False).tolist())
            held_out = [x for i, x in enumerate(train) if i in chosen]
            train = [x for i, x in enumerate(train) if i not in chosen]
        self._ids: dict[str, list[int]] = {}  # prompt ids by problem uid, tokenized once
        self._order: tuple[int, np.ndarray | None] = (-1, None)
        self._train = self._fitting(train, "train", train_source)
        self._eval = self._fitting(held_out, "eval", eval_source)

    def row_keys(self) -> tuple[list[str], tuple[str, ...], tuple[str, ...]]:
        """The keys every row must have, those of them whose values are text, and the config
        fields that name them (for errors)."""
        return ([getattr(self.cfg, f) for f in self.KEY_FIELDS], tuple(getattr(self.cfg, f) for f in self.TEXT_FIELDS),
                self.KEY_FIELDS)

    def _read(self, path: str, split: str | None, split_field: str) -> tuple[list[dict], str]:
        """The rows of `path` (its split `split`, for a dataset with splits) and the source's name
        in `data_report`: the path, with the split when it has several."""
        keys, text_keys, key_fields = self.row_keys()
        owner = type(self.cfg).__name__
        if split_field == "eval_split" and split is not None and not os.path.isdir(path):
            raise ValueError(f"{owner}.eval_split={split!r} names a split, but {path} is one file without splits; set "
                             f"{owner}.eval_file or leave eval_split None")
        rows, not_text = read_rows(path, keys, type(self.cfg).__name__, key_fields, text_keys, split, split_field)
        source = f"{path}[{split}]" if split is not None and os.path.isdir(path) else path
        self._files[path] = None
        self.rows[source] = self.rows.get(source, 0) + len(rows) + not_text
        self.dropped.setdefault(source, collections.Counter())["not_text"] += not_text
        return rows, source

    def make_problem(self, row: dict, uid: str) -> tuple[Problem, Any] | str:
        """(the problem of `row`, what `demonstration` and scoring need of it), or the reason (one
        of `DROP_REASONS`) the row is dropped."""
        raise NotImplementedError

    def _fitting(self, rows: list[dict], split: str, path: str) -> list[tuple[Problem, list[int], Any]]:
        """(problem, prompt ids, payload) of the usable rows of `path` whose prompt fits
        `max_prompt_tokens`; the others are counted in `dropped[path]`."""
        kept, dropped = [], collections.Counter()
        for i, row in enumerate(rows):
            made = self.make_problem(row, f"{split}:{i}")
            if isinstance(made, str):
                dropped[made] += 1
                continue
            problem, payload = made
            ids = self._prompt_ids(problem.prompt)
            if len(ids) > self.cfg.max_prompt_tokens:
                dropped["overlong"] += 1
                continue
            self._ids[problem.uid] = ids
            kept.append((problem, ids, payload))
        self.dropped[path] += dropped
        if not kept:
            raise ValueError(f"{type(self).__name__}: none of the {len(rows)} {split} rows of {path} is usable: "
                             f"{self._reasons(dropped)}")
        return kept

    def _reasons(self, dropped: collections.Counter) -> str:
        owner = type(self.cfg).__name__
        words = {"not_text": "with a null or non-text " + " or ".join(self.row_keys()[1]),
                 "overlong": f"with a prompt longer than {owner}.max_prompt_tokens={self.cfg.max_prompt_tokens}",
                 **{k: v.format(**dataclasses.asdict(self.cfg), owner=owner) for k, v in self.DROP_REASONS.items()}}
        return ", ".join(f"{n} {words[k]}" for k, n in sorted(dropped.items()) if n)

    def data_report(self) -> list[str]:
        """One line per data file that lost rows: how many, out of how many, and why."""
        return [f"{self.name} task: dropped {sum(d.values())} of the {self.rows[path]} rows of {path}: "
                f"{self._reasons(d)}" for path, d in self.dropped.items() if sum(d.values())]

    @property
    def data_files(self) -> tuple[str, ...]:
        """The files (and dataset directories) the problems come from (their checksums go into the
        run manifest)."""
        return tuple(self._files)

    def render(self, **fields: str) -> str:
        """The prompt text: the template filled with `fields`, through the chat template when `chat`."""
        return self.render_text(self.cfg.prompt_template.format(**fields))

    def render_text(self, text: str) -> str:
        """`text` (a filled template) as the prompt: through the chat template when `chat`."""
        if not self.cfg.chat:
            return text
        messages = ([{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else [])
        return self._tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}],
                                                   add_generation_prompt=True)

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
        total = sum(self.dropped.values(), collections.Counter())
        reasons = ("overlong", *self.DROP_REASONS, *(("not_text",) if self.row_keys()[1] else ()))
        return {"train": len(self._train), "eval": len(self._eval),
                **{f"dropped_{reason}": total[reason] for reason in reasons}}
