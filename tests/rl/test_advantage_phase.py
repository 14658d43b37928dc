"""KL in the reward (rloo / reinforce_pp) and Dr. GRPO's loss normalizer, wired into the RL loop:
advantages checked against float64 numpy recomputations of the step's own batch."""

import numpy as np
import pytest

from algo_helpers import BatchSpy, episode_gae, fresh_state, tiny_rl_config
from tpurl.rl.advantage_phase import make_advantage_fn
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import resolve_loss_norm
from tpurl.rl.step import rl_step
from tpurl.train.config import algorithm_preset


def _kl_penalty(old, ref, mask, coef):
    """k1 KL of each sequence's completion tokens, times the coefficient (float64)."""
    return coef * ((old.astype(np.float64) - ref.astype(np.float64)) * mask).sum(axis=1)


def _rloo(r_PG):
    g = r_PG.shape[1]
    adv = (r_PG - r_PG.mean(axis=1, keepdims=True)) * g / (g - 1)
    flat = r_PG.max(axis=1) == r_PG.min(axis=1)
    return np.where(flat[:, None], 0.0, adv).reshape(-1)


def _reinforce_pp(r_PG, eps=1e-6):
    x = r_PG - r_PG.mean(axis=1, keepdims=True)
    adv = x / (np.sqrt((x ** 2).sum() / (x.size - 1)) + eps)
    flat = r_PG.max(axis=1) == r_PG.min(axis=1)
    return np.where(flat[:, None], 0.0, adv).reshape(-1)


@pytest.mark.slow
def test_rloo_step_subtracts_kl_from_reward(tmp_path):
    coef = 0.05
    cfg = tiny_rl_config(tmp_path, algorithm_preset("rloo", group_size=4, kl_coef=coef))
    rt = RLRuntime(*prepare(cfg))
    spy = BatchSpy(rt)
    # A reference policy from another initialization: the KL is far from zero at step 0.
    _, metrics, records, _ = rl_step(rt, fresh_state(rt, ref_seed=1))
    (batch,) = spy.batches
    rewards = np.asarray([r["reward"] for r in records], np.float64).reshape(-1, 4)
    penalty = _kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], batch["loss_mask"], coef)
    without_kl = _rloo(rewards)
    want_shift = _rloo(rewards - penalty.reshape(rewards.shape)) - without_kl
    np.testing.assert_allclose(batch["advantages"] - without_kl, want_shift, atol=2e-5)
    assert np.abs(want_shift).max() > 1e-3  # the penalty really moved the advantages
    assert metrics["advantages/kl_penalty_mean"] == pytest.approx(penalty.mean(), rel=1e-4, abs=1e-6)
    assert metrics["advantages/shaped_reward_mean"] == pytest.approx((rewards.reshape(-1) - penalty).mean(),
                                                                      abs=1e-5)
    assert "train/kl_loss" not in metrics and np.isfinite(metrics["train/kl"])  # reported, not in the loss
    np.testing.assert_allclose([r["advantage"] for r in records], batch["advantages"], rtol=1e-6)


def test_reinforce_pp_kl_in_reward_matches_numpy():
    rng = np.random.default_rng(0)
    algo = algorithm_preset("reinforce_pp", group_size=4, kl_coef=0.1, kl_estimator="k1")
    p, g, t = 3, 4, 6
    rewards = rng.integers(0, 2, (p, g)).astype(np.float32)
    rewards[0] = 1.0  # a flat group: only the KL penalty tells its members apart
    mask = (rng.random((p * g, t)) < 0.7).astype(np.float32)
    old, ref = (rng.normal(-1.0, 0.5, (p * g, t)).astype(np.float32) for _ in range(2))
    batch, per_seq, stats = make_advantage_fn(algo)(rewards, mask, old, ref, None)
    shaped = rewards.astype(np.float64) - _kl_penalty(old, ref, mask, 0.1).reshape(p, g)
    np.testing.assert_allclose(np.asarray(batch["advantages"]), _reinforce_pp(shaped), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(per_seq), np.asarray(batch["advantages"]))
    assert float(stats["kl_penalty_mean"]) == pytest.approx(_kl_penalty(old, ref, mask, 0.1).mean(), rel=1e-5)
    # Without the reference logprobs the penalty cannot be computed: a clear error, not a silent skip.
    with pytest.raises(ValueError, match="reference logprobs"):
        make_advantage_fn(algo)(rewards, mask, old, None, None)


