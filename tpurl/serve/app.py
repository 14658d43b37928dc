"""The OpenAI-compatible application: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

Each request is checked (`tpurl.serve.protocol`), turned into prompt ids (chat messages through the
tokenizer's chat template, with `tools`), and submitted to the `Service`, where it joins the
running continuous batch; `n` samples of one prompt share its prefill and pages. The handler waits
for the tickets without blocking the event loop. Streaming (`stream: true`) sends server-sent
events: one chunk per sampled token (its text, once no stop string or tool call can take it back,
its id and logprob), then each choice's finish, usage when asked, `[DONE]`.

A client that goes away (mid-stream, or while waiting) cancels its requests: their slots and pages
go back to the engine at its next step. A request the engine fails on gets status 500, and a
stopped service 503; the server itself goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from tpurl.generate.protocol import MAX_TOP_LOGPROBS
from tpurl.generate.records import Completion
from tpurl.generate.service import Service, ServiceClosed, Ticket
from tpurl.serve import tool_calls
from tpurl.serve.protocol import (BadRequest, ChatRequest, CompletionRequest, check_common, message_dicts,
                                  sampling_config, stop_strings, top_count, validation_error)
from tpurl.serve.responses import (chat_logprobs, chat_response, completion_logprobs, completion_response,
                                   finish_reason, usage)
from tpurl.serve.sessions import Call
from tpurl.serve.text import TextStream, cut_at_stop
from tpurl.tokenizer import decode_generated

_DISCONNECT_POLL_S = 0.25


class Endpoint:
    """What the application serves: a running `Service`, its tokenizer, the model's name and the
    context length (prompt + completion) a request may use. `recorder(session, call)`: gets every
    finished call of a session (`/sessions/<id>/v1/...`, `tpurl.serve.sessions`). For a rollout:
    `temperature` samples every request at that temperature, untruncated, whatever it asks;
    `seed_for(session, k)` seeds the k-th call of a session (its own seed is ignored)."""

    def __init__(self, service: Service, tokenizer, *, name: str, context_length: int,
                 recorder: Callable[[str, Call], None] | None = None, temperature: float | None = None,
                 seed_for: Callable[[str, int], int] | None = None):
        self.service, self.tokenizer, self.name, self.context_length = service, tokenizer, name, context_length
        self.recorder, self.temperature, self.seed_for = recorder, temperature, seed_for
        self._session_calls: dict[str, int] = {}
        self.eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        self.created = int(time.time())

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.name!r}", "model",
                             "model_not_found")

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            p = [p]
        elif p and isinstance(p[0], int):
            p = [p]
        if not p:
            raise BadRequest("prompt: empty", "prompt")
        try:
            return [self.tokenizer.encode(x, add_bos=self.tokenizer.bos_id is not None) if isinstance(x, str)
                    else list(x) for x in p]
        except ValueError as e:  # text this tokenizer cannot encode (a character tokenizer's unknown character)
            raise BadRequest(f"prompt: {e}", "prompt") from None

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if not req.messages:
            raise BadRequest("messages: at least one message is needed", "messages")
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:
            return self.tokenizer.apply_chat_template(message_dicts(req.messages), add_generation_prompt=True,
                                                      tokenize=True, tools=tools, **(req.chat_template_kwargs or {}))
        except (ValueError, TypeError) as e:  # TypeError: chat_template_kwargs naming a fixed argument
            raise BadRequest(f"messages: {e}", "messages") from None

    def max_tokens(self, requested: int | None, prompt_length: int) -> int:
        room = self.context_length - prompt_length
        if room < 1:
            raise BadRequest(f"the prompt has {prompt_length} tokens and leaves no room in this model's context of "
                             f"{self.context_length} tokens; shorten it", "messages", "context_length_exceeded")
        if requested is not None and requested > room:
            raise BadRequest(f"max_tokens={requested} + the prompt's {prompt_length} tokens exceed this model's "
                             f"context of {self.context_length} tokens; ask for at most {room}", "max_tokens",
                             "context_length_exceeded")
        return room if requested is None else requested

    def submit(self, prompts: list[list[int]], req, max_tokens: int | None, on_token=None,
               session: str | None = None, on_sample=None) -> list[Ticket]:
        """One ticket per prompt (n samples each); on_token(prompt, sample, token, logprob, top) and
        on_sample(prompt, completion) as each sample finishes (streaming)."""
        tickets = []
        try:
            for p, ids in enumerate(prompts):
                sampling = sampling_config(req, max_tokens=self.max_tokens(max_tokens, len(ids)), stop_ids=self.eos)
                if self.temperature is not None:
                    sampling = dataclasses.replace(sampling, temperature=self.temperature, top_p=1.0, top_k=0)
                callback = None if on_token is None else (lambda j, t, lp, top, p=p: on_token(p, j, t, lp, top))
                seed = None if req.seed is None else req.seed + p
                if session is not None and self.seed_for is not None:
                    k = self._session_calls.get(session, 0)
                    self._session_calls[session] = k + 1
                    seed = self.seed_for(session, k)
                finished = None if on_sample is None else (lambda c, p=p: on_sample(p, c))
                tickets.append(self.service.submit(ids, n=req.n, sampling=sampling, seed=seed, on_token=callback,
                                                   on_sample=finished, session=session))
        except BadRequest:
            self.cancel(tickets)
            raise
        except ServiceClosed as e:
            self.cancel(tickets)
            raise BadRequest(f"the engine has stopped: {e}", status=503) from None
        except ValueError as e:
            self.cancel(tickets)
            raise BadRequest(str(e), "prompt" if "prompt" in str(e) else None) from None
        return tickets

    def cancel(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            if not t.done():
                self.service.cancel(t)

    def decode(self, ids) -> str:
        """The text of sampled ids (an id past the tokenizer's vocabulary shows as U+FFFD, as in a stream)."""
        return decode_generated(self.tokenizer, ids)

    def token_text(self, token: int) -> str:
        if token >= self.tokenizer.vocab_size:
            return "\ufffd"
        return self.tokenizer.decode([token], skip_special=False)

    def check_top_logprobs(self, k: int, field: str) -> None:
        """A request's count of top alternatives per token against what the engine reports."""
        limit = self.service.engine.config.top_logprobs
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"{field}={k}: must be in [0, {MAX_TOP_LOGPROBS}]", field)
        if k > limit:
            fix = (f"start tpurl serve with --top-logprobs {k}" if self.recorder is None else
                   "a rollout's endpoint reports none")
            raise BadRequest(f"{field}={k}: this server reports at most {limit} alternatives per token; {fix}", field)


