"""The engine end to end against a dense full-recompute reference (a jitted forward over the whole
prefix): greedy tokens, sampled-token logprobs, isolation under NaN poisoning, group sharing,
compilation counts, pool exhaustion and rejection; paged and dense caches. The engine on
several devices with per-replica pools: test_replica_pools.py."""

import collections
import json

import jax
import numpy as np
import pytest
from flax import nnx

from engine_setup import CFG, ENGINE, GREEDY, MAX_NEW, PROMPTS, SAMPLED, tokens
from tpurl.generate import Engine, EngineConfig, KVPool, PoolExhausted, SamplingConfig, generate, request_seed
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset
from tpurl.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def dense(model_and_params):
    # Prefill calls of at most 2 prompts: a driver wave of up to 4 new prompts takes two prefill
    # calls, hence two inserts.
    return Engine(CFG, EngineConfig(**ENGINE, cache="dense", poison_free_pages=True, max_prefill_batch=2),
                  graphdef=model_and_params[0])


@pytest.mark.slow
def test_paged_greedy_matches_full_recompute(paged_greedy, greedy_reference):
    out, stats = paged_greedy
    for i, row in enumerate(out):
        assert row[0].token_ids.tolist() == greedy_reference[i], f"prompt {i} (length {i + 1})"
        assert row[0].finish_reason == "length" and row[0].prompt_ids.tolist() == PROMPTS[i]
    # 32 requests through 4 slots: slots were refilled mid-run; ~250 pages through a 32-page pool:
    # freed pages were reused; and admission had to wait for pages at least once.
    assert stats["inserts"] == 32 and stats["admission_waits"] > 0
    assert sum(-(-(len(p) + MAX_NEW - 1) // 4) for p in PROMPTS) > 4 * 32


@pytest.mark.slow
def test_sampled_logprobs_match_teacher_forced_forward(paged_sampled, full_logits):
    for j in range(2):
        seqs = [PROMPTS[i] + row[j].token_ids.tolist() for i, row in enumerate(paged_sampled)]
        logits = full_logits(seqs).astype(np.float64) / SAMPLED.temperature
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for i, row in enumerate(paged_sampled):
            n = len(PROMPTS[i])
            toks = row[j].token_ids
            ref = logp[i, np.arange(n - 1, n - 1 + len(toks)), toks]
            assert row[j].logprobs.dtype == np.float32
            np.testing.assert_allclose(row[j].logprobs, ref, atol=1e-5, err_msg=f"prompt {i} sample {j}")
    # the two samples of a prompt use different seeds
    assert any(row[0].token_ids.tolist() != row[1].token_ids.tolist() for row in paged_sampled)


def _unbatched_generate(engine, params, prompts, n_samples, sampling, seed):
    """Reference: the one-at-a-time protocol. Prompts in order, each prefilled alone (all its
    samples' first tokens), its samples inserted one per call as slots and pages free up, one decode
    step at a time. Returns `[prompt][sample] -> (tokens, logprobs)`."""
    state = engine.init_decode_state()
    out = [[None] * n_samples for _ in prompts]
    queue, todo, running = collections.deque(range(len(prompts))), collections.deque(), {}
    free = list(range(engine.max_concurrent_decodes))
    prefix = None
    while queue or todo or running:
        while free:
            if not todo:
                if not queue:
                    break
                i = queue.popleft()
                seeds = [request_seed(seed, i, j) for j in range(n_samples)]
                prefix, _ = engine.prefill(params=params, padded_tokens=prompts[i], true_length=len(prompts[i]),
                                           sampling=sampling, seeds=seeds)
                todo = collections.deque((i, j) for j in range(n_samples))
            i, j = todo[0]
            first = ([int(prefix.first_tokens[j])], [float(prefix.first_logprobs[j])])
            if prefix.finished_at_first_token(j):
                out[i][j] = first
                todo.popleft()
                continue
            if not engine.can_insert(prefix):
                break
            todo.popleft()
            slot = free.pop()
            state = engine.insert(prefix, state, slot, sample_index=j)
            running[slot] = (i, j, *first)
        state, result = engine.generate(params, state)
        result = jax.device_get(result)
        for slot, (i, j, toks, lps) in list(running.items()):
            if result.valid[slot]:
                toks.append(int(result.tokens[slot]))
                lps.append(float(result.logprobs[slot]))
                if result.done[slot]:
                    out[i][j] = (toks, lps)
                    del running[slot]
                    engine.free_resource(slot)
                    free.append(slot)
    return out


@pytest.mark.slow
def test_batched_driver_matches_unbatched_protocol(paged, model_and_params, paged_sampled):
    # The driver's waves (batched prefills and inserts, several prompts per call, admission waits
    # on the 32-page pool) against the one-prompt, one-sample protocol: same tokens, same logprobs.
    waits = paged.stats["admission_waits"]
    ref = _unbatched_generate(paged, model_and_params[1], PROMPTS, 2, SAMPLED, seed=5)
    assert tokens(paged_sampled) == [[toks for toks, _ in row] for row in ref]
    for row, ref_row in zip(paged_sampled, ref):
        for c, (_, lps) in zip(row, ref_row):
            np.testing.assert_allclose(c.logprobs, lps, atol=1e-6)
    assert waits > 0 and paged.stats["prefill_prompts"] > paged.stats["prefill_batches"]  # waves did batch


@pytest.mark.slow  # its fixtures generate for every prompt, greedy and sampled
def test_sampling_is_reproducible(paged, model_and_params, paged_sampled):
    again = generate(paged, model_and_params[1], PROMPTS[:6], n_samples=2, sampling=SAMPLED, seed=5)
    assert tokens(again) == tokens(paged_sampled[:6])  # fewer prompts, other slots: same tokens


@pytest.mark.slow
def test_group_sharing_prefills_once_per_prompt(paged, model_and_params):
    params = model_and_params[1]
    prompts = PROMPTS[9:14]  # lengths 10..14: full pages to share plus a partial page each
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    runs = {}
    for share in (True, False):
        before, before_flops = dict(paged.stats), paged.prefill_flops(params)
        out = generate(paged, params, prompts, n_samples=8, sampling=sampling, seed=11, share_prompt=share)
        delta = {k: paged.stats[k] - before.get(k, 0) for k in ("prefill_prompts", "prefill_batches")}
        runs[share] = (out, delta, paged.prefill_flops(params) - before_flops)
    (shared, count_s, flops_s), (unshared, count_u, flops_u) = runs[True], runs[False]
    # Shared: each prompt prefilled once, alone (its 8 samples fill the 4 slots twice). Unshared:
    # 40 one-sample items, 4 per wave (all finish together), so 10 calls of 4 prompts, no padding.
    assert count_s == {"prefill_prompts": 5, "prefill_batches": 5}
    assert count_u == {"prefill_prompts": 40, "prefill_batches": 10}
    # FLOPs from XLA's cost analysis of the programs that ran: 40 prompt-forwards against 5.
    assert flops_s > 0 and flops_s * 8 == pytest.approx(flops_u, rel=1e-3)
    assert tokens(shared) == tokens(unshared)
    for a, b in zip(shared, unshared):
        for ca, cb in zip(a, b):
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-6)
    assert len({tuple(t) for t in tokens(shared)[0]}) > 1  # 8 different samples
    assert paged.allocator.num_free == paged.num_pages  # every page came back


_COMPILES: list[str] = []
_COUNTING = [False]


def _on_event(event, duration, **kw):
    if _COUNTING[0] and event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.mark.slow  # its fixtures generate for every prompt, greedy and sampled
def test_compilations_fixed_as_sequences_grow(paged, model_and_params, paged_greedy, paged_sampled):
    counts = dict(paged.trace_counts)
    # One decode compilation per sampling mode (`truncate`, static: the greedy and the top-k/top-p
    # runs) and decode width (4 slots, 2 or 1 as the slots in use dwindle, `tpurl.generate.compaction`).
    assert paged._narrowing.widths == (4, 2, 1)
    assert 2 < counts["generate"] <= 2 * 3, counts
    # Bounded by the padded shapes: prefill per (prompts per call 1/2/4 -- never more than the 4
    # slots --, bucket 8/32, samples per prompt 1/2); insert per (sequences per call 1/2/4, the
    # prefill call's prompts 1/2/4 and bucket).
    assert counts["prefill"] <= 3 * 2 * 2 and counts["insert"] <= 3 * 3 * 2, counts
    params, prompts = model_and_params[1], [PROMPTS[3], PROMPTS[7]]
    warm = generate(paged, params, prompts, n_samples=2, sampling=SamplingConfig(temperature=0.5, max_new_tokens=3),
                    seed=1)
    counts = dict(paged.trace_counts)
    # The same requests, growing much longer (one wave either way: both fit in the pool).
    longer = SamplingConfig(temperature=0.5, max_new_tokens=20)
    _COUNTING[0] = True
    try:  # XLA's own count: not a single backend compilation for a run with longer sequences
        out = generate(paged, params, prompts, n_samples=2, sampling=longer, seed=1)
    finally:
        _COUNTING[0] = False
    assert min(len(c.token_ids) for row in out for c in row) > MAX_NEW
    assert _COMPILES == [] and dict(paged.trace_counts) == counts
    assert [[c.token_ids[:3].tolist() for c in row] for row in out] == tokens(warm)  # same seeds


def test_request_that_can_never_fit_is_rejected_before_work(paged, model_and_params):
    generate(paged, model_and_params[1], [PROMPTS[0]], n_samples=1, sampling=GREEDY, seed=0)
    prompts_before = paged.stats["prefill_prompts"]  # > 0: a refused request must not add to it
    with pytest.raises(ValueError, match="prompt 1: prompt of 33 tokens exceeds the longest prefill bucket"):
        generate(paged, model_and_params[1], [PROMPTS[0], [5] * 33], n_samples=1, sampling=GREEDY, seed=0)
    with pytest.raises(ValueError, match="max_seq_len=48"):
        generate(paged, model_and_params[1], [PROMPTS[0], PROMPTS[30]], n_samples=1,
                 sampling=SamplingConfig(max_new_tokens=20), seed=0)
    small = Engine(CFG, EngineConfig(**{**ENGINE, "num_pages": 5}), graphdef=model_and_params[0])
    with pytest.raises(ValueError, match="needs 8 KV pages but the pool has only 5"):
        generate(small, model_and_params[1], [PROMPTS[19]], n_samples=1, sampling=GREEDY, seed=0)
    assert paged.stats["prefill_prompts"] == prompts_before and small.stats["prefill_prompts"] == 0


@pytest.mark.slow
def test_insert_raises_when_pool_exhausted(paged, model_and_params):
    state = paged.init_decode_state()
    prefix, _ = paged.prefill(params=model_and_params[1], padded_tokens=PROMPTS[31], true_length=32,
                              sampling=GREEDY, seeds=(0, 1, 2, 3))
    for k in range(2):  # 11 pages, then 8 shared + 3 own
        state = paged.insert(prefix, state, k, sample_index=k)
    assert paged.allocator.num_free == 32 - 11 - 3 and paged.pages_needed(prefix) == 3
    state = paged.insert(prefix, state, 2, sample_index=2)
    assert paged.allocator.num_free == 15
    paged.release_prefix(prefix)
    with pytest.raises(ValueError, match="slot 0 is busy"):
        paged.insert(prefix, state, 0, sample_index=3)
    big, _ = paged.prefill(params=model_and_params[1], padded_tokens=PROMPTS[31], true_length=32,
                           sampling=SamplingConfig(max_new_tokens=16))
    state = paged.insert(big, state, 3)  # 12 pages: 3 left
    paged.free_resource(2)  # its 3 own pages come back; the shared ones are still held by slots 0, 1
    assert paged.allocator.num_free == 6
    other, _ = paged.prefill(params=model_and_params[1], padded_tokens=PROMPTS[19], true_length=20, sampling=GREEDY)
    assert paged.pages_needed(other) == 8 and not paged.can_insert(other)
    with pytest.raises(PoolExhausted, match="need 8 KV pages but only 6"):
        paged.insert(other, state, 2)
    paged.free_resource(3)
    state = paged.insert(other, state, 2)
    for slot in (0, 1, 2):
        paged.free_resource(slot)
    assert paged.allocator.num_free == 32
    # A prefix's shared pages belong to the pool they were written into: after a new decode state,
    # its next sample gets (and writes) all its pages afresh.
    pair, _ = paged.prefill(params=model_and_params[1], padded_tokens=PROMPTS[19], true_length=20,
                            sampling=GREEDY, seeds=(0, 1))
    state = paged.insert(pair, state, 0, sample_index=0)
    assert paged.pages_needed(pair) == 8 - 5
    state = paged.init_decode_state()
    assert paged.pages_needed(pair) == 8
    state = paged.insert(pair, state, 0, sample_index=1)
    assert paged.allocator.num_free == 32 - 8
    del state


@pytest.mark.slow
def test_dense_cache_matches(dense, model_and_params, greedy_reference, paged_sampled):
    params = model_and_params[1]
    greedy = generate(dense, params, PROMPTS, n_samples=1, sampling=GREEDY, seed=0)
    assert [row[0].token_ids.tolist() for row in greedy] == greedy_reference
    sampled = generate(dense, params, PROMPTS, n_samples=2, sampling=SAMPLED, seed=5)
    assert tokens(sampled) == tokens(paged_sampled)
    for a, b in zip(sampled, paged_sampled):
        for ca, cb in zip(a, b):
            assert np.isfinite(ca.logprobs).all()
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-5)
    assert dict(dense.trace_counts)["generate"] == 2  # greedy and top-k/top-p: one per sampling mode


