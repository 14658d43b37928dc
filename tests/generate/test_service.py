"""`Service`: requests that join a running continuous batch from other threads.

Reference: `generate` of each request alone (same prompt, sampling and seed) on its own engine.
The service must give every request the same tokens (and logprobs) whatever else runs, take new
requests while others decode, free a cancelled request's slots and pages, and end cleanly."""

import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from engine_setup import CFG, ENGINE, MAX_NEW, PROMPTS
from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.generate.service import Service, ServiceClosed

SAMPLINGS = [SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW),
             SamplingConfig(temperature=0.9, max_new_tokens=MAX_NEW - 5),
             SamplingConfig(temperature=0.7, top_p=0.8, max_new_tokens=MAX_NEW, stop_token_ids=(7, 9)),
             SamplingConfig(temperature=1.2, top_k=5, max_new_tokens=3)]


def _engine():
    return Engine(CFG, EngineConfig(**ENGINE))


def _requests(count):
    """(prompt, n, sampling, seed) of `count` requests of mixed lengths and sampling configs."""
    return [(PROMPTS[(7 * i) % len(PROMPTS)], 1 + i % 3, SAMPLINGS[i % len(SAMPLINGS)], 1000 + i)
            for i in range(count)]


def _alone(engine, params, request):
    """Token ids and logprobs of `request` run alone with `generate`."""
    prompt, n, sampling, seed = request
    # The service draws sample j of a request seeded s with request_seed(s, 0, j): generate's for
    # prompt 0 of a call seeded s.
    out = generate(engine, params, [prompt], n_samples=n, sampling=sampling, seed=seed)[0]
    return [c.token_ids.tolist() for c in out], [c.logprobs for c in out]


def _free_pages(engine):
    return [engine.free_pages(r) for r in range(engine.replicas)]


@pytest.mark.slow
def test_concurrent_requests_match_each_alone(model_and_params):
    graphdef, params = model_and_params
    requests = _requests(24)
    reference = _engine()
    expected = [_alone(reference, params, r) for r in requests]
    engine = _engine()
    with Service(engine, params) as service:
        with concurrent.futures.ThreadPoolExecutor(8) as clients:  # submitted from several threads at once
            tickets = list(clients.map(lambda r: service.submit(r[0], n=r[1], sampling=r[2], seed=r[3]), requests))
        results = [t.result(timeout=120) for t in tickets]
        assert service.call(lambda: _free_pages(engine)).result() == [engine.num_pages] * engine.replicas
    for (want_tokens, want_logprobs), got in zip(expected, results):
        assert [c.token_ids.tolist() for c in got] == want_tokens
        for lp, c in zip(want_logprobs, got):
            np.testing.assert_allclose(c.logprobs, lp, atol=1e-5)
    # Requests of different sampling configs decoded side by side: fewer steps than one after another.
    assert engine.stats["decode_steps"] < sum(r[2].max_new_tokens for r in requests)


@pytest.mark.slow
def test_a_request_joins_while_another_decodes(model_and_params):
    _, params = model_and_params
    long = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    short = SamplingConfig(temperature=0.0, max_new_tokens=2)
    engine = _engine()
    started = threading.Event()
    with Service(engine, params) as service:
        first = service.submit(PROMPTS[20], sampling=long, seed=1, on_token=lambda j, t, lp, top: started.set())
        assert started.wait(60)
        second = service.submit(PROMPTS[3], sampling=short, seed=2)
        second.result(timeout=60)
        # The short request, submitted after the long one had started, ended before it.
        assert not first.done() or len(first.result()[0].token_ids) == MAX_NEW
        tokens = first.result(timeout=60)[0].token_ids.tolist()
    assert tokens == _alone(_engine(), params, (PROMPTS[20], 1, long, 1))[0][0]


def test_streamed_tokens_are_the_completion(model_and_params):
    _, params = model_and_params
    streamed = {0: [], 1: []}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    with Service(_engine(), params) as service:
        got = service.submit(PROMPTS[9], n=2, sampling=sampling, seed=5,
                             on_token=lambda j, t, lp, top: streamed[j].append((t, lp))).result(timeout=60)
    for c in got:
        assert [t for t, _ in streamed[c.sample_index]] == c.token_ids.tolist()
        np.testing.assert_array_equal([lp for _, lp in streamed[c.sample_index]], c.logprobs)