def record(endpoint: Endpoint, session: str | None, body: dict, prompts, results, response: dict) -> None:
    """Give the session's recorder one `Call` per prompt of a finished request."""
    if session is None or endpoint.recorder is None:
        return
    choices = response["choices"]
    for p, completions in enumerate(results):
        n = len(completions)
        mine = choices[p * n:(p + 1) * n]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in mine]
        calls = [c["message"].get("tool_calls", []) if "message" in c else [] for c in mine]
        endpoint.recorder(session, Call(request=body, prompt_ids=list(prompts[p]), completions=list(completions),
                                        texts=texts, tool_calls=calls))


# ------------------------------------------------------------------------------------------------
# Waiting, streaming.

async def _results(request: Request, endpoint: Endpoint, tickets: list[Ticket]) -> list[list[Completion]] | None:
    """The tickets' completions; a client that disconnects meanwhile cancels them (None)."""
    futures = [asyncio.wrap_future(t.future) for t in tickets]
    try:
        while True:
            done, pending = await asyncio.wait(futures, timeout=_DISCONNECT_POLL_S)
            if not pending:
                return [f.result() for f in futures]
            if await request.is_disconnected():
                return None
    finally:
        endpoint.cancel(tickets)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class _Stream:
    """The events of one streamed request: tokens arrive on `queue` from the engine thread as
    (prompt, sample, token, logprob, top), each sample's end as ("sample", prompt, completion) and
    each ticket's end as ("done", prompt)."""

    def __init__(self, endpoint: Endpoint, req, *, chat: bool, use_tools: bool):
        self.endpoint, self.req, self.chat, self.use_tools = endpoint, req, chat, use_tools
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stops = stop_strings(req.stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts: dict[int, TextStream] = {}
        self.calls: dict[int, list] = {}  # choice index -> the tool calls its last chunk sent

    def on_token(self, p: int, j: int, token: int, logprob: float, top) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (p, j, token, logprob, top))

    def on_sample(self, p: int, completion: Completion) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("sample", p, completion))

    def watch(self, tickets: list[Ticket]) -> None:
        for p, t in enumerate(tickets):
            t.future.add_done_callback(lambda f, p=p: self.loop.call_soon_threadsafe(self.queue.put_nowait,
                                                                                    ("done", p)))

    def _text(self, index: int) -> TextStream:
        if index not in self.texts:
            hold = tool_calls.OPEN if self.use_tools else None
            self.texts[index] = TextStream(self.endpoint.tokenizer, self.stops, hold)
        return self.texts[index]

    def chunk(self, index: int, *, text: str = "", ids=(), logprobs=(), tops=None, finish: str | None = None,
              role: bool = False, calls: list | None = None) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": [int(t) for t in ids]}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(calls)]
            choice["delta"] = delta
            choice["logprobs"] = (chat_logprobs(self.endpoint, ids, logprobs, tops, top_count(self.req))
                                  if self.req.logprobs and ids else None)
        else:
            choice["text"] = text
            choice["logprobs"] = (completion_logprobs(self.endpoint, ids, logprobs, tops, top_count(self.req))
                                  if self.req.logprobs is not None and ids else None)
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.endpoint.name, "choices": [choice]}

    def token_chunk(self, p: int, j: int, token: int, logprob: float, top) -> dict:
        index = p * self.req.n + j
        return self.chunk(index, text=self._text(index).push(token), ids=[token], logprobs=[logprob], tops=[top])

    def finish_chunks(self, p: int, completions: list[Completion]) -> list[dict]:
        out = []
        for c in completions:
            index = p * self.req.n + c.sample_index
            stream = self._text(index)
            full = self.endpoint.decode(c.token_ids)
            text = cut_at_stop(full, self.stops)[0]
            calls = []
            if self.use_tools:  # the stream held back everything from the first call's marker
                text, calls = tool_calls.split(text)
            rest = text[stream.sent:]
            reason = "tool_calls" if calls else finish_reason(c, full, self.stops)
            self.calls[index] = calls
            out.append(self.chunk(index, text=rest, finish=reason, calls=calls))
        return out


