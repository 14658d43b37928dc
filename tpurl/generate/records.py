"""The records of a `generate` call: its result (`Completion`) and the scheduler's internal ones.

A prompt's samples move through `Prefilled` (prefilled, waiting for a slot), `Running` (in a slot,
or out of it waiting for its environment) and end as a `Completion`. `Step` is one dispatched
decode step; `Stops` says when a turn ends on the host.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from tpurl.generate.protocol import Prefix, ResultTokens
from tpurl.generate.sampling import SamplingConfig
from tpurl.tokenizer import decode_generated

# on_turn_end(prompt_index, sample_index, token_ids after the prompt) -> observation ids, or None: done
TurnEnd = Callable[[int, int, np.ndarray], Sequence[int] | None]


@dataclasses.dataclass
class Completion:
    """One sampled continuation. `token_ids` include the stop token when stopped by one;
    `logprobs[t]` is `log_softmax(logits / T)[token_ids[t]]` (float32, see sampling.py) for the
    tokens the model sampled (`model_mask`; the rest are environment tokens of a multi-turn
    episode, logprob 0). `turns`: model turns. `versions[t]`: the policy version of the weights
    that sampled token t (-1 for environment tokens). `top[t]`: for a request that reports top
    logprobs (`Engine.reports_top` of its sampling > 0), its count of the most likely tokens at step
    t as `(ids, logprobs)` lists, most likely first (None for environment tokens); else `top` is
    None. `routes`: a router-replay model's experts per sparse layer of every token the engine
    consumed, `[len(prompt_ids) + len(token_ids), Ls, K]` (-1 for a token it never consumed: the
    last one), else None."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # "stop" (stop token or stop string) | "length" (max_new_tokens)
    prompt_index: int
    sample_index: int
    model_mask: np.ndarray | None = None
    turns: int = 1
    versions: np.ndarray | None = None
    top: list | None = None
    routes: np.ndarray | None = None

    def __post_init__(self):
        if self.model_mask is None:
            self.model_mask = np.ones(len(self.token_ids), bool)
        if self.versions is None:
            self.versions = np.where(self.model_mask, 0, -1).astype(np.int32)


@dataclasses.dataclass
class Request:
    """One prompt of a scheduler and how to sample it: its sampling, one seed per sample, its host
    stop check, and where its results go: `on_finish(completion)` once per sample, and
    `on_token(sample_index, token, logprob, top)` for every token the model samples (streaming;
    None: not asked; `top` as `Completion.top`'s entries, or None). `session`: the session it
    belongs to (`tpurl.generate.session_cache`), or None. `top_count`: the top logprobs each of its
    tokens reports (`Engine.reports_top`). `done`: samples finished so far."""

    prompt: np.ndarray
    sampling: SamplingConfig
    seeds: list[int]
    stops: Stops
    on_finish: Callable[[Completion], None]
    on_token: Callable[[int, int, float, Any], None] | None = None
    session: str | None = None
    top_count: int = 0
    done: int = 0

    @property
    def n_samples(self) -> int:
        return len(self.seeds)


@dataclasses.dataclass
class Prefilled:
    """A prefilled work item: its prefix, the (prefix sample, sample index) pairs still to place and
    the policy version of the weights that prefilled it (and sampled the first tokens)."""

    prefix: Prefix
    prompt_index: int
    pending: collections.deque
    version: int = 0

    def first(self, k: int) -> tuple[list[int], list[float], list[bool], list[int]]:
        """Prefix sample k's tokens, logprobs, model mask and versions so far: its first token,
        sampled by the prefill."""
        return [int(self.prefix.first_tokens[k])], [float(self.prefix.first_logprobs[k])], [True], [self.version]

    def first_top(self, k: int, count: int) -> list | None:
        """Prefix sample k's `count` top logprobs so far (`Running.top`): its first token's, or None
        (count 0)."""
        if not count:
            return None
        if self.prefix.first_top is None:
            raise ValueError("Prefilled.first_top: a sequence that reports top logprobs came from a prefill that "
                             "computed none")
        ids, logprobs = top_pairs(self.prefix.first_top)[k]
        return [(ids[:count], logprobs[:count])]

    def running(self, k: int, sample_index: int, top_count: int) -> Running:
        """Prefix sample k (sample `sample_index` of its prompt) as a `Running` sequence: its first
        token (with its `top_count` top logprobs), and with router replay the prompt's routes and a
        place for the first token's."""
        routes = self.prefix.routes
        return Running(self.prompt_index, sample_index, *self.first(k), top=self.first_top(k, top_count),
                       routes=None if routes is None else [None], prompt_routes=routes, top_count=top_count)


