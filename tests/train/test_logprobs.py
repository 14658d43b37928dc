"""Chunked logprobs/entropy: values vs a float64 log-softmax of the full logits, gradients vs the
naive computation, and temp memory that does not grow with vocab x time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.models import forward_logits, init_model, preset
from tpurl.train.logprobs import logprobs_from_hidden, token_logprobs

V = 50  # not a multiple of the vocab chunk: exercises the padded last chunk


@pytest.fixture(scope="module")
def setup():
    model = init_model(preset("tiny", vocab_size=V), seed=1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (3, 11)).astype(np.int32)
    valid = np.ones((3, 11), bool)
    valid[1, :3] = False  # left padding
    valid[2, 8:] = False  # right padding
    return model, tokens, valid


def np_reference(logits_BTV, tokens, valid, temperature):
    """float64 log_softmax of the full logits, shifted to the scored token."""
    z = np.asarray(logits_BTV, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp, ent = np.zeros(tokens.shape), np.zeros(tokens.shape)
    for b, t in np.ndindex(tokens.shape):
        if t > 0 and valid[b, t] and valid[b, t - 1]:
            lp[b, t] = logp[b, t - 1, tokens[b, t]]
            ent[b, t] = -(np.exp(logp[b, t - 1]) * logp[b, t - 1]).sum()
    return lp, ent


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size,vocab_chunk", [(4, None), (3, 16)])
def test_token_logprobs_match_float64_log_softmax(setup, chunk_size, vocab_chunk):
    model, tokens, valid = setup
    temperature = 0.7
    lp, ent = jax.jit(lambda tok, val: token_logprobs(model, tok, val, temperature=temperature, chunk_size=chunk_size,
                                                      vocab_chunk_size=vocab_chunk))(tokens, valid)
    logits = forward_logits(model, jnp.asarray(tokens), jnp.asarray(valid))
    want_lp, want_ent = np_reference(logits, tokens, valid, temperature)
    np.testing.assert_allclose(np.asarray(lp), want_lp, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(lp)[:, 0] == 0) and np.all(np.asarray(lp)[1, :4] == 0)


def _naive(h, w, tok, valid, temperature=1.0):
    logp = jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", h, w) / temperature, axis=-1)[:, :-1]
    lp = jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    keep = valid[:, 1:] & valid[:, :-1]
    return jnp.where(keep, lp, 0.0), jnp.where(keep, ent, 0.0)


def test_chunked_gradients_match_naive():
    rng = np.random.default_rng(1)
    b, t, d, v = 2, 13, 8, 37
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    tok = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    valid = jnp.asarray(np.arange(t)[None, :] < np.array([[t], [9]]))
    coef = jnp.asarray(rng.normal(size=(b, t - 1)), jnp.float32)

    def chunked(h, w):
        lp, ent = logprobs_from_hidden(h, w, tok, valid, temperature=1.3, chunk_size=5, vocab_chunk_size=8)
        return jnp.sum(coef * lp[:, 1:]) + jnp.sum(coef * ent[:, 1:])

    def naive(h, w):
        lp, ent = _naive(h, w, tok, valid, 1.3)
        return jnp.sum(coef * lp) + jnp.sum(coef * ent)

    got, want = jax.jit(jax.grad(chunked, (0, 1)))(h, w), jax.jit(jax.grad(naive, (0, 1)))(h, w)
    for g, n in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(n), rtol=1e-4, atol=1e-5)


def _temp_bytes(fn, b, t, d, v):
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.bool_))
    return jax.jit(jax.grad(fn, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temp_memory_does_not_grow_with_vocab_times_time():
    """Forward + backward temp memory at (T, V) and (2T, 2V): the naive version holds [B, T, V]
    fp32 logits (4x), the chunked one only one [B, chunk, vocab_chunk] block at a time."""

    def naive(h, w, tok, valid):
        lp, ent = _naive(h, w, tok, valid)
        return lp.sum() + ent.sum()

    def chunked(h, w, tok, valid):
        lp, ent = logprobs_from_hidden(h, w, tok, valid, chunk_size=16, vocab_chunk_size=256)
        return lp.sum() + ent.sum()

    b, d = 2, 32
    small, big = (64, 1024), (128, 2048)
    naive_s, naive_b = (_temp_bytes(naive, b, t, d, v) for t, v in (small, big))
    chunk_s, chunk_b = (_temp_bytes(chunked, b, t, d, v) for t, v in (small, big))
    logits_big = b * big[0] * big[1] * 4
    assert naive_b >= logits_big and naive_b / naive_s > 3.5, (naive_s, naive_b)
    # What remains grows linearly (hidden states, a padded copy of w), not with T x V.
    assert chunk_b / chunk_s < 2.2, (chunk_s, chunk_b)
    assert chunk_b < logits_big / 2, (chunk_b, logits_big)


def test_bad_chunk_sizes():
    h = jnp.zeros((1, 4, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_hidden(h, jnp.zeros((2, 3)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), chunk_size=0)


def test_qwen_scale_vocab_and_long_completion_fit():
    """Compile-only at Qwen's 151936 vocabulary and 8k tokens (bf16): the naive backward needs more
    temp memory than the fp32 logits (5 GB); the chunked one stays within a few copies of the
    fp32 unembedding (its gradient accumulator), independent of T x V."""

    def naive(h, w, tok, valid):
        return _naive(h, w, tok, valid)[0].sum()

    def chunked(h, w, tok, valid):
        lp, ent = logprobs_from_hidden(h, w, tok, valid, chunk_size=256, vocab_chunk_size=16384)
        return lp.sum() + ent.sum()

    b, t, d, v = 1, 8192, 1024, 151936
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.bool_))
    temp = {f.__name__: jax.jit(jax.grad(f, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes
            for f in (naive, chunked)}
    assert temp["naive"] > b * t * v * 4, temp
    assert temp["chunked"] < 4 * d * v * 4, temp