async def _events(request: Request, stream: _Stream, tickets: list[Ticket], prompts, done) -> AsyncIterator[str]:
    open_tickets, completions = set(range(len(tickets))), []
    try:
        if stream.chat:
            for j in range(stream.req.n):
                yield _sse(stream.chunk(j, role=True))
        while open_tickets:
            item = await stream.queue.get()
            if item[0] == "sample":  # a choice is finished: its last chunk goes now, not with its siblings'
                for chunk in stream.finish_chunks(item[1], [item[2]]):
                    yield _sse(chunk)
                continue
            if item[0] != "done":
                yield _sse(stream.token_chunk(*item))
                continue
            p = item[1]
            open_tickets.discard(p)
            error = tickets[p].future.exception()
            if error is not None:
                yield _sse({"error": {"message": f"generation failed: {error}", "type": "server_error"}})
                return
            completions += tickets[p].result()
        done([t.result() for t in tickets])
        if stream.req.include_usage:
            yield _sse({"id": stream.id, "object": "chat.completion.chunk" if stream.chat else "text_completion",
                        "created": stream.created, "model": stream.endpoint.name, "choices": [],
                        "usage": usage(prompts, completions)})
        yield _sse("[DONE]")
    finally:  # also when the client went away: its requests end, their pages come back
        stream.endpoint.cancel(tickets)


# ------------------------------------------------------------------------------------------------
# The application.

def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _parse(model, body: Any):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("the request body is not JSON") from None


async def _bad_request(_: Request, e: BadRequest):
    return _error(e)


async def _invalid(_: Request, e: RequestValidationError):
    return _error(validation_error(e))


# The routes' functions are module-level and find their endpoint in `request.app.state`: FastAPI
# caches what it learns about a route's function in a process-wide cache, so functions made per
# application (closures over the endpoint) would keep every application's endpoint alive, and with
# it every call a rollout's agents made.