@pytest.mark.slow
def test_cancel_frees_slots_and_pages_and_others_go_on(model_and_params):
    _, params = model_and_params
    engine = _engine()
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    decoding = threading.Event()
    with Service(engine, params) as service:
        victim = service.submit(PROMPTS[31], n=3, sampling=sampling, seed=1,
                                on_token=lambda j, t, lp, top: decoding.set())
        other = service.submit(PROMPTS[12], sampling=sampling, seed=2)
        assert decoding.wait(60)
        service.cancel(victim)
        with pytest.raises(concurrent.futures.CancelledError):
            victim.result(timeout=60)
        assert other.result(timeout=60)[0].token_ids.tolist() == _alone(_engine(), params,
                                                                         (PROMPTS[12], 1, sampling, 2))[0][0]
        assert service.call(lambda: _free_pages(engine)).result() == [engine.num_pages] * engine.replicas
        service.cancel(other)  # already done: nothing happens
        assert service.alive


def test_a_failing_stream_callback_ends_only_its_request(model_and_params):
    _, params = model_and_params
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)

    def broken(j, token, logprob, top):
        raise OSError("client went away")

    engine = _engine()
    with Service(engine, params) as service:
        bad = service.submit(PROMPTS[5], sampling=sampling, seed=1, on_token=broken)
        good = service.submit(PROMPTS[6], sampling=sampling, seed=2)
        with pytest.raises(OSError, match="client went away"):
            bad.result(timeout=60)
        assert len(good.result(timeout=60)[0].token_ids) == MAX_NEW
        assert service.call(lambda: _free_pages(engine)).result() == [engine.num_pages] * engine.replicas


def test_a_failing_sample_callback_cancels_its_other_samples(model_and_params):
    """`on_sample` raising on the first finished sample fails the request with that error and
    frees its other, still running samples (their slots and pages) at once."""
    _, params = model_and_params
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=MAX_NEW, stop_token_ids=(7, 9))
    engine = _engine()
    seed = next(s for s in range(100)  # one sample ends well before the others
                if len({len(t) for t in _alone(engine, params, (PROMPTS[3], 3, sampling, s))[0]}) > 1
                and min(len(t) for t in _alone(engine, params, (PROMPTS[3], 3, sampling, s))[0]) < MAX_NEW - 2)
    finished = []

    def broken(completion):
        finished.append(completion.sample_index)
        raise OSError("client went away")

    with Service(engine, params) as service:
        bad = service.submit(PROMPTS[3], n=3, sampling=sampling, seed=seed, on_sample=broken)
        with pytest.raises(OSError, match="client went away"):
            bad.result(timeout=60)
        pages, used = service.call(lambda: (_free_pages(engine), engine.page_book.used_slots())).result()
        assert pages == [engine.num_pages] * engine.replicas and not used and len(finished) == 1


def test_bad_requests_are_refused_at_submit(model_and_params):
    _, params = model_and_params
    with Service(_engine(), params) as service:
        with pytest.raises(ValueError, match="max_seq_len"):
            service.submit(PROMPTS[31], sampling=SamplingConfig(max_new_tokens=40))
        with pytest.raises(ValueError, match="vocab"):
            service.submit([CFG.vocab_size + 3], sampling=SamplingConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match="at least one sample"):
            service.submit(PROMPTS[1], n=0, sampling=SamplingConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match="tokenizer"):
            service.submit(PROMPTS[1], sampling=SamplingConfig(max_new_tokens=4, stop_strings=("x",)))
        assert service.alive


def test_close_fails_open_requests_and_stops_the_thread(model_and_params):
    _, params = model_and_params
    service = Service(_engine(), params)
    open_ticket = service.submit(PROMPTS[30], n=3, sampling=SamplingConfig(max_new_tokens=MAX_NEW), seed=3)
    service.close()
    with pytest.raises(ServiceClosed):  # 12 decode steps: the close comes first
        open_ticket.result(timeout=1)
    assert not service._thread.is_alive() and not service.alive
    assert "tpurl-service" not in [t.name for t in threading.enumerate()]
    with pytest.raises(ServiceClosed):
        service.submit(PROMPTS[1], sampling=SamplingConfig(max_new_tokens=4))



