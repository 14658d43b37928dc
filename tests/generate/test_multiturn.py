"""Multi-turn episodes in the engine: a turn ends at a tool-call stop, the environment's observation
is appended to the sequence's own KV pages by a prefill at its current position (`extend_batch`),
and decoding goes on. Checked against a dense recompute of the whole transcript: every model
token's logprob equals the teacher-forced one (so the cache equals a single prefill of it); the
environment's tokens are marked as not sampled; a sequence waiting for its tool holds no decode
slot, and other sequences decode meanwhile."""

import functools
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, KVPool, SamplingConfig, generate
from tpurl.generate.extend import Resume
from tpurl.models import forward_logits, init_model, preset
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

CFG = preset("tiny")
STOPS = tuple(range(100, 128))  # 28 of 128 ids end a turn: turns of a few tokens
MAX_NEW = 40
SEQ = 64
ENGINE = dict(max_slots=4, max_seq_len=SEQ, page_size=4, prefill_buckets=(16,), max_stop_tokens=32)
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=MAX_NEW, stop_token_ids=STOPS)
PROMPTS = [np.random.default_rng(7 + n).integers(3, 90, n).tolist() for n in (3, 9, 14, 5, 11, 7)]


def observation(i: int, j: int, turn: int) -> list[int]:
    """A deterministic tool result of 1-6 tokens (ids below the stop range)."""
    return np.random.default_rng([i, j, turn]).integers(3, 90, 1 + (i + j + turn) % 6).tolist()


class ToolEnv:
    """Answers every stopped turn with an observation, for at most `turns` turns; records calls."""

    def __init__(self, turns: int = 3, delay: float = 0.0):
        self.turns, self.delay = turns, delay
        self.calls: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, i, j, token_ids):
        with self.lock:
            turn = sum(1 for c in self.calls if c[:2] == (i, j))
            self.calls.append((i, j, len(token_ids)))
        if self.delay:
            time.sleep(self.delay)
        return None if turn >= self.turns else observation(i, j, turn)


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(init_model(CFG, seed=3))
    return graphdef, params


@functools.cache
def _forward(graphdef):
    """The model's logits as one jitted program (the dense recompute of every episode)."""
    return jax.jit(lambda params, seq, valid: forward_logits(nnx.merge(graphdef, params), seq, valid))


def _teacher_forced_logprobs(model, prompt, tokens, temperature):
    graphdef, params = model
    ids = list(prompt) + list(tokens)
    seq, valid = np.zeros((1, SEQ), np.int32), np.zeros((1, SEQ), bool)  # padded at the end: one program
    seq[0, :len(ids)], valid[0, :len(ids)] = ids, True
    logits = np.asarray(_forward(graphdef)(params, seq, valid))[0, :len(ids)]
    logits = logits.astype(np.float64) / temperature
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    n = len(prompt)
    return logp[np.arange(n - 1, n - 1 + len(tokens)), tokens]


def _check_episodes(model, out, env_turns):
    multi = 0
    for i, row in enumerate(out):
        for j, c in enumerate(row):
            mask = c.model_mask
            assert len(mask) == len(c.token_ids) == len(c.logprobs) and mask[0]
            want = _teacher_forced_logprobs(model, PROMPTS[i], c.token_ids, SAMPLING.temperature)
            np.testing.assert_allclose(c.logprobs[mask], want[mask], atol=1e-5, err_msg=f"prompt {i} sample {j}")
            assert np.all(c.logprobs[~mask] == 0)
            # The environment's tokens are exactly its observations, after each stopped turn.
            obs = c.token_ids[~mask].tolist()
            assert obs == sum((observation(i, j, t) for t in range(c.turns - 1)), [])
            assert c.turns <= env_turns + 1 and len(c.token_ids) <= MAX_NEW
            multi += c.turns > 1
    assert multi >= 6  # most episodes had several turns