async def _health(request: Request):
    """200 with what the engine holds (open requests, running sequences, KV pages), or 503."""
    endpoint: Endpoint = request.app.state.endpoint
    if not endpoint.service.alive:
        return JSONResponse({"status": "stopped"}, status_code=503)
    try:
        load = await asyncio.wrap_future(endpoint.service.load())
    except Exception:  # the engine stopped meanwhile
        return JSONResponse({"status": "stopped"}, status_code=503)
    return {"status": "ok", "engine": load}


async def _models(request: Request):
    endpoint: Endpoint = request.app.state.endpoint
    return {"object": "list", "data": [{"id": endpoint.name, "object": "model", "created": endpoint.created,
                                        "owned_by": "tpurl", "max_model_len": endpoint.context_length}]}


async def _checked(request: Request, model) -> tuple[Endpoint, Any, Any]:
    """The endpoint, the body and the request parsed as `model`, with the checks every request gets."""
    endpoint: Endpoint = request.app.state.endpoint
    body = await _body(request)
    req = _parse(model, body)
    endpoint.check_model(req.model)
    check_common(req)
    return endpoint, body, req


async def _completions(request: Request, session: str | None = None):
    endpoint, body, req = await _checked(request, CompletionRequest)
    if req.echo:
        raise BadRequest("echo is not supported; the response's prompt_token_ids hold the prompt", "echo")
    endpoint.check_top_logprobs(top_count(req), "logprobs")
    prompts = endpoint.completion_prompts(req)
    return await _run(request, endpoint, req, body, prompts, req.max_tokens, chat=False, use_tools=False,
                      session=session)


async def _chat(request: Request, session: str | None = None):
    endpoint, body, req = await _checked(request, ChatRequest)
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    endpoint.check_top_logprobs(top_count(req), "top_logprobs")
    if req.tool_choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice={req.tool_choice!r} is not supported; use 'auto' or 'none'", "tool_choice")
    use_tools = bool(req.tools) and req.tool_choice != "none"
    prompt = endpoint.chat_prompt(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return await _run(request, endpoint, req, body, [prompt], max_tokens, chat=True, use_tools=use_tools,
                      session=session)


def create_app(endpoint: Endpoint) -> FastAPI:
    """The FastAPI application over `endpoint`: the API at `/v1`, and again at `/sessions/<id>/v1`
    for the calls of one recorded session."""
    app = FastAPI(title="tpurl", docs_url=None, redoc_url=None)
    app.state.endpoint = endpoint
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_api_route("/health", _health, methods=["GET"])
    for prefix in ("", "/sessions/{session}"):
        app.add_api_route(prefix + "/v1/models", _models, methods=["GET"])
        app.add_api_route(prefix + "/v1/completions", _completions, methods=["POST"])
        app.add_api_route(prefix + "/v1/chat/completions", _chat, methods=["POST"])
    return app


async def _run(request: Request, endpoint: Endpoint, req, body: dict, prompts, max_tokens, *, chat: bool,
               use_tools: bool, session: str | None):
    def respond(results, sent_calls=None):
        if chat:
            return chat_response(endpoint, req, prompts[0], results[0], use_tools, sent_calls)
        return completion_response(endpoint, req, prompts, results)

    if req.stream:
        stream = _Stream(endpoint, req, chat=chat, use_tools=use_tools)
        tickets = endpoint.submit(prompts, req, max_tokens, on_token=stream.on_token, session=session,
                                  on_sample=stream.on_sample)
        stream.watch(tickets)

        def done(results):  # the session records the calls with the ids the stream sent
            record(endpoint, session, body, prompts, results, respond(results, stream.calls))
        return StreamingResponse(_events(request, stream, tickets, prompts, done), media_type="text/event-stream")
    tickets = endpoint.submit(prompts, req, max_tokens, session=session)
    try:
        results = await _results(request, endpoint, tickets)
    except ServiceClosed as e:
        raise BadRequest(f"the engine has stopped: {e}", status=503) from None
    except Exception as e:  # the engine failed on this request; the server goes on
        return JSONResponse({"error": {"message": f"generation failed: {e}", "type": "server_error"}},
                            status_code=500)
    if results is None:  # the client went away: no one reads an answer
        return JSONResponse({"error": {"message": "the client disconnected", "type": "cancelled"}}, status_code=499)
    response = respond(results)
    record(endpoint, session, body, prompts, results, response)
    return JSONResponse(response)  # JSON already: FastAPI's encoder would walk every token id again
