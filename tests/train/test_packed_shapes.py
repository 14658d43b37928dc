"""Packed shapes compiled ahead (tpurl.train.packed_shapes): the ladder holds every packed row count
a batch format takes, and the update and logprobs programs compiled for a count from their last
call's abstract arguments, on another thread, are what a later call with that count runs: it
compiles nothing (on 8 fake devices and on one, 2 micro-batches), where without them it compiles."""

import threading

import numpy as np
import pytest
from flax import nnx

from tpurl.models import init_model, preset
from tpurl.rl.timeline import COMPILE_CLOCK
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.packing import PackingConfig, pack_batch, row_ladder
from tpurl.train.state import init_train_state
from tpurl.train.step import make_train_step

V, B, T, PROMPT = 64, 16, 16, 4
LAYOUT = Layout(name="train", rules=(("batch", ("data", "fsdp")), ("embed", ("fsdp",)), ("heads", ("tensor",)),
                                     ("kv_heads", ("tensor",)), ("mlp", ("tensor",)), ("vocab", ("tensor",))))
PACK = PackingConfig(row_buckets=2, min_row_length=0)  # rows T long, 2 sizes


def _batch(lengths) -> dict:
    """Rows with a prompt and completions of `lengths` (groups of 4 share the prompt)."""
    rng = np.random.default_rng(len(lengths) + int(sum(lengths)))
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[:, :PROMPT] = np.repeat(tokens[::4, :PROMPT], 4, axis=0)
    valid = np.arange(T)[None, :] < PROMPT + np.asarray(lengths)[:, None]
    return {"tokens": tokens, "valid": valid, "loss_mask": (valid & (np.arange(T) >= PROMPT)).astype(np.float32),
            "advantages": rng.normal(size=B).astype(np.float32)}


@pytest.mark.parametrize("packing", [PACK, PackingConfig(row_buckets=8)])
def test_the_ladder_holds_every_packed_row_count(packing):
    rng = np.random.default_rng(0)
    shards, micro = 2, 2
    seen = set()
    for n in range(40):
        top = 1 + n % (T - PROMPT)  # from all-short to all-long batches
        p = pack_batch(*(lambda b: (b["tokens"], b["valid"]))(_batch(rng.integers(0, top + 1, B))), packing,
                       shards=shards, micro_batches=micro)
        rows, length = p["packed_tokens"].shape
        ladder = row_ladder(B, T, length, shards * micro, packing.row_buckets)
        assert rows in ladder and len(ladder) <= packing.row_buckets, (rows, ladder)
        seen.add(rows)
    assert seen == set(ladder)  # and every count of it occurs


def _programs(sharded: bool):
    """The update and a logprobs pass with 2 micro-batches, on 8 devices or one (its state
    donated, its batch placed uncommitted)."""
    model = init_model(preset("tiny", vocab_size=V), seed=0)
    graphdef, params = nnx.split(model)
    where = dict(mesh=make_mesh(MeshConfig(shape=(2, 2, 2))), layout=LAYOUT) if sharded else {}
    algo = algorithm_preset("grpo", kl_coef=0.0, micro_batches=2)
    step = make_train_step(graphdef, algo, OptimizerConfig(lr=1e-3), packing=PACK, **where)
    score = make_logprob_fn(graphdef, packing=PACK, micro_batches=2, **where)
    return step, score, init_train_state(model, OptimizerConfig(lr=1e-3), **where)


def _learn(step, score, state, batch):
    """A learn phase's calls on `batch`: its old logprobs, then the update on them; returns the
    new state, the update's loss and the packed row count."""
    placed = step.prepare(batch)
    old = score.on_batch(state.params, placed)[0]
    state, metrics = step(state, {**placed, "old_logprobs": old})
    return state, float(metrics["loss"]), placed["packed_tokens"].shape[0]


@pytest.mark.parametrize("sharded, blocks", [(True, 8), (False, 2)])
def test_programs_compiled_ahead_are_the_ones_a_new_shape_runs(sharded, blocks):
    short, long = _batch([1] * B), _batch([T - PROMPT] * B)
    step, score, state = _programs(sharded)
    step.shapes.watch()
    score.on_batch.shapes.watch()
    state, _, first = _learn(step, score, state, short)
    jobs = [job for p in (step.shapes, score.on_batch.shapes) for job in p.take()]
    assert row_ladder(B, T, T, blocks, PACK.row_buckets) == (8, 16) and len(jobs) == 2
    assert step.shapes.take() == [] and score.on_batch.shapes.take() == []  # each count handed out once
    worker = threading.Thread(target=lambda: [compile_() for _, _, compile_ in jobs])
    worker.start()
    worker.join()
    before = COMPILE_CLOCK.process_totals()["programs"]
    state, loss, rows = _learn(step, score, state, long)
    assert rows != first and COMPILE_CLOCK.process_totals()["programs"] == before

    # Without them the same calls compile both programs, and compute the same update.
    step, score, state = _programs(sharded)
    state, _, _ = _learn(step, score, state, short)
    before = COMPILE_CLOCK.process_totals()["programs"]
    state, want, _ = _learn(step, score, state, long)
    assert COMPILE_CLOCK.process_totals()["programs"] >= before + 2
    assert loss == want