@pytest.mark.slow
def test_inline_service_runs_on_the_callers_thread_and_pool(model_and_params):
    """`background=False`: the caller's thread runs the batch on its own pool until `done`; what is
    still open then fails, and every slot and page of the pool is free again for its next user."""
    from tpurl.generate import KVPool
    _, params = model_and_params
    engine = _engine()
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=2)  # ends long before the other request
    with KVPool(engine) as pool:
        service = Service(engine, params, background=False)
        done = concurrent.futures.Future()
        finished = service.submit(PROMPTS[4], sampling=sampling, seed=1)
        finished.future.add_done_callback(lambda _: done.set_result(None))
        unfinished = service.submit(PROMPTS[30], n=3, sampling=SamplingConfig(max_new_tokens=MAX_NEW), seed=2)
        threads = set()
        finished.future.add_done_callback(lambda _: threads.add(threading.current_thread()))
        service.run_until(done, pool)
        assert threads == {threading.current_thread()}
        assert finished.result()[0].token_ids.tolist() == _alone(_engine(), params, (PROMPTS[4], 1, sampling, 1))[0][0]
        with pytest.raises(ServiceClosed):
            unfinished.result(timeout=1)
        assert _free_pages(engine) == [engine.num_pages] * engine.replicas
        assert not engine.page_book.used_slots()
        # The same pool serves a generate call afterwards.
        again = generate(engine, params, [PROMPTS[4]], n_samples=1, sampling=sampling, seed=1, pool=pool)
        assert again[0][0].token_ids.tolist() == finished.result()[0].token_ids.tolist()


@pytest.mark.slow
def test_requests_of_different_sampling_share_one_prefill(model_and_params):
    """Requests waiting together with four sampling configs (greedy, tempered, truncated, other
    budgets and stops) and prompts of one bucket are prefilled by one program, each sampled with
    its own config (the tokens of each alone)."""
    from tpurl.generate import KVPool
    _, params = model_and_params
    engine = _engine()
    requests = [(PROMPTS[i], 1, s, 50 + i) for i, s in enumerate(SAMPLINGS)]  # prompts of 1-4 tokens: bucket 8
    with KVPool(engine) as pool:
        service = Service(engine, params, background=False)
        tickets = [service.submit(p, n=n, sampling=s, seed=seed) for p, n, s, seed in requests]
        done = concurrent.futures.Future()

        def finished(_):
            if all(t.future.done() for t in tickets) and not done.done():
                done.set_result(None)

        for t in tickets:
            t.future.add_done_callback(finished)
        service.run_until(done, pool)
    assert engine.stats["prefill_batches"] == 1
    for ticket, request in zip(tickets, requests):
        assert [c.token_ids.tolist() for c in ticket.result()] == _alone(_engine(), params, request)[0]


def _spy_top(engine) -> list[tuple[str, bool]]:
    """Record, for each prefill, decode step and extend `engine` runs, whether its results carry
    top logprobs (wraps the engine's own methods; their results pass through unchanged)."""
    seen = []
    prefill, decode, extend = engine.prefill_batch, engine.generate, engine.extend_batch

    def prefill_batch(**kw):
        out = prefill(**kw)
        seen.append(("prefill", any(prefix.first_top is not None for prefix, _ in out)))
        return out

    def generate(params, state, **kw):
        state, result = decode(params, state, **kw)
        seen.append(("decode", result.top is not None))
        return state, result

    def extend_batch(params, state, requests, sampling):
        state, result = extend(params, state, requests, sampling)
        seen.append(("extend", result.top is not None))
        return state, result

    engine.prefill_batch, engine.generate, engine.extend_batch = prefill_batch, generate, extend_batch
    return seen