def test_stop_tokens_and_stop_strings(paged, model_and_params, greedy_reference):
    params = model_and_params[1]
    ref = greedy_reference[4]
    stop_tok = ref[5]
    cut = ref.index(stop_tok) + 1
    out = generate(paged, params, [PROMPTS[4]], n_samples=1, seed=0,
                   sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(stop_tok,)))
    c = out[0][0]
    assert c.token_ids.tolist() == ref[:cut] and c.finish_reason == "stop" and len(c.logprobs) == cut
    # Stop strings through a character tokenizer over the tiny vocabulary.
    tok = CharTokenizer("".join(chr(0x100 + i) for i in range(CFG.vocab_size - 3)))
    target = tok.decode(ref[3:5])
    out = generate(paged, params, [PROMPTS[4]], n_samples=1, seed=0, tokenizer=tok,
                   sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW, stop_strings=(target,)))
    got = out[0][0].token_ids.tolist()
    assert target in tok.decode(got) and target not in tok.decode(got[:-1])
    assert got == ref[:len(got)] and out[0][0].finish_reason == "stop"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate(paged, params, [PROMPTS[4]], n_samples=1, seed=0, sampling=SamplingConfig(stop_strings=("x",)))


@pytest.mark.slow
def test_cli_generates_from_hf_checkpoint_dir(tmp_path, model_and_params, greedy_reference, capsys):
    from tpurl.commands.generate import main
    from tpurl.models.hf import save_hf_checkpoint

    graphdef, params = model_and_params
    save_hf_checkpoint(nnx.merge(graphdef, params), str(tmp_path / "ckpt"))
    ids = ",".join(map(str, PROMPTS[6]))
    rc = main(["--model", str(tmp_path / "ckpt"), "--prompt-ids", ids, "--max-new-tokens", str(MAX_NEW),
               "--temperature", "0", "--n", "2", "--max-slots", "2", "--page-size", "4", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["token_ids"] for c in doc["completions"]] == [greedy_reference[6]] * 2
    assert all(len(c["logprobs"]) == MAX_NEW and c["finish_reason"] == "length" for c in doc["completions"])
    assert main(["--model", str(tmp_path / "ckpt"), "--prompt", "hi"]) == 2  # no tokenizer.json
    assert "use --prompt-ids" in capsys.readouterr().err


def _pool_arrays(engine):
    shape = engine.shape.pool_shape
    return [a for a in jax.live_arrays() if a.shape == shape]


def test_pool_lives_in_the_decode_state_only(paged, model_and_params):
    import gc

    gc.collect()
    assert not _pool_arrays(paged)  # generate() dropped its state: nothing of the pool is left
    state = paged.init_decode_state()
    assert len(_pool_arrays(paged)) == 2  # k and v
    state, _ = paged.generate(model_and_params[1], state)  # donated: still one pool
    assert len(_pool_arrays(paged)) == 2
    del state
    gc.collect()
    assert not _pool_arrays(paged)
    # A pool owned by the caller (e.g. allocated after a memory handover) serves several calls and
    # is freed by its owner alone.
    with KVPool(paged) as pool:
        first = generate(paged, model_and_params[1], [PROMPTS[2]], n_samples=1, sampling=GREEDY, seed=0, pool=pool)
        assert len(_pool_arrays(paged)) == 2
        again = generate(paged, model_and_params[1], [PROMPTS[2]], n_samples=1, sampling=GREEDY, seed=0, pool=pool)
        assert len(_pool_arrays(paged)) == 2 and pool.alive
    assert not pool.alive and not _pool_arrays(paged)  # freed without a garbage collection
    assert len(first[0][0].token_ids) == MAX_NEW
    np.testing.assert_array_equal(first[0][0].token_ids, again[0][0].token_ids)
    with pytest.raises(RuntimeError, match="released"):
        pool.step(model_and_params[1])


def test_pool_sized_from_memory_budget_and_sharded_over_kv_heads(model_and_params):
    per_page = 2 * CFG.num_layers * CFG.num_kv_heads * 4 * CFG.head_dim * 4  # k+v, fp32, page_size 4
    cfg = EngineConfig(**{**ENGINE, "num_pages": None, "kv_memory_bytes": 10 * per_page + 7})
    assert Engine(CFG, cfg, graphdef=model_and_params[0]).num_pages == 10
    # 2 KV heads over tensor=2: each device holds half of every page, so the budget holds twice the
    # pages; the 4 data replicas hold one such pool each (the budget is per device).
    mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(4, 1, 2)))
    engine = Engine(CFG, cfg, mesh=mesh, layout=layout_preset("tp"), graphdef=model_and_params[0])
    assert engine.num_pages == 20 and engine.replicas == 4 and engine.shape.pool_shape[2] == 80
    k = engine.init_decode_state()["cache"]["k"]
    assert tuple(k.sharding.spec) == (None, "tensor", "data")
    assert all(2 * s.data.nbytes == 10 * per_page for s in k.addressable_shards)  # k and v: the budget
    with pytest.raises(ValueError, match="holds no page"):
        Engine(CFG, EngineConfig(**{**ENGINE, "num_pages": None, "kv_memory_bytes": 100}), graphdef=model_and_params[0])
    with pytest.raises(ValueError, match="at most one of num_pages"):
        EngineConfig(**{**ENGINE, "kv_memory_bytes": 100})