@dataclasses.dataclass
class Running:
    """A sequence and its tokens after the prompt so far (`mask`: sampled by the model, not the
    environment; `versions`: the policy version that sampled each, -1 for the environment's)."""

    prompt_index: int
    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    mask: list[bool]
    versions: list[int]
    turns: int = 1
    top: list | None = None  # per token (ids, logprobs) lists, None for environment tokens (top_count > 0)
    routes: list | None = None  # per token [Ls, K] experts once consumed, None before (router replay)
    prompt_routes: np.ndarray | None = None  # [len(prompt), Ls, K] (router replay)
    top_count: int = 0  # the top logprobs each token keeps (`Request.top_count`); `top` starts as [] when > 0

    def __post_init__(self):
        if self.top is None and self.top_count:
            self.top = []
        elif self.top is not None and not self.top_count:
            raise ValueError("Running: top logprobs kept for a sequence whose top_count is 0")

    def append(self, token: int, logprob: float, version: int, top=None) -> None:
        if self.top is not None and top is None:
            raise ValueError("Running.append: a token of a sequence that reports top logprobs came from a "
                             "program that computed none")
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.mask.append(True)
        self.versions.append(version)
        if self.top is not None:
            n = self.top_count
            self.top.append(top if len(top[0]) <= n else (top[0][:n], top[1][:n]))
        if self.routes is not None:
            self.routes.append(None)

    def consumed(self, routes_TLK) -> None:
        """The experts of the last T tokens, which a program just consumed (router replay)."""
        if self.routes is not None:
            # int16 copies: views would keep the step's whole host array alive
            self.routes[len(self.routes) - len(routes_TLK):] = [np.array(r, np.int16) for r in np.asarray(routes_TLK)]

    def observe(self, obs: list[int]) -> None:
        """Append an environment observation (not sampled: no logprob, no version)."""
        self.tokens += obs
        self.logprobs += [0.0] * len(obs)
        self.mask += [False] * len(obs)
        self.versions += [-1] * len(obs)
        if self.top is not None:
            self.top += [None] * len(obs)
        if self.routes is not None:
            self.routes += [None] * len(obs)
        self.turns += 1

    def turn(self) -> list[int]:
        """The tokens of the current model turn (after the last environment token)."""
        start = len(self.mask) - next((i for i, m in enumerate(reversed(self.mask)) if not m), len(self.mask))
        return self.tokens[start:]

    def completion(self, prompt_ids: np.ndarray, reason: str) -> Completion:
        return Completion(prompt_ids=prompt_ids, token_ids=np.asarray(self.tokens, np.int32),
                          logprobs=np.asarray(self.logprobs, np.float32), finish_reason=reason,
                          prompt_index=self.prompt_index, sample_index=self.sample_index,
                          model_mask=np.asarray(self.mask, bool), turns=self.turns,
                          versions=np.asarray(self.versions, np.int32), top=self.top, routes=self._all_routes())

    def _all_routes(self) -> np.ndarray | None:
        """The prompt's and the tokens' routes, -1 where a token was never consumed."""
        if self.routes is None:
            return None
        out = np.full((len(self.prompt_routes) + len(self.routes), *self.prompt_routes.shape[1:]), -1, np.int16)
        out[:len(self.prompt_routes)] = self.prompt_routes
        for i, r in enumerate(self.routes, start=len(self.prompt_routes)):
            if r is not None:
                out[i] = r
        return out


@dataclasses.dataclass(frozen=True)
class Step:
    """A dispatched decode step: its device results, the version of the weights it ran with, and
    the sequence in each slot it ran (whose results it holds)."""

    result: ResultTokens
    version: int
    runs: dict[int, Running]


@dataclasses.dataclass(frozen=True)
class Stops:
    """When a model turn ends on the host: by a stop token, or by a stop string (which only the
    host sees: the tokens are decoded with `tokenizer`)."""

    sampling: SamplingConfig
    tokenizer: object = None

    def string_hit(self, tokens: list[int]) -> bool:
        stop_strings = self.sampling.stop_strings
        if not stop_strings:
            return False
        # A stop string can only have been completed by the newest token, so decoding a tail that is
        # long enough to contain any stop string (each kept token is >= 1 character) suffices.
        tail = tokens[-(4 * max(len(s) for s in stop_strings) + 8):]
        text = decode_generated(self.tokenizer, tail)
        return any(s in text for s in stop_strings)

    def stopped(self, tokens: list[int]) -> bool:
        return bool(tokens) and (tokens[-1] in self.sampling.stop_token_ids or self.string_hit(tokens))

    def at_first_token(self, item: Prefilled, k: int) -> bool:
        """Whether prefix sample k of `item` ends with its first token."""
        return item.prefix.finished_at_first_token(k) or self.string_hit(item.first(k)[0])


_ARRAYS = {"prompt_ids": np.int32, "token_ids": np.int32, "logprobs": np.float32, "model_mask": bool,
           "versions": np.int32}


def completion_fields(c: Completion) -> dict[str, Any]:
    """A completion as JSON values (what `completion_from_fields` reads back; top logprobs left out)."""
    return {**{name: getattr(c, name).tolist() for name in _ARRAYS}, "finish_reason": c.finish_reason,
            "turns": c.turns, "routes": None if c.routes is None else c.routes.tolist()}


def completion_from_fields(fields: dict[str, Any], prompt_index: int, sample_index: int) -> Completion:
    """The completion `completion_fields` wrote, as sample `sample_index` of prompt `prompt_index`."""
    arrays = {name: np.asarray(fields[name], dtype).reshape(-1) for name, dtype in _ARRAYS.items()}
    routes = None if fields["routes"] is None else np.asarray(fields["routes"], np.int16)
    return Completion(**arrays, finish_reason=fields["finish_reason"], turns=fields["turns"],
                      prompt_index=prompt_index, sample_index=sample_index, routes=routes)


def as_lists(result: ResultTokens) -> tuple[list, list, list, list, list]:
    """A step's host results as Python lists (tokens, logprobs, valid, done, top): one conversion
    each, not one numpy scalar per slot; `top[row]` is `(ids, logprobs)` lists, or None throughout
    without top logprobs."""
    lists = tuple(np.asarray(x).tolist() for x in (result.tokens, result.logprobs, result.valid, result.done))
    top = [None] * len(lists[0]) if result.top is None else top_pairs(result.top)
    return (*lists, top)


def top_pairs(top) -> list[tuple[list[int], list[float]]]:
    """A host `TopLogprobs` `[B, K]` as one `(ids, logprobs)` pair of lists per row."""
    return list(zip(np.asarray(top.ids).tolist(), np.asarray(top.logprobs).tolist()))