def test_multi_turn_equals_a_dense_recompute(model):
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0])
    env = ToolEnv()
    out = generate(engine, model[1], PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=env, version=5)
    _check_episodes(model, out, env.turns)
    # The weights' policy version is on every sampled token; the environment's tokens carry none.
    for c in (c for row in out for c in row):
        np.testing.assert_array_equal(c.versions, np.where(c.model_mask, 5, -1))
    assert engine.stats["extends"] == sum(c.turns - 1 for row in out for c in row) > 0
    # One decode program per width (`tpurl.generate.compaction`), extends per token bucket and
    # width; some steps and extends ran narrowed, between detaches and resumes, and still match
    # the dense recompute.
    widths = len(engine._narrowing.widths)
    assert engine.trace_counts["generate"] <= widths and engine.trace_counts["extend"] <= 3 * widths
    assert engine.stats["decode_slot_steps"] < engine.stats["decode_steps"] * engine.config.max_slots
    # Every episode ended by its environment (None) or by the token budget.
    assert all(c.finish_reason == "stop" or len(c.token_ids) >= MAX_NEW - 6 for row in out for c in row)


def test_multi_turn_on_per_replica_pools_matches_one_device(model):
    mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(2, 1, 4)))
    engine = Engine(CFG, EngineConfig(**ENGINE), mesh=mesh, layout=layout_preset("tp"), graphdef=model[0])
    assert engine.replicas == 2
    out = generate(engine, model[1], PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=ToolEnv())
    single = Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0])
    ref = generate(single, model[1], PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=ToolEnv())
    for row, ref_row in zip(out, ref):
        for c, r in zip(row, ref_row):
            assert c.token_ids.tolist() == r.token_ids.tolist() and c.model_mask.tolist() == r.model_mask.tolist()
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=1e-5)


def test_slots_keep_decoding_while_a_tool_runs(model):
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0])
    seen = []

    def slow_tool(i, j, token_ids):
        before = engine.stats["decode_steps"]
        time.sleep(0.3)
        seen.append(engine.stats["decode_steps"] - before)
        return None  # end the episode

    generate(engine, model[1], PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=slow_tool)
    assert max(seen) > 0  # other sequences decoded while this tool slept


def test_a_detached_sequence_resumes_in_any_free_slot_of_its_replica(model):
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0])
    prompt = PROMPTS[1]
    with KVPool(engine) as pool:
        with pytest.raises(ValueError, match="slot 0 holds no sequence"):
            engine.detach(0)
        prefix, _ = engine.prefill(params=model[1], padded_tokens=prompt, true_length=len(prompt), sampling=SAMPLING,
                                   seeds=(11,))
        pool.insert_batch([(prefix, 0, 0)])
        first = int(prefix.first_tokens[0])
        seq = engine.detach(0)
        obs = [5, 6, 7]
        resume = Resume(slot=2, seq=seq, tokens=[first, *obs], start=len(prompt), steps=1, remaining=MAX_NEW - 4,
                        seed=11)
        too_long = Resume(slot=2, seq=seq, tokens=[first] * (len(seq.pages) * 4), start=len(prompt), steps=1,
                          remaining=4, seed=11)
        with pytest.raises(ValueError, match="budget is exhausted"):
            pool.extend(model[1], [too_long], SAMPLING)
        result = jax.device_get(pool.extend(model[1], [resume], SAMPLING))
        assert result.valid[2] and not result.valid[[0, 1, 3]].any() and not seq.pages  # the slot owns them now
        # The token sampled after the observation has the transcript's teacher-forced logprob.
        want = _teacher_forced_logprobs(model, prompt, [first, *obs, int(result.tokens[2])], SAMPLING.temperature)
        np.testing.assert_allclose(result.logprobs[2], want[-1], atol=1e-5)
        with pytest.raises(ValueError, match="slot 2 is not free"):
            pool.extend(model[1], [resume], SAMPLING)
        engine.free_resource(2)
        assert engine.allocator.num_free == engine.num_pages
    dense = Engine(CFG, EngineConfig(**ENGINE, cache="dense"), graphdef=model[0])
    with pytest.raises(ValueError, match="paged engine"):
        dense.detach(0)


