"""The rollout engine in bitwise mode (ModelConfig.consistency="bitwise"): every sampled token's
logprob equals the trainer's scoring of that token bit for bit, in float32 and bfloat16, whatever
the engine's batch (slot counts, other requests), page layout (page sizes, a dense cache) and the
trainer's batch (the sequences together in padded rows, or each alone with other padding); in
fast mode they differ (the check can fail). What bitwise mode cannot cover is one line."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.models import init_model, preset
from tpurl.train.logprobs import token_logprobs

ENGINES = {
    "paged": dict(max_slots=4, max_seq_len=40, page_size=4, prefill_buckets=(8, 16)),
    "pages8_slots16": dict(max_slots=16, max_seq_len=40, page_size=8, prefill_buckets=(16,), decode_buckets=1),
    "dense": dict(cache="dense", max_slots=8, max_seq_len=40, prefill_buckets=(16,)),
}
PROMPTS = [np.random.default_rng(n).integers(3, 128, n).tolist() for n in (3, 7, 12, 5, 9)]


def _model(consistency: str, dtype: str):
    cfg = preset("tiny", consistency=consistency, dtype=dtype, max_position_embeddings=64)
    return cfg, init_model(cfg, 0)


def _sampled(cfg, model, engine: str, prompts):
    graphdef, params = nnx.split(model)
    engine = Engine(cfg, EngineConfig(**ENGINES[engine]), graphdef=graphdef)
    out = generate(engine, params, prompts, n_samples=3, seed=0,
                   sampling=SamplingConfig(temperature=0.9, max_new_tokens=12))
    return [(p, c.token_ids.tolist(), np.asarray(c.logprobs)) for p, row in zip(prompts, out) for c in row]


def _scored(model, seqs, width: int, left: bool = False) -> list[np.ndarray]:
    """The trainer's logprobs of `seqs` (prompt + completion) in one batch of `width`-wide rows."""
    toks, valid = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        toks[i, cols], valid[i, cols] = s, True
    lp = np.asarray(token_logprobs(model, jnp.asarray(toks), jnp.asarray(valid), temperature=0.9)[0])
    return [lp[i, width - len(s):] if left else lp[i, :len(s)] for i, s in enumerate(seqs)]


def _worst(samples, scored) -> float:
    return max(float(np.max(np.abs(lp[len(p):] - got))) for (p, _, got), lp in zip(samples, scored))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,engines", [("float32", tuple(ENGINES)), ("bfloat16", ("paged",))])
def test_engine_logprobs_are_the_trainers_bit_for_bit(dtype, engines):
    cfg, model = _model("bitwise", dtype)
    runs = {name: _sampled(cfg, model, name, PROMPTS) for name in engines}
    for name, samples in runs.items():
        seqs = [p + c for p, c, _ in samples]
        assert _worst(samples, _scored(model, seqs, 32)) == 0.0, name
    # One sequence alone, left-padded into a wider row, and one prompt sampled beside no others.
    samples = runs["paged"]
    seqs = [p + c for p, c, _ in samples]
    assert _worst(samples[:2], [_scored(model, [s], 40, left=True)[0] for s in seqs[:2]]) == 0.0
    alone = _sampled(cfg, model, "paged", PROMPTS[:1])
    assert [c for _, c, _ in alone] == [c for _, c, _ in samples[:3]]  # the same draws
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(alone, samples[:3]))


@pytest.mark.slow
def test_fast_mode_does_not_match():
    cfg, model = _model("fast", "bfloat16")
    samples = _sampled(cfg, model, "paged", PROMPTS)
    assert _worst(samples, _scored(model, [p + c for p, c, _ in samples], 32)) > 0


def test_what_bitwise_mode_cannot_cover_is_one_line(devices):
    from jax.sharding import Mesh

    cfg, model = _model("bitwise", "float32")
    graphdef = nnx.graphdef(model)
    with pytest.raises(ValueError, match="cache must hold keys in the compute dtype"):
        Engine(cfg, EngineConfig(**ENGINES["paged"], cache_dtype="bfloat16"), graphdef=graphdef)
    with pytest.raises(ValueError, match="one device per pool"):
        Engine(cfg, EngineConfig(**ENGINES["paged"]), mesh=Mesh(np.asarray(devices[:2]), ("data",)),
               graphdef=graphdef)
    with pytest.raises(ValueError, match="consistency='bitwise' with moe"):
        preset("tiny-moe", consistency="bitwise")
