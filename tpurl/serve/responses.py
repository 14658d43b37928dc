"""The OpenAI response objects of finished requests: choices with their text, logprobs (and the
most likely alternatives), finish reasons and tool calls, usage, and the exact token ids.

The functions read the served model's texts through `Texts` (the endpoint: its name, how it
decodes a completion and spells one token).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

from tpurl.generate.records import Completion
from tpurl.serve import tool_calls
from tpurl.serve.protocol import ChatRequest, CompletionRequest, stop_strings, top_count
from tpurl.serve.text import cut_at_stop


class Texts(Protocol):
    """What a response needs of the endpoint."""

    name: str

    def decode(self, ids) -> str: ...

    def token_text(self, token: int) -> str: ...


def usage(prompts: list[list[int]], completions: list[Completion]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts) if completions else 0
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(c: Completion, text: str, stops) -> str:
    return "stop" if c.finish_reason == "stop" or cut_at_stop(text, stops)[1] else "length"


def _alternatives(tops, k: int, n: int) -> list[list[tuple[int, float]]]:
    """Per token, its `k` most likely (id, logprob) pairs from `Completion.top`-style entries."""
    if k == 0 or tops is None:
        return [[] for _ in range(n)]
    return [[] if top is None else list(zip(top[0][:k], top[1][:k])) for top in tops]


def completion_logprobs(endpoint: Texts, ids, logprobs, tops=None, k: int = 0) -> dict:
    tokens = [endpoint.token_text(t) for t in ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    top = None
    if k:  # as OpenAI's legacy API: the k most likely, and the sampled token where it is not among them
        alternatives = _alternatives(tops, k, len(ids))
        top = [_by_text(endpoint, alts + [(t, lp)]) for t, lp, alts in zip(ids, logprobs, alternatives)]
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": top,
            "text_offset": offsets}


def _by_text(endpoint: Texts, alts) -> dict[str, float]:
    """Alternatives as the completions API gives them, {token text: logprob}: two tokens of one
    text (e.g. ids past the tokenizer's vocabulary) show once, with the more likely one's."""
    out: dict[str, float] = {}
    for i, lp in alts:
        out.setdefault(endpoint.token_text(i), float(lp))
    return out


def _token_logprob(endpoint: Texts, token: int, logprob: float) -> dict:
    text = endpoint.token_text(token)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(endpoint: Texts, ids, logprobs, tops=None, k: int = 0) -> dict:
    out = []
    for t, lp, alts in zip(ids, logprobs, _alternatives(tops, k, len(ids))):
        out.append({**_token_logprob(endpoint, t, lp),
                    "top_logprobs": [_token_logprob(endpoint, i, a) for i, a in alts]})
    return {"content": out}


def _chat_message(text: str, use_tools: bool) -> tuple[dict, bool]:
    """The assistant message of a completion's text, and whether it calls tools."""
    content, calls = tool_calls.parse(text) if use_tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, bool(calls)


def completion_response(endpoint: Texts, req: CompletionRequest, prompts, results) -> dict:
    choices, stops = [], stop_strings(req.stop)
    for p, completions in enumerate(results):
        for c in completions:
            full = endpoint.decode(c.token_ids)
            choices.append({"index": p * req.n + c.sample_index, "text": cut_at_stop(full, stops)[0],
                            "logprobs": completion_logprobs(endpoint, c.token_ids, c.logprobs, c.top, top_count(req))
                            if req.logprobs is not None else None,
                            "finish_reason": finish_reason(c, full, stops),
                            "token_ids": c.token_ids.tolist()})
    return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": endpoint.name, "choices": choices, "usage": usage(prompts, [c for r in results for c in r]),
            "prompt_token_ids": prompts if len(prompts) > 1 else prompts[0]}


def chat_response(endpoint: Texts, req: ChatRequest, prompt, completions, use_tools: bool,
                  sent_calls: dict[int, list] | None = None) -> dict:
    """The chat response of `completions`; `sent_calls`: the tool calls a stream already sent per
    choice, whose ids the response keeps (what the client saw is what a session records)."""
    choices, stops = [], stop_strings(req.stop)
    for c in completions:
        full = endpoint.decode(c.token_ids)
        message, called = _chat_message(cut_at_stop(full, stops)[0], use_tools)
        sent = (sent_calls or {}).get(c.sample_index)
        if called and sent and len(sent) == len(message["tool_calls"]):
            message["tool_calls"] = [call.to_openai() for call in sent]
        choices.append({"index": c.sample_index, "message": message,
                        "logprobs": (chat_logprobs(endpoint, c.token_ids, c.logprobs, c.top, top_count(req))
                                     if req.logprobs else None),
                        "finish_reason": "tool_calls" if called else finish_reason(c, full, stops),
                        "token_ids": c.token_ids.tolist()})
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": endpoint.name, "choices": choices, "usage": usage([prompt], completions),
            "prompt_token_ids": prompt}