@pytest.mark.slow
def test_top_logprobs_are_computed_only_for_the_requests_that_ask(model_and_params):
    """`SamplingConfig.top_logprobs` per request, on an engine that computes up to 3 per token: while
    no request asks, no prefill, decode step or session resume computes any (the programs without
    top-k); a request asking for 2 gets the 2 most likely of every token (those an engine reports
    for every request, sliced), its batch-mates none; every request samples the tokens it samples
    alone on an engine that reports nothing."""
    _, params = model_and_params
    engine = Engine(CFG, EngineConfig(**ENGINE, top_logprobs=3))
    seen = _spy_top(engine)
    none = SamplingConfig(temperature=0.9, max_new_tokens=MAX_NEW, top_logprobs=0)
    two = dataclasses.replace(none, top_logprobs=2)
    prompt, short = PROMPTS[2], dataclasses.replace(none, max_new_tokens=4)  # session calls fit the prefill bucket
    with Service(engine, params) as service:
        quiet = [service.submit(PROMPTS[i], n=2, sampling=none, seed=i) for i in (3, 17, 25)]
        first = service.submit(prompt, sampling=short, seed=5, session="s").result(120)[0]
        following = [*prompt, *first.token_ids.tolist(), 11, 12]
        again = service.submit(following, sampling=short, seed=6, session="s").result(120)[0]
        quiet = [t.result(120) for t in quiet]
        assert seen and not any(top for _, top in seen), seen
        assert {kind for kind, _ in seen} == {"prefill", "decode", "extend"}  # the session resumed
        seen.clear()
        mixed = [service.submit(PROMPTS[i], n=2, sampling=s, seed=i) for i, s in ((3, none), (17, two), (25, none))]
        mixed = [t.result(120) for t in mixed]
        assert any(top for _, top in seen)
        # A session resume that asks, and samples that their first token ends (no slot): theirs too.
        resumed = service.submit([*following, *again.token_ids.tolist(), 13], seed=7, session="s",
                                 sampling=dataclasses.replace(short, top_logprobs=2)).result(120)[0]
        one = service.submit(PROMPTS[4], n=3, sampling=dataclasses.replace(two, max_new_tokens=1), seed=8).result(120)
        assert ("extend", True) in seen
        seen.clear()  # and off again once no request that asks runs
        service.submit(PROMPTS[5], n=2, sampling=none, seed=9).result(120)
        assert seen and not any(top for _, top in seen), seen
    for c in (resumed, *one):
        assert len(c.top) == len(c.token_ids) and all(len(ids) == len(lps) == 2 for ids, lps in c.top)
    plain = Engine(CFG, EngineConfig(**ENGINE))
    for i, got in zip((3, 17, 25), mixed):
        assert [c.token_ids.tolist() for c in got] == _alone(plain, params, (PROMPTS[i], 2, none, i))[0]
    assert [c.token_ids.tolist() for c in quiet[1]] == [c.token_ids.tolist() for c in mixed[1]]
    assert all(c.top is None for row in (*quiet, mixed[0], mixed[2]) for c in row) and again.top is None
    every = generate(Engine(CFG, EngineConfig(**ENGINE, top_logprobs=3)), params, [PROMPTS[17]], n_samples=2,
                     sampling=dataclasses.replace(none, top_logprobs=None), seed=17)[0]
    for got, want in zip(mixed[1], every):
        assert len(got.top) == len(got.token_ids) and all(len(ids) == 2 for ids, _ in got.top)
        assert [ids for ids, _ in got.top] == [ids[:2] for ids, _ in want.top]
        np.testing.assert_allclose([lp for _, lp in got.top], [lp[:2] for _, lp in want.top], atol=1e-5)


def test_a_request_asking_for_more_top_logprobs_than_the_engine_computes_is_refused(model_and_params):
    _, params = model_and_params
    with Service(Engine(CFG, EngineConfig(**ENGINE, top_logprobs=3)), params) as service:
        with pytest.raises(ValueError, match=r"SamplingConfig.top_logprobs=4 exceeds EngineConfig.top_logprobs=3"):
            service.submit(PROMPTS[3], sampling=SamplingConfig(max_new_tokens=4, top_logprobs=4), seed=1)
    engine = Engine(CFG, EngineConfig(**ENGINE, top_logprobs=3))  # generate() refuses before any work
    with pytest.raises(ValueError, match=r"SamplingConfig.top_logprobs=4 exceeds EngineConfig.top_logprobs=3"):
        generate(engine, params, [PROMPTS[3]], n_samples=2, sampling=SamplingConfig(max_new_tokens=4, top_logprobs=4),
                 seed=1)
    assert not any(engine.trace_counts.values()), engine.trace_counts
    dense = Engine(CFG, EngineConfig(**ENGINE, cache="dense"))  # and multi-turn episodes without pages
    with pytest.raises(ValueError, match=r"multi-turn episodes \(on_turn_end\) .* needs the paged cache"):
        generate(dense, params, [PROMPTS[3]], n_samples=1, sampling=SamplingConfig(max_new_tokens=4), seed=1,
                 on_turn_end=lambda *a: None)
    assert not any(dense.trace_counts.values()), dense.trace_counts
    with pytest.raises(ValueError, match="SamplingConfig.top_logprobs must be >= 0"):
        SamplingConfig(top_logprobs=-1)
