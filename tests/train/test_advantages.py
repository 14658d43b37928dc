"""Advantage estimators against float64 numpy loops (ragged groups, degenerate groups)."""

import numpy as np
import pytest

from tpurl.train.advantages import (compute_advantages, gae, keep_groups, kl_penalized_rewards,
                                    token_rewards, whiten)

EPS = 1e-6


def np_group_advantages(r, valid, estimator, baseline=True):
    """Loops over groups in float64; returns ([P, G] advantages, number of degenerate groups)."""
    r = np.asarray(r, np.float64)
    p_, g_ = r.shape
    adv = np.zeros((p_, g_))
    degenerate = np.zeros(p_, bool)
    for p in range(p_):
        idx = [g for g in range(g_) if valid[p, g]]
        x = r[p, idx]
        degenerate[p] = len(x) < 2 or x.max() == x.min()
        if degenerate[p]:
            continue
        n = len(x)
        for j, g in enumerate(idx):
            if estimator == "grpo":
                adv[p, g] = (x[j] - x.mean()) / (x.std(ddof=1) + EPS)
            elif estimator == "dr_grpo":
                adv[p, g] = x[j] - x.mean()
            elif estimator == "rloo":
                adv[p, g] = x[j] - (x.sum() - x[j]) / (n - 1)
    if estimator == "reinforce_pp":
        flat = [(p, g) for p in range(p_) for g in range(g_) if valid[p, g]]
        if baseline:
            cen = {}
            for p, g in flat:
                x = r[p, [h for h in range(g_) if valid[p, h]]]
                cen[p, g] = r[p, g] - x.mean()
        else:
            mean = np.mean([r[p, g] for p, g in flat])
            cen = {(p, g): r[p, g] - mean for p, g in flat}
        std = np.std(list(cen.values()), ddof=1)
        for p, g in flat:
            adv[p, g] = 0.0 if (baseline and degenerate[p]) else cen[p, g] / (std + EPS)
    return adv, int(degenerate.sum())


@pytest.fixture(scope="module")
def rewards():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(6, 5))
    r[1] = 1.0  # degenerate: all equal
    r[3] = rng.integers(0, 2, 5).astype(float)  # binary rewards, like a verifier
    r[3, 0] = 1 - r[3, 1]  # ... not all equal
    valid = np.ones((6, 5), bool)
    valid[2, 3:] = False  # ragged group (failed rollouts)
    valid[4, 1:] = False  # a single member: degenerate
    r[5, :] = 0.5
    r[5, 2] = 7.0  # one outlier
    valid[5, 2] = False  # ... that is invalid, so the group is degenerate
    return r, valid


@pytest.mark.parametrize("estimator,baseline", [("grpo", True), ("dr_grpo", True), ("rloo", True),
                                                ("reinforce_pp", True), ("reinforce_pp", False)])
def test_group_estimators_match_numpy(rewards, estimator, baseline):
    r, valid = rewards
    got, stats = compute_advantages(r.astype(np.float32), estimator, valid_PG=valid, eps=EPS,
                                    reinforce_pp_baseline=baseline)
    want, n_deg = np_group_advantages(r, valid, estimator, baseline)
    np.testing.assert_allclose(np.asarray(got).reshape(r.shape), want, rtol=2e-5, atol=2e-6)
    assert int(stats["degenerate_groups"]) == n_deg == 3
    assert np.asarray(got).shape == (r.size,)
    np.testing.assert_allclose(float(stats["reward_mean"]), r[valid].mean(), rtol=1e-5)
    if baseline:  # degenerate groups and invalid members carry no signal
        adv = np.asarray(got).reshape(r.shape)
        assert np.all(adv[[1, 4, 5]] == 0) and np.all(adv[~valid] == 0)


def test_dynamic_sampling_keeps_informative_groups(rewards):
    r, valid = rewards
    np.testing.assert_array_equal(np.asarray(keep_groups(r, valid)), [True, False, True, True, False, False])


def test_unknown_estimator_and_bad_shape():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        compute_advantages(np.zeros((2, 2)), "ppo2")
    with pytest.raises(ValueError, match=r"\[num_prompts, group_size\]"):
        compute_advantages(np.zeros(4), "grpo")


def test_reinforce_pp_single_sample_groups():
    """G = 1: the group baseline would zero every advantage, so it is refused; without it the
    batch mean is the baseline and the advantages carry signal."""
    r = np.array([[1.0], [0.0], [0.5], [0.0]], np.float32)
    with pytest.raises(ValueError, match="reinforce_pp_baseline=True needs group_size >= 2"):
        compute_advantages(r, "reinforce_pp")
    got, _ = compute_advantages(r, "reinforce_pp", reinforce_pp_baseline=False, eps=EPS)
    x = r[:, 0].astype(np.float64) - r.mean()
    np.testing.assert_allclose(np.asarray(got), x / (np.sqrt((x ** 2).sum() / (x.size - 1)) + EPS), rtol=1e-5)


def np_gae(r, v, m, gamma, lam):
    adv = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b])
        nxt_v, nxt_a = 0.0, 0.0
        for t in idx[::-1]:
            delta = r[b, t] + gamma * nxt_v - v[b, t]
            adv[b, t] = delta + gamma * lam * nxt_a
            nxt_v, nxt_a = v[b, t], adv[b, t]
    return adv, np.where(m, adv + v, 0.0)


def test_gae_matches_numpy_with_ragged_masks():
    rng = np.random.default_rng(1)
    b, t = 4, 9
    m = np.zeros((b, t), bool)
    m[0, 3:] = True
    m[1, 2:6] = True  # right padding after the completion
    m[2, [4, 5, 7]] = True  # a hole (e.g. an environment turn between completion pieces)
    r = rng.normal(size=(b, t)) * m
    v = rng.normal(size=(b, t))
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        adv, ret = gae(r.astype(np.float32), v.astype(np.float32), m, gamma=gamma, lam=lam)
        want_a, want_r = np_gae(r, v, m, gamma, lam)
        np.testing.assert_allclose(np.asarray(adv), want_a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ret), want_r, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[3] == 0)  # no completion tokens


def test_token_rewards_whiten_and_kl_in_reward():
    rng = np.random.default_rng(2)
    m = np.zeros((3, 7), bool)
    m[0, 2:5] = True
    m[1, 4:] = True
    seq_r = np.array([1.0, -2.0, 3.0])
    kl = rng.normal(size=(3, 7))
    got = np.asarray(token_rewards(seq_r, m, kl, kl_coef=0.1))
    want = -0.1 * kl * m
    want[0, 4] += 1.0
    want[1, 6] += -2.0  # row 2 has no completion token: no reward lands anywhere
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    x = rng.normal(size=(3, 7))
    w = np.asarray(whiten(x.astype(np.float32), m))
    sel = x[m]
    np.testing.assert_allclose(w[m], (sel - sel.mean()) / np.sqrt(sel.var() + 1e-8), rtol=1e-4, atol=1e-5)
    assert np.all(w[~m] == 0)

    lp, ref = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    got = np.asarray(kl_penalized_rewards(seq_r, lp, ref, m, kl_coef=0.5, estimator="k1"))
    np.testing.assert_allclose(got, seq_r - 0.5 * ((lp - ref) * m).sum(1), rtol=1e-5)