def test_dr_grpo_normalizer_follows_the_rollout_length(tmp_path):
    cfg = tiny_rl_config(tmp_path, "dr_grpo", batch_size=16)
    spec, task = prepare(cfg)
    assert cfg.algorithm.loss_norm_len is None  # the config says "derive"; the spec holds the value
    assert task.max_new_tokens != 512 and spec.algorithm.loss_norm_len == task.max_new_tokens
    # A normalizer the user chose is kept, even one equal to the old preset's 512 or to the
    # rollout length itself; other aggregations are left alone.
    for mine in (64, 512, task.max_new_tokens):
        chosen = tiny_rl_config(tmp_path, algorithm_preset("dr_grpo", loss_norm_len=mine), batch_size=16)
        assert prepare(chosen)[0].algorithm.loss_norm_len == mine
    assert prepare(tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4)))[0].algorithm.loss_norm_len is None
    assert resolve_loss_norm(algorithm_preset("dr_grpo"), 20).loss_norm_len == 20


def _grpo(r_PG, eps=1e-6):
    x = r_PG - r_PG.mean(axis=1, keepdims=True)
    return (x / (r_PG.std(axis=1, ddof=1, keepdims=True) + eps)).reshape(-1)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_episodes_of_several_rows_train_each_row_with_the_episode_advantage(name):
    """An agent episode of S rows (`AgentConfig.trained_sequences`): the group estimator runs over
    the `[P, G]` episode rewards, each episode's KL in the reward is that of all its rows, and every
    row of an episode gets the episode's advantage, rows without a sequence included."""
    rng = np.random.default_rng(1)
    p, g, s, t = 2, 4, 3, 5
    algo = algorithm_preset(name, group_size=g, kl_coef=0.1, kl_estimator="k1")
    rewards = rng.integers(0, 3, (p, g)).astype(np.float32)
    mask = (rng.random((p * g * s, t)) < 0.7).astype(np.float32)
    mask[1::s] = 0.0  # every episode's second row holds no sequence
    old, ref = (rng.normal(-1.0, 0.5, (p * g * s, t)).astype(np.float32) for _ in range(2))
    batch, per_seq, stats = make_advantage_fn(algo)(rewards, mask, old, ref, None)
    r = rewards.astype(np.float64)
    if algo.kl_penalty_in_reward:
        penalty = _kl_penalty(old, ref, mask, 0.1).reshape(p, g, s).sum(axis=2)
        r = r - penalty
        assert float(stats["kl_penalty_mean"]) == pytest.approx(penalty.mean(), rel=1e-5)
    want = np.repeat(_rloo(r) if name == "rloo" else _grpo(r), s)
    np.testing.assert_allclose(np.asarray(batch["advantages"]), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(per_seq), np.asarray(batch["advantages"]))


def test_a_ppo_episode_of_several_rows_is_one_trajectory():
    """GAE over agent episodes of S rows (latest first, `AgentConfig.trained_sequences`): an
    episode's rows in the order they were sampled are one trajectory, the reward once after the
    latest row's last token, an earlier row's last token bootstrapping from the next row's first;
    KL in the reward on every token (float64 numpy over each episode's tokens in order)."""
    rng = np.random.default_rng(2)
    e, s, t, coef = 4, 3, 5, 0.1
    algo = algorithm_preset("ppo", kl_coef=coef, kl_estimator="k1", gamma=0.9, gae_lambda=0.8)
    rewards = rng.normal(size=(e, 1)).astype(np.float32)
    mask = rng.random((e * s, t)) < 0.7
    mask[::s, 0] = True  # every episode's latest row holds a sequence ...
    mask[1] = False      # ... and the first episode's middle row none
    old, ref, values = (rng.normal(-1.0, 0.5, (e * s, t)).astype(np.float32) for _ in range(3))
    batch, _, stats = make_advantage_fn(algo)(rewards, mask.astype(np.float32), old, ref, values)
    raw, returns = np.zeros((e * s, t)), np.zeros((e * s, t))
    kl = coef * (old.astype(np.float64) - ref)
    for ep in range(e):
        rows, cols = zip(*[(ep * s + row, col) for row in reversed(range(s)) for col in range(t)
                           if mask[ep * s + row, col]])
        raw[rows, cols], returns[rows, cols] = episode_gae(float(rewards[ep, 0]), kl[rows, cols],
                                                            values[rows, cols].astype(np.float64), 0.9, 0.8)
    mean = raw[mask].mean()
    want = np.where(mask, (raw - mean) / np.sqrt(((raw[mask] - mean) ** 2).mean() + 1e-8), 0.0)
    np.testing.assert_allclose(np.asarray(batch["returns"]), returns, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(batch["advantages"]), want, rtol=1e-4, atol=1e-5)
    shaped = rewards[:, 0] - (kl * mask).reshape(e, s * t).sum(axis=1)
    assert float(stats["shaped_reward_mean"]) == pytest.approx(shaped.mean(), rel=1e-5, abs=1e-6)