def test_failed_insert_gives_its_pages_back(paged, model_and_params, monkeypatch):
    state = paged.init_decode_state()
    pair, _ = paged.prefill(params=model_and_params[1], padded_tokens=PROMPTS[19], true_length=20,
                            sampling=GREEDY, seeds=(0, 1))
    real = paged._insert_jit

    def failing(*args):
        raise RuntimeError("injected insert failure")

    monkeypatch.setattr(paged, "_insert_jit", failing)
    with pytest.raises(RuntimeError, match="injected"):
        paged.insert(pair, state, 0, sample_index=0)  # first sample: fresh pages + the prefix's share
    assert paged.allocator.num_free == 32 and pair.shared_pages is None and not pair.inserted.any()
    monkeypatch.setattr(paged, "_insert_jit", real)
    state = paged.insert(pair, state, 0, sample_index=0)
    assert paged.allocator.num_free == 32 - 8 and pair.shared_pages is not None
    monkeypatch.setattr(paged, "_insert_jit", failing)
    with pytest.raises(RuntimeError, match="injected"):
        paged.insert(pair, state, 1, sample_index=1)  # second sample: shared pages + its own
    assert paged.allocator.num_free == 32 - 8
    monkeypatch.setattr(paged, "_insert_jit", real)
    paged.free_resource(0)
    paged.release_prefix(pair)
    assert paged.allocator.num_free == 32
    del state


