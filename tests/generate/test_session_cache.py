"""Session reuse (`tpurl.generate.session_cache`): a session's request whose prompt extends its
previous request's prompt and completion resumes that sequence's KV pages instead of a prefill.

Reference: the same requests without a session (each prefilled whole) on another service. The
tokens must be the same and the logprobs equal to 1e-5; parked pages must go to requests that wait
for them, and every page must come back when the service stops."""

import concurrent.futures

import numpy as np
import pytest

from engine_setup import CFG, ENGINE
from tpurl.generate import Engine, EngineConfig, SamplingConfig
from tpurl.generate.service import Service

SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=6)


def _sampling(session: int) -> SamplingConfig:
    """Each session its own sampling: resumes that share an extend program sample each with its own."""
    return SamplingConfig(temperature=(0.9, 0.6, 1.3)[session % 3], max_new_tokens=4 + session % 3,
                          top_k=(0, 5)[session % 2])


def _engine(**overrides):
    return Engine(CFG, EngineConfig(**{**ENGINE, **overrides}))


def _observation(session: int, call: int) -> list[int]:
    return np.random.default_rng([session, call]).integers(3, CFG.vocab_size, 1 + (session + call) % 3).tolist()


def _conversation(service, session: int, calls: int, name: str | None):
    """`calls` requests of one agent: each prompt is the last prompt, its completion and an
    observation. Returns the prompts and completions."""
    prompt = np.random.default_rng(session).integers(3, CFG.vocab_size, 3 + session % 4).tolist()
    out = []
    for k in range(calls):
        completion = service.submit(prompt, sampling=_sampling(session), seed=100 * session + k,
                                    session=name).result(120)[0]
        out.append((prompt, completion))
        prompt = prompt + completion.token_ids.tolist() + _observation(session, k)
    return out


def _pages_free(service, engine):
    return service.call(lambda: [engine.free_pages(r) for r in range(engine.replicas)]).result(60)


def _run(params, sessions: int, calls: int, named: bool, **engine):
    engine = _engine(**engine)
    with Service(engine, params) as service:
        with concurrent.futures.ThreadPoolExecutor(sessions) as agents:
            out = list(agents.map(lambda s: _conversation(service, s, calls, f"s{s}" if named else None),
                                  range(sessions)))
        held = _pages_free(service, engine)
    return out, engine, held


def _assert_same(got, want):
    for conv_got, conv_want in zip(got, want):
        for (prompt, c), (want_prompt, w) in zip(conv_got, conv_want):
            assert prompt == want_prompt
            assert c.token_ids.tolist() == w.token_ids.tolist()
            np.testing.assert_allclose(c.logprobs, w.logprobs, atol=1e-5)


@pytest.mark.slow
def test_session_calls_resume_their_pages_and_sample_what_a_prefill_would(model_and_params):
    _, params = model_and_params
    want, _, _ = _run(params, 6, 3, named=False)
    got, engine, held = _run(params, 6, 3, named=True)
    _assert_same(got, want)
    # Later calls resumed their session's pages (some may have been evicted for other requests:
    # 32 pages, 4 slots); the parked sequences hold pages until the service stops.
    assert 0 < engine.stats["session_resumes"] <= 6 * 2
    assert engine.stats["prefill_prompts"] == 6 * 3 - engine.stats["session_resumes"]
    assert held[0] < engine.num_pages
    assert [engine.free_pages(r) for r in range(engine.replicas)] == [engine.num_pages] * engine.replicas


def test_parked_pages_go_to_a_request_that_needs_them(model_and_params):
    _, params = model_and_params
    # 12 pages of 4 tokens: the parked session's pages and the long request's 11 do not fit together.
    engine = _engine(num_pages=12)
    long = SamplingConfig(temperature=0.0, max_new_tokens=12)
    with Service(engine, params) as service:
        first = _conversation(service, 0, 1, "s0")
        assert _pages_free(service, engine) < [11]
        service.submit(list(range(3, 35)), sampling=long, seed=7).result(120)
        assert engine.stats["session_evictions"] == 1
        # The session's next call finds nothing parked: it is prefilled, and samples the same.
        prompt = first[0][0] + first[0][1].token_ids.tolist() + [5, 6]
        again = service.submit(prompt, sampling=SAMPLING, seed=1, session="s0").result(120)[0]
    with Service(_engine(), params) as reference:
        want = reference.submit(prompt, sampling=SAMPLING, seed=1).result(120)[0]
    assert engine.stats["session_resumes"] == 0 and again.token_ids.tolist() == want.token_ids.tolist()
    assert [engine.free_pages(r) for r in range(engine.replicas)] == [12]


def test_a_prompt_that_rewrites_the_session_is_prefilled(model_and_params):
    _, params = model_and_params
    engine = _engine()
    with Service(engine, params) as service:
        (prompt, c), = _conversation(service, 1, 1, "s1")
        rewritten = prompt[:-1] + [prompt[-1] % 100 + 3] + c.token_ids.tolist() + [4]  # one token differs
        got = service.submit(rewritten, sampling=SAMPLING, seed=3, session="s1").result(120)[0]
        extended = prompt + c.token_ids.tolist() + [4]  # the parked sequence was released: no resume either
        service.submit(extended, sampling=SAMPLING, seed=3, session="s1").result(120)
        assert engine.stats["session_resumes"] == 0 and engine.stats["prefill_prompts"] == 3
    with Service(_engine(), params) as reference:
        want = reference.submit(rewritten, sampling=SAMPLING, seed=3).result(120)[0]
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert [engine.free_pages(r) for r in range(engine.replicas)] == [engine.num_pages]


def test_a_cancelled_request_gives_back_the_sequence_it_waited_to_resume(model_and_params):
    _, params = model_and_params
    engine = _engine(max_slots=1)
    with Service(engine, params) as service:
        (prompt, c), = _conversation(service, 2, 1, "s2")
        following = prompt + c.token_ids.tolist() + [7]
        tickets = []

        def on_token(sample, token, logprob, top):
            if not tickets:  # the slot is taken: the session's request waits to resume, and is cancelled
                tickets.append(service.submit(following, sampling=SAMPLING, seed=4, session="s2"))
                service.cancel(tickets[0])

        busy = service.submit(list(range(3, 6)), sampling=SamplingConfig(temperature=0.0, max_new_tokens=40),
                              seed=5, on_token=on_token)
        assert len(busy.result(120)[0].token_ids) == 40
        assert tickets and isinstance(tickets[0].future.exception(60), concurrent.futures.CancelledError)
        assert engine.stats["session_resumes"] == 0 and _pages_free(service, engine) == [engine.num_pages]
