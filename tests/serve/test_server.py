"""`tpurl serve` against the real `openai` client: chat, completions, streaming, `n`, seeds, stop
strings, tool calls, logprobs equal to `tpurl score`'s, the token ids, errors, disconnects and 64
concurrent requests (every page back afterwards)."""

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest

from tpurl.commands.score import score_tokens
from tpurl.models.hf import load_hf_checkpoint
from tpurl.tokenizer import load_hf_tokenizer

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "what is two plus three"}]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _engine(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()["engine"]


def _all_pages_back(server, timeout: float = 30) -> dict:
    end = time.monotonic() + timeout
    while True:
        load = _engine(server)
        if load["pages_free"] == load["pages_total"] and load["requests_open"] == 0 or time.monotonic() > end:
            return load
        time.sleep(0.1)


def test_models_and_health(random_server):
    client = _client(random_server)
    assert [m.id for m in client.models.list().data] == ["m"]
    load = _engine(random_server)
    assert load["pages_total"] > 0 and load["requests_open"] == 0


def test_chat_gives_the_prompt_and_sampled_ids(random_server, random_dir):
    client = _client(random_server)
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=12, seed=1, temperature=1.0)
    tok = load_hf_tokenizer(random_dir)
    extra = r.model_extra
    assert extra["prompt_token_ids"] == tok.apply_chat_template(USER, tokenize=True)
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert 1 <= len(ids) <= 12 and choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ids)
    assert choice.finish_reason == ("stop" if ids[-1] == tok.eos_id else "length")
    assert r.usage.prompt_tokens == len(extra["prompt_token_ids"]) and r.usage.completion_tokens == len(ids)
    # The same seed gives the same tokens; n samples are different draws.
    again = client.chat.completions.create(model="m", messages=USER, max_tokens=12, seed=1, temperature=1.0)
    assert again.choices[0].model_extra["token_ids"] == ids
    many = client.chat.completions.create(model="m", messages=USER, max_tokens=12, seed=1, n=4)
    samples = [c.model_extra["token_ids"] for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and samples[0] == ids and len(set(map(tuple, samples))) > 1


def test_completion_logprobs_equal_tpurl_score(random_server, random_dir):
    client = _client(random_server)
    r = client.completions.create(model="m", prompt="hello world", max_tokens=16, logprobs=0, seed=4,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert len(ids) == 16 and r.choices[0].finish_reason == "length"
    served = np.asarray(r.choices[0].logprobs.token_logprobs)
    scored = score_tokens(load_hf_checkpoint(random_dir), prompt + ids)[len(prompt) - 1:]
    np.testing.assert_allclose(served, scored, atol=1e-5)
    # A prompt as token ids gives the same.
    by_ids = client.completions.create(model="m", prompt=prompt, max_tokens=16, seed=4,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].model_extra["token_ids"] == ids


def test_stop_strings_cut_the_text_not_the_ids(random_server):
    client = _client(random_server)
    kw = dict(model="m", prompt="the quick", max_tokens=24, seed=9, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    text = full.text
    stop = text[5:8]  # a piece in the middle of what the model wrote
    assert stop and text.find(stop) >= 5, text
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop"
    ids = cut.model_extra["token_ids"]
    assert ids == full.model_extra["token_ids"][:len(ids)] and len(ids) < 24


def test_streaming_matches_the_whole_response(random_server):
    client = _client(random_server)
    kw = dict(model="m", messages=USER, max_tokens=20, seed=5, n=2, logprobs=True)
    whole = client.chat.completions.create(**kw)
    text, ids, logprobs, reasons = {0: ""}, {}, {}, {}
    text[1] = ""
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            ids.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(t.logprob for t in c.logprobs.content)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for c in whole.choices:
        assert text[c.index] == c.message.content
        assert ids[c.index] == c.model_extra["token_ids"]
        np.testing.assert_allclose(logprobs[c.index], [t.logprob for t in c.logprobs.content], atol=1e-6)
        assert reasons[c.index] == c.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_tool_calls(scripted_server):
    client = _client(scripted_server)
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    r = client.chat.completions.create(model="m", messages=USER, tools=tools, temperature=0, max_tokens=10)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3} and call.id.startswith("call_")
    # The agent's next turn carries the call and its result; the template renders both.
    follow = USER + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    again = client.chat.completions.create(model="m", messages=follow, tools=tools, temperature=0, max_tokens=10)
    assert again.choices[0].message.tool_calls[0].function.name == "add"
    # Streamed: the call comes whole in one delta, no tool-call markup in the content.
    deltas, content = [], ""
    for chunk in client.chat.completions.create(model="m", messages=USER, tools=tools, temperature=0,
                                                max_tokens=10, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            reason = c.finish_reason or None
    assert content == "" and [d.function.name for d in deltas] == ["add"] and reason == "tool_calls"
    # A call cut off by max_tokens is no call: streamed and whole, the same plain content.
    kw = dict(model="m", messages=USER, tools=tools, temperature=0, max_tokens=2)
    cut = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(c.delta.content or "" for chunk in client.chat.completions.create(stream=True, **kw)
                       for c in chunk.choices)
    assert cut.message.tool_calls is None and cut.message.content.startswith("<tool_call>")
    assert streamed == cut.message.content
    # Without tools the same text is plain content.
    plain = client.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=10).choices[0]
    assert plain.message.tool_calls is None and "<tool_call>" in plain.message.content


@pytest.mark.parametrize("kwargs, code, words", [
    (dict(model="other"), "model_not_found", "'other' is not served here"),
    (dict(n=0), None, "n=0"),
    (dict(max_tokens=1000), "context_length_exceeded", "context of 128 tokens"),
    (dict(temperature="hot"), None, "temperature"),
    (dict(top_p=1.5), None, "top_p"),
    (dict(messages=[{"role": "user", "content": "x" * 400}]), "context_length_exceeded", "context of 128"),
    (dict(stop=["a", "b", "c", "d", "e"]), None, "at most 4"),
])
def test_bad_requests_get_400(random_server, kwargs, code, words):
    client = _client(random_server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "m", "messages": USER, "max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and words in e.value.body["message"], e.value.body
    assert e.value.body["code"] == code
    assert httpx.get(random_server.url + "/health").status_code == 200


def test_a_client_that_leaves_mid_stream_frees_its_pages(random_server):
    body = {"model": "m", "prompt": "hello", "max_tokens": 100, "stream": True, "ignore_eos": True, "n": 3}
    with httpx.stream("POST", random_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert _engine(random_server)["sequences_running"] > 0
    load = _all_pages_back(random_server)
    assert load["pages_free"] == load["pages_total"] and load["requests_open"] == 0, load


def test_64_concurrent_requests_lose_no_token(random_server):
    client = openai.AsyncOpenAI(base_url=random_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [f"the fox {i}" for i in range(64)]

    async def streamed(i):
        ids, text = [], ""
        stream = await client.completions.create(model="m", prompt=prompts[i], max_tokens=8 + i % 9, seed=i,
                                                 stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.model_extra["token_ids"]
                text += c.text
        return ids, text

    async def run_all():
        return await asyncio.gather(*(streamed(i) for i in range(64)))

    results = asyncio.run(run_all())
    sync = _client(random_server)
    for i in range(0, 64, 7):  # alone, afterwards: the same tokens and text
        alone = sync.completions.create(model="m", prompt=prompts[i], max_tokens=8 + i % 9, seed=i).choices[0]
        assert results[i] == (alone.model_extra["token_ids"], alone.text)
    assert all(1 <= len(ids) <= 16 for ids, _ in results)
    load = _all_pages_back(random_server)
    assert load["pages_free"] == load["pages_total"], load


def _top(model, ids, start: int, k: int):
    """The `k` most likely ids and logprobs at each position from `start` on, from a dense forward
    of the whole sequence (the reference: the full distribution)."""
    import jax
    import jax.numpy as jnp

    from tpurl.models.transformer import forward_logits

    logp = np.asarray(jax.nn.log_softmax(forward_logits(model, jnp.asarray([ids], jnp.int32))[0], axis=-1))
    rows = logp[start - 1:len(ids) - 1]
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
    return order, np.take_along_axis(rows, order, axis=-1)


def _text(tok, i) -> str:
    """A token's text as a response shows it (an id past the tokenizer's vocabulary: U+FFFD)."""
    return "\ufffd" if i >= tok.vocab_size else tok.decode([int(i)], skip_special=False)


def test_top_logprobs_are_the_full_distributions_most_likely(random_server, random_dir):
    """Chat `top_logprobs` and completions `logprobs=k`, whole and streamed: the k most likely tokens
    of each step's distribution, most likely first, as a dense forward of the sequence gives them."""
    client = _client(random_server)
    model, tok = load_hf_checkpoint(random_dir), load_hf_tokenizer(random_dir)
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=10, seed=3, logprobs=True,
                                       top_logprobs=4, extra_body={"ignore_eos": True})
    prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    want_ids, want_lp = _top(model, prompt + ids, len(prompt), 4)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == 10
    for t, (tid, alts, wid, wlp) in enumerate(zip(ids, content, want_ids, want_lp)):
        assert [a.token for a in alts.top_logprobs] == [_text(tok, i) for i in wid], t
        np.testing.assert_allclose([a.logprob for a in alts.top_logprobs], wlp, atol=1e-5)
        if tid in wid.tolist():  # the sampled token among them: its logprob is its alternative's
            assert alts.logprob == pytest.approx(alts.top_logprobs[wid.tolist().index(tid)].logprob, abs=1e-6)
    # Streamed: the same alternatives, chunk by chunk.
    streamed = [a for chunk in client.chat.completions.create(model="m", messages=USER, max_tokens=10, seed=3,
                                                               logprobs=True, top_logprobs=4, stream=True,
                                                               extra_body={"ignore_eos": True})
                for c in chunk.choices if c.logprobs for a in c.logprobs.content]
    assert [[(a.token, round(a.logprob, 5)) for a in s.top_logprobs] for s in streamed] == \
        [[(a.token, round(a.logprob, 5)) for a in s.top_logprobs] for s in content]
    # Completions: `logprobs=k` as {token text: logprob} per position.
    c = client.completions.create(model="m", prompt="hello world", max_tokens=6, logprobs=3, seed=4,
                                  extra_body={"ignore_eos": True})
    prompt, ids = c.model_extra["prompt_token_ids"], c.choices[0].model_extra["token_ids"]
    want_ids, want_lp = _top(model, prompt + ids, len(prompt), 3)
    sampled = c.choices[0].logprobs.token_logprobs
    for got, wid, wlp, tid, tlp in zip(c.choices[0].logprobs.top_logprobs, want_ids, want_lp, ids, sampled):
        want = {}
        for i, lp in zip(wid, wlp):  # one entry per text, the more likely token's
            want.setdefault(_text(tok, i), float(lp))
        want.setdefault(_text(tok, tid), tlp)  # and the sampled token, as OpenAI's legacy API
        assert list(got) == list(want)
        np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-5)


@pytest.mark.parametrize("kwargs, words", [
    (dict(logprobs=True, top_logprobs=6), "top_logprobs=6: this server reports at most 5 alternatives per token; "
                                          "start tpurl serve with --top-logprobs 6"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs=21: must be in [0, 20]"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs=true"),
])
def test_too_many_top_logprobs_get_400(random_server, kwargs, words):
    with pytest.raises(openai.BadRequestError) as e:
        _client(random_server).chat.completions.create(model="m", messages=USER, max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and words in e.value.body["message"], e.value.body


def test_a_streamed_choice_ends_when_it_is_done_not_with_its_siblings(random_server):
    """With n > 1, each choice's finishing chunk comes as soon as that sample ends, while the
    other samples still stream."""
    client = _client(random_server)
    for seed in range(40):  # common letters as stop strings: samples end at different lengths
        kw = dict(model="m", messages=USER, max_tokens=24, seed=seed, n=2, stop=["e", "a", "o", "t"])
        whole = client.chat.completions.create(**kw)
        lengths = {c.index: len(c.model_extra["token_ids"]) for c in whole.choices}
        if abs(lengths[0] - lengths[1]) >= 3:
            break
    else:
        pytest.fail(f"no seed gave samples of different lengths: {lengths}")
    short, long_ = sorted(lengths, key=lengths.get)
    events = [(c.index, c.finish_reason) for chunk in client.chat.completions.create(stream=True, **kw)
              for c in chunk.choices]
    finished_short = events.index((short, "stop"))
    last_long_token = max(i for i, (index, reason) in enumerate(events) if index == long_ and reason is None)
    assert finished_short < last_long_token, events