def test_one_prefill_samples_each_prompt_with_its_own_sampling(paged, model_and_params):
    """`prefill_batch` with one sampling config per prompt (greedy, tempered, truncated, other
    budgets): one program for prompts of one bucket, each prompt's first tokens and logprobs
    those of a prefill of it alone with its config, and each prefix keeps its config."""
    params = model_and_params[1]
    prompts, seeds = [PROMPTS[9], PROMPTS[10], PROMPTS[11]], [[1, 2], [3], [4, 5]]
    samplings = [GREEDY, SAMPLED, SamplingConfig(temperature=1.3, top_k=5, max_new_tokens=3)]
    before = dict(paged.stats)
    pairs = paged.prefill_batch(params=params, prompts=prompts, sampling=samplings, seeds=seeds)
    assert paged.stats["prefill_batches"] - before.get("prefill_batches", 0) == 1
    for (prefix, first), p, sd, s in zip(pairs, prompts, seeds, samplings):
        (alone, want), = paged.prefill_batch(params=params, prompts=[p], sampling=s, seeds=[sd])
        assert prefix.sampling == s and first.tokens.tolist() == want.tokens.tolist()
        np.testing.assert_allclose(first.logprobs, want.logprobs, atol=1e-6)
        paged.release_prefix(alone)
    for prefix, _ in pairs:
        paged.release_prefix(prefix)
    with pytest.raises(ValueError, match="3 prompts but 3 seed lists and 2 sampling configs"):
        paged.prefill_batch(params=params, prompts=prompts, sampling=samplings[:2], seeds=seeds)