def test_one_extend_resumes_each_sequence_with_its_own_sampling(model):
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0])
    cool = SamplingConfig(temperature=0.5, max_new_tokens=MAX_NEW - 10, stop_token_ids=STOPS[:4])
    with KVPool(engine) as pool:
        resumes = []
        for slot, (prompt, seed) in enumerate([(PROMPTS[1], 11), (PROMPTS[2], 12)]):
            prefix, _ = engine.prefill(params=model[1], padded_tokens=prompt, true_length=len(prompt),
                                       sampling=SAMPLING, seeds=(seed,))
            pool.insert_batch([(prefix, slot, 0)])
            first = int(prefix.first_tokens[0])
            resumes.append((prompt, [first, 5, 6, 7], Resume(slot=slot + 2, seq=engine.detach(slot),
                                                                tokens=[first, 5, 6, 7], start=len(prompt), steps=1,
                                                                remaining=MAX_NEW - 4, seed=seed)))
        with pytest.raises(ValueError, match="2 requests but 3 sampling configs"):
            pool.extend(model[1], [r for *_, r in resumes], [SAMPLING] * 3)
        result = jax.device_get(pool.extend(model[1], [r for *_, r in resumes], [SAMPLING, cool]))
        for (prompt, tokens, r), sampling in zip(resumes, [SAMPLING, cool]):
            want = _teacher_forced_logprobs(model, prompt, [*tokens, int(result.tokens[r.slot])], sampling.temperature)
            np.testing.assert_allclose(result.logprobs[r.slot], want[-1], atol=1e-5)  # each at its own temperature


def test_top_logprobs_of_every_sampled_token_equal_a_dense_recompute(model):
    """`EngineConfig.top_logprobs`: the first token (prefill), every decoded one (narrowed steps too)
    and every first token after an observation (extend) report the k most likely tokens of their
    tempered distribution, as a dense recompute of the transcript gives them; environment tokens
    report none; the sampled tokens are those of an engine that reports none."""
    k = 3
    engine = Engine(CFG, EngineConfig(**ENGINE, top_logprobs=k), graphdef=model[0])
    out = generate(engine, model[1], PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=ToolEnv())
    plain = generate(Engine(CFG, EngineConfig(**ENGINE), graphdef=model[0]), model[1], PROMPTS, n_samples=2,
                     sampling=SAMPLING, seed=1, on_turn_end=ToolEnv())
    graphdef, params = model
    for i, (row, plain_row) in enumerate(zip(out, plain)):
        for c, p in zip(row, plain_row):
            np.testing.assert_array_equal(c.token_ids, p.token_ids)
            assert p.top is None and len(c.top) == len(c.token_ids)
            ids = PROMPTS[i] + c.token_ids.tolist()
            seq, valid = np.zeros((1, SEQ), np.int32), np.zeros((1, SEQ), bool)
            seq[0, :len(ids)], valid[0, :len(ids)] = ids, True
            logits = np.asarray(_forward(graphdef)(params, seq, valid), np.float64)[0] / SAMPLING.temperature
            logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
                - logits.max(-1, keepdims=True)
            for t, (top, sampled) in enumerate(zip(c.top, c.model_mask)):
                if not sampled:
                    assert top is None
                    continue
                row_lp = logp[len(PROMPTS[i]) - 1 + t]
                np.testing.assert_allclose(top[1], np.sort(row_lp)[::-1][:k], atol=1e-5)
                np.testing.assert_allclose(row_lp[top[0]], top[1], atol=1e-5)  # the ids are those tokens
    assert engine.stats["extends"] > 0
