"""Sampling against numpy: which tokens top-k/top-p allow, their frequencies, greedy, logprobs, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.generate.sampling import SamplingConfig, request_seed, sample_tokens

V = 12
LOGITS = np.random.default_rng(0).normal(0, 2, V).astype(np.float32)


def _np_allowed(logits, t, top_k, top_p):
    """Float64 reference: tokens top-k and top-p keep, and the tempered logprobs."""
    z = logits.astype(np.float64) / t
    logp = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
    order = np.argsort(-logp, kind="stable")
    keep = np.ones(V, bool)
    if top_k:
        keep[order[top_k:]] = False
    before = np.cumsum(np.exp(logp[order])) - np.exp(logp[order])
    keep[order[before >= top_p]] = False
    return keep, logp


_sample = jax.jit(lambda *a, **k: sample_tokens(*a, **k)[:2])


@pytest.mark.parametrize("t,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.8)])
def test_draws_follow_truncated_tempered_distribution(t, top_k, top_p):
    n = 4000
    logits = np.broadcast_to(LOGITS, (n, V))
    seeds = np.arange(n, dtype=np.uint32)
    tokens, logprobs = jax.device_get(_sample(logits, seeds, np.zeros(n, np.int32), np.full(n, t, np.float32),
                                              np.full(n, top_k, np.int32), np.full(n, top_p, np.float32)))
    keep, logp = _np_allowed(LOGITS, t, top_k, top_p)
    assert set(tokens.tolist()) == set(np.nonzero(keep)[0].tolist())
    expected = np.where(keep, np.exp(logp), 0) / np.exp(logp)[keep].sum()
    freq = np.bincount(tokens, minlength=V) / n
    tol = 4 * np.sqrt(expected * (1 - expected) / n) + 1e-3
    assert np.all(np.abs(freq - expected) <= tol), (freq, expected)
    # The reported logprob is the untruncated tempered one.
    np.testing.assert_allclose(logprobs, logp[tokens], atol=1e-6)


def test_excluded_tokens_are_never_drawn_at_a_real_vocabulary_size():
    """At V ~ 150k a float32 prefix sum rounds down between neighbours, which would give excluded
    (-inf) tokens CDF intervals of positive width; every threshold placed inside such a rounding
    step, and every other threshold of a sweep, must still land on an allowed token."""
    from tpurl.generate.sampling import _inverse_cdf_draw

    v = 151_936
    rng = np.random.default_rng(0)
    logp = rng.normal(0, 1, v).astype(np.float32)
    logp[rng.random(v) < 0.5] = -np.inf  # half the vocabulary excluded, as a top-p cut could
    cdf = np.asarray(jax.lax.cumsum(jnp.exp(jnp.asarray(logp))))
    total = cdf[-1]
    # Thresholds right at the steps where an excluded token's raw prefix sum moves.
    moving = np.nonzero((np.diff(cdf) != 0) & np.isneginf(logp[1:]))[0] + 1
    u = np.concatenate([cdf[moving[:64]] / total, np.linspace(0, 1, 512, endpoint=False), [1 - 1e-7]])
    rows = jnp.broadcast_to(jnp.asarray(logp), (len(u), v))
    drawn = np.asarray(jax.jit(_inverse_cdf_draw)(rows, jnp.asarray(u, jnp.float32)))
    assert np.isfinite(logp[drawn]).all(), drawn[~np.isfinite(logp[drawn])]


def test_draw_is_first_allowed_token_where_running_max_of_prefix_sums_passes_threshold():
    """The draw equals its definition, written out with the running maximum, on the prefix sums
    the draw itself computes, at a vocabulary size where they round down between neighbours:
    thresholds placed at those dips and at random. (On this data every dip falls on an excluded
    token, so it checks the draw's indexing and exclusions; it does not tell the running maximum
    from the raw prefix sum, which pick the same token here.)"""
    from tpurl.generate.sampling import _inverse_cdf_draw

    v = 151_936
    rng = np.random.default_rng(3)
    logp = rng.normal(0, 1, v).astype(np.float32)
    logp[rng.random(v) < 0.5] = -np.inf
    p = np.exp(logp)
    cdf = np.asarray(jnp.cumsum(jnp.exp(jnp.asarray(logp))))
    running = np.maximum.accumulate(cdf)
    dips = np.nonzero(np.diff(cdf) < 0)[0] + 1  # where the raw prefix sum rounds down
    assert dips.size
    u = np.concatenate([cdf[dips[:32]] / running[-1], rng.random(32), [0.0, 1 - 2**-24]]).astype(np.float32)
    drawn = np.asarray(jax.jit(_inverse_cdf_draw)(jnp.broadcast_to(jnp.asarray(logp), (len(u), v)), jnp.asarray(u)))
    for ui, token in zip(u, drawn):
        hit = np.nonzero((running > ui * running[-1]) & (p > 0))[0]
        assert token == (hit[0] if hit.size else np.argmax(logp)), (ui, token)


def test_greedy_reproducible_and_seed_dependent():
    b = 64
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (b, V)).astype(np.float32)
    ones = np.ones(b, np.float32)
    args = lambda seeds, steps, t: (logits, seeds, steps, t, np.zeros(b, np.int32), ones)  # noqa: E731
    greedy, lp = jax.device_get(_sample(*args(np.arange(b, dtype=np.uint32), np.zeros(b, np.int32), 0 * ones)))
    np.testing.assert_array_equal(greedy, logits.argmax(-1))
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(b), greedy], atol=1e-6)
    seeds = np.full(b, 7, np.uint32)
    a1, _ = jax.device_get(_sample(*args(seeds, np.zeros(b, np.int32), ones)))
    a2, _ = jax.device_get(_sample(*args(seeds, np.zeros(b, np.int32), ones)))
    a3, _ = jax.device_get(_sample(*args(seeds, np.ones(b, np.int32), ones)))
    np.testing.assert_array_equal(a1, a2)
    assert (a1 != a3).any()  # the step index changes the key


def test_request_seeds_distinct_and_config_validation():
    seeds = {request_seed(0, i, j) for i in range(20) for j in range(8)}
    assert len(seeds) == 160 and request_seed(0, 3, 1) == request_seed(0, 3, 1) != request_seed(1, 3, 1)
    for bad, match in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
                       (dict(stop_strings=("",)), "stop_strings")]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**bad)


def test_a_row_without_top_p_keeps_every_token_beside_one_that_truncates():
    """A program that truncates (another row's top_k) keeps every token of a row with top_p = 1,
    even where the float32 running mass reaches 1 before the vocabulary's last tokens (here after
    the first): that row draws from what a program without truncation draws from."""
    from tpurl.generate.sampling import _truncation_threshold

    logits = np.full((2, 1000), -30.0, np.float32)
    logits[:, 0] = 0.0  # p(token 0) rounds to 1 in float32; the others ~1e-13 each
    lp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    thresh = np.asarray(_truncation_threshold(lp, jnp.asarray([0, 2]), jnp.asarray([1.0, 1.0])))
    assert thresh[0] == np.asarray(lp)[0].min()  # row 0: every token
    assert thresh[1] == np.sort(np.asarray(lp)[1])[-2]  # row 1: its top 2