def _host_state(state):
    return jax.tree.map(np.asarray, jax.device_get(state))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_prefill_batch_and_insert_batch_match_one_at_a_time(kind, model_and_params, request):
    engine = request.getfixturevalue(kind)
    params = model_and_params[1]
    # Lengths 3 (bucket 8) and 10, 17 (bucket 32): two buckets, one call padded to 2 prompts for
    # the 1 (dense: also split by max_prefill_batch=2 where needed), samples per prompt 1, 2, 1.
    prompts = [PROMPTS[2], PROMPTS[9], PROMPTS[16]]
    seeds = [[7], [8, 9], [10]]
    before = dict(engine.stats)
    pairs = engine.prefill_batch(params=params, prompts=prompts, sampling=SAMPLED, seeds=seeds)
    assert engine.stats["prefill_batches"] - before.get("prefill_batches", 0) == 2
    assert engine.stats["prefill_prompts"] - before.get("prefill_prompts", 0) == 3
    singles = [engine.prefill(params=params, padded_tokens=p, true_length=len(p), sampling=SAMPLED, seeds=sd)
               for p, sd in zip(prompts, seeds)]
    for (pb, fb), (ps, fs), p in zip(pairs, singles, prompts):
        assert fb.tokens.tolist() == fs.tokens.tolist() and pb.prompt_ids.tolist() == p
        np.testing.assert_allclose(fb.logprobs, fs.logprobs, atol=1e-6)
        n = len(p)
        np.testing.assert_allclose(np.asarray(pb.k)[:, pb.row, :n], np.asarray(ps.k)[:, 0, :n], atol=1e-6)
        np.testing.assert_allclose(np.asarray(pb.v)[:, pb.row, :n], np.asarray(ps.v)[:, 0, :n], atol=1e-6)
    (p3, _), (p10, _), (p17, _) = pairs
    assert p10.k is p17.k and p3.k is not p10.k
    # Group prompt p10: its sample 1 goes first (writes the whole prompt), sample 0 second (shares
    # the full pages, writes its own last page). Slots out of order.
    batch_a = [(p10, 3, 1), (p17, 0, 0), (p10, 2, 0)]
    batch_b = [(p3, 1, 0)]
    runs = {}
    for mode in ("batched", "single"):
        state = engine.init_decode_state()
        if mode == "batched":
            with pytest.raises(ValueError, match="different prefill calls"):
                state = engine.insert_batch(state, batch_a + batch_b)
            state = engine.insert_batch(state, batch_a)
            state = engine.insert_batch(state, batch_b)
        else:
            by_id = {id(pb): ps for (pb, _), (ps, _) in zip(pairs, singles)}
            for prefix, slot, k in batch_a + batch_b:
                state = engine.insert(by_id[id(prefix)], state, slot, sample_index=k)
        pages = None if engine.num_pages is None else engine.num_pages - engine.allocator.num_free
        state, result = engine.generate(params, state)
        runs[mode] = (_host_state(state), jax.device_get(result), pages)
        for slot in range(4):
            engine.free_resource(slot)
        del state
    (sb, rb, pages_b), (ss, rs, pages_s) = runs["batched"], runs["single"]
    assert pages_b == pages_s and (pages_b is None or pages_b == 4 + (6 + 4) + 7)
    for name in sb:
        if name == "cache":
            for kv in ("k", "v"):
                np.testing.assert_allclose(sb[name][kv], ss[name][kv], atol=1e-6, err_msg=kv)
        else:
            np.testing.assert_array_equal(sb[name], ss[name], err_msg=name)
    assert rb.tokens.tolist() == rs.tokens.tolist() and rb.valid.all()
    np.testing.assert_allclose(rb.logprobs, rs.logprobs, atol=1e-6)
    assert all(p.shared_pages is None and p.inserted.all() for p, _ in pairs)  # released when all placed


