"""A float8 KV cache (EngineConfig.cache_dtype="float8_e4m3fn"): keys and values beyond e4m3's range
saturate instead of turning into NaN, and the engine's logprobs on it stay close to the dense
forward (e4m3's rounding, nothing else)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.generate.kv_cache import to_cache
from helpers import dense_logprobs
from tpurl.models import init_model, preset


def test_a_float8_cache_saturates_where_a_plain_cast_makes_nan():
    x = jnp.asarray([1000.0, -600.0, 440.0, 3.0], jnp.float32)
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)).sum() == 2  # what the clip prevents
    np.testing.assert_array_equal(np.asarray(to_cache(x, jnp.float8_e4m3fn), np.float32), [448, -448, 448, 3])
    assert to_cache(x, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.slow
def test_logprobs_on_a_float8_cache_are_close_to_the_dense_forward():
    cfg = preset("tiny")
    model = init_model(cfg, 0)
    graphdef, params = nnx.split(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    errors = {}
    for dtype in (None, "float8_e4m3fn"):
        engine = Engine(cfg, EngineConfig(max_slots=4, max_seq_len=32, page_size=4, prefill_buckets=(8,),
                                          cache_dtype=dtype), graphdef=graphdef)
        assert engine.init_decode_state()["cache"]["k"].dtype == jnp.dtype(dtype or cfg.dtype)
        out = generate(engine, params, prompts, n_samples=2, seed=0,
                       sampling=SamplingConfig(temperature=1.0, max_new_tokens=10))
        worst = 0.0
        for prompt, completions in zip(prompts, out):
            for c in completions:
                worst = max(worst, float(np.max(np.abs(c.logprobs - dense_logprobs(model, prompt, c.token_ids)))))
        errors[dtype] = worst
    assert errors[None] < 1e-5
    assert 1e-5 < errors["float8_e4m3fn"] < 0.05


def test_keys_beyond_e4m3s_range_saturate_in_every_cache_write():
    """Keys and values far beyond 448 (k and v projections scaled up) go through prefill, insert and
    decode writes into a float8 cache: every logprob stays finite."""
    cfg = preset("tiny")
    model = init_model(cfg, 0)
    for name in ("k_proj", "v_proj"):
        getattr(model.layers, name).set_value(getattr(model.layers, name)[...] * 3000.0)
    graphdef, params = nnx.split(model)
    engine = Engine(cfg, EngineConfig(max_slots=4, max_seq_len=32, page_size=4, prefill_buckets=(8,),
                                      cache_dtype="float8_e4m3fn"), graphdef=graphdef)
    k = jax.jit(lambda x: x @ model.layers.k_proj[...][0].reshape(cfg.hidden_size, -1))(
        jnp.ones((1, cfg.hidden_size)))
    assert float(jnp.max(jnp.abs(k))) > 448  # the test reaches the saturation
    out = generate(engine, params, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], n_samples=2, seed=0,
                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=10))
    assert all(np.all(np.isfinite(c.logprobs)) for row in out for c in row)
