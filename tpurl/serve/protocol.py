"""The requests the endpoint takes (OpenAI's completions and chat completions) and their checks.

Fields follow OpenAI's API; fields it does not know are ignored. Extensions: `top_k`, `ignore_eos`
(do not stop at the tokenizer's EOS token), `stop_token_ids` (more ids that end a completion, kept
in it) and `chat_template_kwargs` (template variables, e.g. `{"enable_thinking": false}`). Every response carries the exact ids: `prompt_token_ids` and each
choice's `token_ids` (what the engine sampled; a trainer uses these, never a re-tokenisation).

A request the engine cannot run is a `BadRequest` (status 400, OpenAI's error object) naming the
field and the limit, before any work.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic

from tpurl.generate.sampling import SamplingConfig, temperature_problem

MAX_N = 128
MAX_STOPS = 4


class BadRequest(ValueError):
    """A request the endpoint refuses: status 400 (or `status`), OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


class _Request(pydantic.BaseModel):
    """What completions and chat completions share."""

    model_config = pydantic.ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise BadRequest("stop: a stop sequence must not be empty", "stop")
    return stops


def check_common(req: _Request) -> None:
    """The checks every request gets, before its prompt is built."""
    if not 1 <= req.n <= MAX_N:
        raise BadRequest(f"n={req.n}: must be in [1, {MAX_N}]", "n")
    if req.seed is not None and not 0 <= req.seed < 2 ** 63:
        raise BadRequest(f"seed={req.seed}: must be in [0, 2**63)", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise BadRequest(f"{name} is not supported (the sampled tokens must follow the policy's own "
                             "distribution, which a penalty changes); leave it at 0", name)


def top_count(req: _Request) -> int:
    """How many alternatives per token a request asks for (chat: `top_logprobs`; completions: `logprobs`)."""
    if isinstance(req, ChatRequest):
        return req.top_logprobs or 0
    return req.logprobs or 0


def sampling_config(req: _Request, *, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingConfig:
    """The engine's sampling config for `req` generating at most `max_tokens` (its tokens report the
    top logprobs it asks for, and the engine computes none for a batch where none asks)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if problem := temperature_problem(temperature, greedy=True):
        raise BadRequest(f"temperature={temperature} {problem}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p={top_p}: must be in (0, 1]", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise BadRequest(f"top_k={top_k}: must be >= 0 (0 or -1: no limit)", "top_k")
    if max_tokens < 1:
        raise BadRequest(f"max_tokens={max_tokens}: must be >= 1", "max_tokens")
    extra = tuple(req.stop_token_ids or ())
    if any(t < 0 for t in extra):
        raise BadRequest(f"stop_token_ids={list(extra)}: token ids are >= 0", "stop_token_ids")
    stops = tuple(dict.fromkeys((() if req.ignore_eos else stop_ids) + extra))
    return SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_tokens,
                          stop_token_ids=stops, stop_strings=stop_strings(req.stop), top_logprobs=top_count(req))


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: content parts joined into one text."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported, got "
                                     f"{part.get('type')!r}", f"messages[{i}].content")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        d.setdefault("content", "")
        for call in d.get("tool_calls") or ():
            _arguments_as_object(call)
        out.append(d)
    return out


def _arguments_as_object(call: Any) -> None:
    """An assistant's tool call as a template renders it: OpenAI clients send `arguments` as a JSON
    string, which templates would encode a second time (`| tojson`); an object goes in instead."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            parsed = json.loads(function["arguments"])
        except ValueError:
            return
        if isinstance(parsed, dict):
            function["arguments"] = parsed


def validation_error(error: pydantic.ValidationError | Any) -> BadRequest:
    """A request body that does not parse, as a `BadRequest` naming the first bad field."""
    errors = error.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(error)}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return BadRequest(f"{param or 'body'}: {first.get('msg', 'invalid')}", param)