@pytest.mark.slow
def test_failed_insert_batch_takes_nothing_and_keeps_pending_clears(paged, model_and_params, monkeypatch):
    params = model_and_params[1]
    state = paged.init_decode_state()
    filler, _ = paged.prefill(params=params, padded_tokens=PROMPTS[31], true_length=32,
                              sampling=SamplingConfig(max_new_tokens=13))
    state = paged.insert(filler, state, 1)  # 11 pages
    lone, _ = paged.prefill(params=params, padded_tokens=PROMPTS[3], true_length=4, sampling=GREEDY)
    state = paged.insert(lone, state, 0)  # 4 pages
    paged.free_resource(0)  # its pages are free again; slot 0 is deactivated by the next call
    assert paged.allocator.num_free == 21 and paged.page_book.pending_clears == {0}
    (pair, _), (big, _) = paged.prefill_batch(params=params, prompts=[PROMPTS[19], PROMPTS[31]], sampling=GREEDY,
                                              seeds=[(0, 1), (2,)])
    # The pair takes 8 + 3 pages (its full prompt pages shared), then the big one needs 11 of 10.
    with pytest.raises(PoolExhausted, match="need 11 KV pages but only 10"):
        paged.insert_batch(state, [(pair, 2, 0), (pair, 3, 1), (big, 0, 0)])
    # Nothing taken, nothing recorded: the pair's shared pages were given back with the rest.
    assert paged.allocator.num_free == 21 and pair.shared_pages is None and not pair.inserted.any()
    book = paged.page_book
    assert book.pending_clears == {0} and book.pages_of(2) is None and book.pages_of(3) is None

    def failing(*args):
        raise RuntimeError("injected insert failure")

    real = paged._insert_jit
    monkeypatch.setattr(paged, "_insert_jit", failing)
    with pytest.raises(RuntimeError, match="injected"):
        paged.insert_batch(state, [(pair, 2, 1), (pair, 3, 0)])
    assert paged.allocator.num_free == 21 and pair.shared_pages is None and paged.page_book.pending_clears == {0}
    monkeypatch.setattr(paged, "_insert_jit", real)
    with pytest.raises(ValueError, match="slot 2 is busy"):
        paged.insert_batch(state, [(pair, 2, 1), (pair, 2, 0)])
    with pytest.raises(ValueError, match="sample 1 of this prefix was already inserted"):
        paged.insert_batch(state, [(pair, 2, 1), (pair, 3, 1)])
    state = paged.insert_batch(state, [(pair, 2, 1), (pair, 3, 0)])  # 8 + 3 pages
    assert paged.allocator.num_free == 10 and not paged.page_book.pending_clears
    host = _host_state(state)
    assert not host["active"][0] and (host["page_table"][0] == paged.num_pages).all()  # cleared in the insert
    assert host["active"][[1, 2, 3]].all()
    for slot in (1, 2, 3):
        paged.free_resource(slot)
    paged.release_prefix(big)
    assert paged.allocator.num_free == 32
    del state
