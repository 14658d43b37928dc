"""Fixtures of the engine tests (tests/generate/test_engine.py, test_replica_pools.py): the model,
its dense full-recompute reference, and a paged engine's greedy and sampled outputs.

The model and the reference are the same for every module (session scope); an engine keeps
counters that tests read, so each module gets its own."""

import jax
import numpy as np
import pytest
from flax import nnx

from engine_setup import CFG, ENGINE, GREEDY, MAX_NEW, PROMPTS, SAMPLED, SEQ
from tpurl.generate import Engine, EngineConfig, generate
from tpurl.models import forward_logits, init_model


@pytest.fixture(scope="session")
def model_and_params():
    model = init_model(CFG, seed=0)
    graphdef, params = nnx.split(model)
    return graphdef, params


@pytest.fixture(scope="session")
def full_logits(model_and_params):
    """Reference: float32 logits `[B, SEQ, V]` of right-padded full sequences, no cache."""
    graphdef, params = model_and_params
    fn = jax.jit(lambda p, toks, valid: forward_logits(nnx.merge(graphdef, p), toks, valid))

    def run(seqs):
        toks = np.zeros((len(seqs), SEQ), np.int32)
        valid = np.zeros((len(seqs), SEQ), bool)
        for i, s in enumerate(seqs):
            toks[i, :len(s)], valid[i, :len(s)] = s, True
        return np.asarray(fn(params, toks, valid))

    return run


@pytest.fixture(scope="session")
def greedy_reference(full_logits):
    """Greedy continuations by argmax of a full forward over the whole prefix at every step."""
    seqs = [list(p) for p in PROMPTS]
    for _ in range(MAX_NEW):
        logits = full_logits(seqs)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, PROMPTS)]


@pytest.fixture(scope="module")
def paged(model_and_params):
    return Engine(CFG, EngineConfig(**ENGINE), graphdef=model_and_params[0])


@pytest.fixture(scope="module")
def paged_greedy(paged, model_and_params):
    out = generate(paged, model_and_params[1], PROMPTS, n_samples=1, sampling=GREEDY, seed=0)
    return out, dict(paged.stats)


@pytest.fixture(scope="module")
def paged_sampled(paged, model_and_params, paged_greedy):
    return generate(paged, model_and_params[1], PROMPTS, n_samples=2, sampling=SAMPLED, seed=5)
