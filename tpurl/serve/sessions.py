"""What the endpoint saw of one agent episode (its calls), and the training sequences they make.

An agent's episode is a session: its client's base URL is `/sessions/<id>/v1`, and the endpoint
records every call of it (`Call`: the request as sent, the exact prompt ids, the engine's
completions with their logprobs and policy versions, the text and tool calls it answered).

**Token in, token out.** The trainer gets exactly the ids the engine sampled and the ids of what
the agent sent, never a re-tokenisation of text. `sequences(calls)` joins the calls in order: a
call whose prompt starts with a sequence so far (its first prompt, and every token after it, the
previous completion included) token for token continues that sequence: the prompt's new tokens
(the agent's tool results, the next user turn, the chat template's markers) are environment
tokens, not trained, and the completion's are the model's. A call whose prompt does not (a chat
template that re-renders an earlier turn differently, an agent that rewrote its history) starts a
new sequence. Of a call with `n` > 1 choices, the first continues the sequence and the others
start sequences of their own.

With router replay (a mixture-of-experts model whose engine records each consumed token's experts)
a sequence keeps the routes of every position it holds, each from the call that consumed it first
(the one whose sampled tokens it fed): the first call's prompt and completion, then each later
call's from the previous completion's last token on (sampled, but consumed only by the next call).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tpurl.generate.records import Completion


@dataclasses.dataclass
class Call:
    """One request of a session: its body as sent, prompt ids, the engine's completions (one per
    choice) and what the response said (`texts`, `tool_calls`: per choice)."""

    request: dict[str, Any]
    prompt_ids: list[int]
    completions: list[Completion]
    texts: list[str | None]
    tool_calls: list[list[dict]]

    def log(self) -> dict[str, Any]:
        """The call as the trajectory log keeps it."""
        return {"request": self.request, "prompt_ids": self.prompt_ids,
                "choices": [{"text": t, "tool_calls": calls, "token_ids": c.token_ids.tolist(),
                             "finish_reason": c.finish_reason}
                            for t, calls, c in zip(self.texts, self.tool_calls, self.completions)]}


@dataclasses.dataclass
class Sequence:
    """One training sequence of an episode: the first call's prompt, then every token after it
    (`mask`: sampled by the model; `versions`: the policy version of each sampled token, -1 for
    the others), and the calls it holds."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    routes: np.ndarray | None = None  # [len(ids), Ls, K] with router replay (-1: not yet consumed)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.tokens

    def extends(self, prompt: list[int]) -> bool:
        ids = self.ids
        return len(prompt) >= len(ids) and prompt[:len(ids)] == ids

    def add(self, call_index: int, prompt: list[int], c: Completion) -> None:
        """Append the call's new prompt tokens (environment) and its completion (model)."""
        n = len(self.ids)
        if c.routes is not None:  # the positions consumed first by this call (all, for the first)
            self.routes = c.routes if not self.calls else np.concatenate([self.routes[:n - 1], c.routes[n - 1:]])
        new = prompt[n:]
        self.tokens += new + c.token_ids.tolist()
        self.logprobs += [0.0] * len(new) + c.logprobs.tolist()
        self.mask += [False] * len(new) + [True] * len(c.token_ids)
        self.versions += [-1] * len(new) + c.versions.tolist()
        self.calls.append(call_index)
        self.finish_reason = c.finish_reason
        self.turns += 1

    def completion(self, prompt_index: int, sample_index: int) -> Completion:
        """As a `Completion` (the rollout's carrier of one sample), ready to pack."""
        return Completion(prompt_ids=np.asarray(self.prompt, np.int32), token_ids=np.asarray(self.tokens, np.int32),
                          logprobs=np.asarray(self.logprobs, np.float32), finish_reason=self.finish_reason,
                          prompt_index=prompt_index, sample_index=sample_index,
                          model_mask=np.asarray(self.mask, bool), turns=max(self.turns, 1),
                          versions=np.asarray(self.versions, np.int32), routes=self.routes)


def sequences(calls: list[Call]) -> list[Sequence]:
    """The training sequences of a session's calls, in order (see the module docstring)."""
    out: list[Sequence] = []
    for i, call in enumerate(calls):
        for k, c in enumerate(call.completions):
            # The longest sequence the prompt extends (the first choice only: the others branch).
            match = max((s for s in out if s.extends(call.prompt_ids)), key=lambda s: len(s.ids), default=None)
            if k > 0 or match is None:
                match = Sequence(prompt=list(call.prompt_ids))
                out.append(match)
            match.add(i, call.prompt_ids, c)
    return out
