"""Policy losses, aggregations, KL estimators, TIS and the combined objective against float64 numpy
(the other corrections and the mismatch metrics: tests/train/test_correction.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.train.config import AlgorithmConfig
from tpurl.train.correction import CorrectionConfig
from tpurl.train.losses import (aggregate, aggregation_weights, batch_metrics, cispo_loss, gspo_loss, kl_estimate,
                                ppo_clip_loss, rl_objective, value_loss)


def tis(cap):
    return CorrectionConfig(is_level="token", is_cap=cap)

B, T = 5, 8
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    mask = np.zeros((B, T), bool)
    mask[0, 2:] = True
    mask[1, 3:6] = True  # ragged lengths
    mask[2, 7:] = True
    mask[3, 1:8] = True
    # row 4: no completion tokens at all
    old = -np.abs(rng.normal(1.0, 0.5, (B, T)))
    new = old + rng.normal(0, 0.3, (B, T))  # ratios on both sides of the clip range
    ref = old + rng.normal(0, 0.2, (B, T))
    rollout = old + rng.normal(0, 0.4, (B, T))
    adv_B = np.array([1.5, -0.7, 0.3, -2.0, 0.9])
    return dict(mask=mask, old=old, new=new, ref=ref, rollout=rollout, adv_B=adv_B,
                adv_BT=adv_B[:, None] * np.ones((B, T)))


def np_aggregate(loss, mask, mode, norm_len=None):
    lens = mask.sum(1)
    rows = [b for b in range(B) if lens[b] > 0]
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return np.mean([(loss[b] * mask[b]).sum() / lens[b] for b in rows])
    if mode == "seq-mean-token-sum":
        return np.mean([(loss[b] * mask[b]).sum() for b in rows])
    return (loss * mask).sum() / (B * norm_len)


def np_episode_aggregate(loss, mask, mode, s, norm_len=None):
    """`np_aggregate` where each `s` consecutive rows are one sequence (an agent episode's rows)."""
    b = len(mask)
    per = [(sum((loss[r] * mask[r]).sum() for r in range(e, e + s)), mask[e:e + s].sum()) for e in range(0, b, s)]
    used = [(total, n) for total, n in per if n > 0]
    if mode == "token-mean":
        return sum(t for t, _ in used) / mask.sum()
    if mode == "seq-mean-token-mean":
        return np.mean([t / n for t, n in used])
    if mode == "seq-mean-token-sum":
        return np.mean([t for t, _ in used])
    return sum(t for t, _ in used) / (b // s * norm_len)


def np_ppo(new, old, adv, lo, hi, dual=None):
    out = np.zeros_like(new)
    for idx in np.ndindex(new.shape):
        r, a = np.exp(new[idx] - old[idx]), adv[idx]
        obj = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
        if dual is not None and a < 0:
            obj = max(obj, dual * a)
        out[idx] = -obj
    return out


def f32(x):
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("mode", AGGS)
def test_rows_of_one_sequence_aggregate_as_one(data, mode):
    """`rows_per_sequence` = 2: each two consecutive rows are one sequence (float64 reference); an
    episode whose tokens are split over its two rows, or held by its first with an empty second,
    weighs as the same tokens in one row of a batch of one row per episode."""
    rng = np.random.default_rng(2)
    loss, mask = rng.normal(size=(B, T)), np.asarray(data["mask"], np.float64)
    norm_len = 32 if mode == "seq-mean-token-sum-norm" else None
    got = float(aggregate(f32(loss[:4]), f32(mask[:4]), mode, norm_len=norm_len, rows_per_sequence=2))
    want = np_episode_aggregate(loss[:4], mask[:4], mode, 2, norm_len)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    one = np.asarray(aggregation_weights(f32(mask), mode, norm_len=norm_len))
    padded, split = np.zeros((2 * B, T)), np.zeros((2 * B, T))
    padded[::2] = mask
    split[::2, :T // 2], split[1::2, T // 2:] = mask[:, :T // 2], mask[:, T // 2:]
    for two in (padded, split):
        w = np.asarray(aggregation_weights(f32(two), mode, norm_len=norm_len, rows_per_sequence=2))
        np.testing.assert_allclose(w[::2] + w[1::2], one, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="5 rows do not split into sequences of 2 rows"):
        aggregation_weights(f32(mask), mode, norm_len=norm_len, rows_per_sequence=2)


@pytest.mark.parametrize("mode", AGGS)
def test_aggregations_match_numpy(data, mode):
    rng = np.random.default_rng(1)
    loss = rng.normal(size=(B, T))
    norm_len = 32 if mode == "seq-mean-token-sum-norm" else None
    got = float(aggregate(f32(loss), data["mask"], mode, norm_len=norm_len))
    np.testing.assert_allclose(got, np_aggregate(loss, data["mask"], mode, norm_len), rtol=1e-5, atol=1e-6)
    if mode == "seq-mean-token-sum-norm":  # a constant normalizer, never the batch's padded length
        with pytest.raises(ValueError, match="needs a positive norm_len"):
            aggregate(f32(loss), data["mask"], mode)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregation_weights(data["mask"], "sum")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_numpy(data, estimator):
    log_r = data["new"] - data["ref"]
    want = {"k1": log_r, "k2": 0.5 * log_r ** 2, "k3": np.exp(-log_r) - 1 + log_r}[estimator]
    got = np.asarray(kl_estimate(f32(data["new"]), f32(data["ref"]), estimator))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_k3_is_unbiased_and_nonnegative():
    """Sampling from p: E[k1] = E[k3] = KL(p||q), k3 >= 0 (the reason GRPO uses it)."""
    rng = np.random.default_rng(2)
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3])
    x = rng.choice(3, size=200_000, p=p)
    k3 = np.asarray(kl_estimate(f32(np.log(p)[x]), f32(np.log(q)[x]), "k3"))
    assert k3.min() >= 0
    np.testing.assert_allclose(k3.mean(), (p * np.log(p / q)).sum(), rtol=2e-2)


def test_k3_value_and_gradient_for_any_log_ratio():
    """Over log r in [-30, 30]: exact (float64) where log r >= -10, the tangent at -10 below, and a
    gradient with the true gradient's sign everywhere (descent moves towards the reference)."""
    log_r = np.linspace(-30.0, 30.0, 601)
    x = np.maximum(log_r, -10.0)
    want = np.exp(-x) - 1 + x + (1 - np.exp(-x)) * (log_r - x)
    want_grad = 1 - np.exp(-x)
    k3 = lambda lr: kl_estimate(lr, jnp.zeros_like(lr), "k3")
    got = np.asarray(k3(f32(log_r)), np.float64)
    grad = np.asarray(jax.vmap(jax.grad(k3))(f32(log_r)), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(got)) and got.min() >= 0
    assert np.array_equal(np.sign(grad), np.sign(1 - np.exp(-log_r)))  # the true gradient's sign
    assert np.all(np.diff(grad) >= 0)  # convex
    assert np.abs(grad).max() < np.exp(10.0) and got.max() < 1e6  # bounded for any ratio


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_matches_numpy(data, dual):
    lo, hi = 0.2, 0.28
    loss, info = ppo_clip_loss(f32(data["new"]), f32(data["old"]), f32(data["adv_BT"]), eps_low=lo, eps_high=hi,
                               dual_clip=dual)
    want = np_ppo(data["new"], data["old"], data["adv_BT"], lo, hi, dual)
    np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
    ratio = np.exp(data["new"] - data["old"])
    a = data["adv_BT"]
    np.testing.assert_array_equal(np.asarray(info["clipped_low"]) > 0, (ratio < 1 - lo) & (a < 0))
    np.testing.assert_array_equal(np.asarray(info["clipped_high"]) > 0, (ratio > 1 + hi) & (a > 0))
    assert np.asarray(info["clipped_low"]).any() and np.asarray(info["clipped_high"]).any()
    # gradient: zero exactly where the clip binds, ratio * A elsewhere (d/dlogp of -ratio * A)
    g = jax.grad(lambda lp: ppo_clip_loss(lp, f32(data["old"]), f32(a), eps_low=lo, eps_high=hi,
                                          dual_clip=dual)[0].sum())(f32(data["new"]))
    binds = ((ratio < 1 - lo) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))
    if dual is not None:
        binds |= (a < 0) & (-ratio * a > dual * -a)
    np.testing.assert_allclose(np.asarray(g), np.where(binds, 0.0, -ratio * a), rtol=1e-5, atol=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    old = np.zeros((1, 1))
    new = np.full((1, 1), 3.0)  # ratio e^3 ~ 20 on a bad token
    loss, info = ppo_clip_loss(f32(new), f32(old), f32([[-1.0]]), eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert float(loss[0, 0]) == pytest.approx(3.0) and float(info["dual_clipped"][0, 0]) == 1.0


def np_gspo_objective(new, old, adv_B, mask, lo, hi):
    """Sequence-level GSPO, aggregated as a mean over sequences with completion tokens."""
    out = []
    for b in range(B):
        n = mask[b].sum()
        if n == 0:
            continue
        s = np.exp(((new[b] - old[b]) * mask[b]).sum() / n)
        out.append(-min(s * adv_B[b], np.clip(s, 1 - lo, 1 + hi) * adv_B[b]))
    return np.mean(out)


def test_gspo_matches_sequence_level_numpy_value_and_gradient(data):
    lo, hi = 0.05, 0.08
    mask, old, adv_B = data["mask"], data["old"], data["adv_B"]

    def jax_obj(new):
        loss, _ = gspo_loss(new, f32(old), f32(data["adv_BT"]), mask, eps_low=lo, eps_high=hi)
        return aggregate(loss, mask, "seq-mean-token-mean")

    new = data["new"]
    np.testing.assert_allclose(float(jax_obj(f32(new))), np_gspo_objective(new, old, adv_B, mask, lo, hi),
                               rtol=1e-5)
    g = np.asarray(jax.grad(jax_obj)(f32(new)))
    h = 1e-6
    fd = np.zeros_like(new)
    for idx in zip(*np.nonzero(mask)):
        e = np.zeros_like(new)
        e[idx] = h
        fd[idx] = (np_gspo_objective(new + e, old, adv_B, mask, lo, hi)
                   - np_gspo_objective(new - e, old, adv_B, mask, lo, hi)) / (2 * h)
    np.testing.assert_allclose(g * mask, fd, rtol=1e-3, atol=1e-6)
    assert np.abs(fd).max() > 0


def test_cispo_matches_numpy_and_keeps_gradient_on_clipped_tokens(data):
    lo, hi = 1.0, 0.1
    new, old, a = data["new"], data["old"], data["adv_BT"]
    ratio = np.exp(new - old)
    w = np.clip(ratio, 1 - lo, 1 + hi)
    loss, info = cispo_loss(f32(new), f32(old), f32(a), eps_low=lo, eps_high=hi)
    np.testing.assert_allclose(np.asarray(loss), -w * a * new, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lp: cispo_loss(lp, f32(old), f32(a), eps_low=lo, eps_high=hi)[0].sum())(f32(new))
    np.testing.assert_allclose(np.asarray(g), -w * a, rtol=1e-5, atol=1e-6)  # stop-gradient weight
    assert (ratio > 1 + hi).any()


def test_value_loss_matches_numpy():
    rng = np.random.default_rng(3)
    v, v_old, ret = rng.normal(size=(3, B, T))
    got = np.asarray(value_loss(f32(v), f32(v_old), f32(ret), clip=0.2))
    v_clip = v_old + np.clip(v - v_old, -0.2, 0.2)
    np.testing.assert_allclose(got, 0.5 * np.maximum((v - ret) ** 2, (v_clip - ret) ** 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type,agg", [("ppo", "seq-mean-token-mean"), ("gspo", "token-mean"),
                                           ("cispo", "seq-mean-token-sum-norm")])
def test_rl_objective_combines_terms_like_numpy(data, loss_type, agg):
    cfg = AlgorithmConfig(name="t", loss_type=loss_type, loss_agg=agg, eps_low=0.2, eps_high=0.3,
                          kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, correction=tis(2.0),
                          dual_clip=4.0 if loss_type == "ppo" else None, loss_norm_len=24)
    rng = np.random.default_rng(4)
    ent = rng.uniform(0, 3, (B, T))
    mask = data["mask"]
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv_B"]), "old_logprobs": f32(data["old"]),
             "ref_logprobs": f32(data["ref"]), "rollout_logprobs": f32(data["rollout"])}
    w = aggregation_weights(f32(mask), agg, norm_len=cfg.loss_norm_len)
    tw = f32(mask) / mask.sum()
    loss, sums, maxes, tokens = rl_objective(cfg, f32(data["new"]), f32(ent), batch, w, tw)
    whole = batch_metrics(cfg, tokens, batch)

    new, old, a = data["new"], data["old"], data["adv_BT"]
    tis_w = np.minimum(np.exp(old - data["rollout"]), 2.0)
    if loss_type == "ppo":
        pg_tok = np_ppo(new, old, a, 0.2, 0.3, 4.0)
    elif loss_type == "gspo":
        s = np.exp(((new - old) * mask).sum(1) / np.maximum(mask.sum(1), 1))[:, None] * np.ones((B, T))
        pg_tok = -np.minimum(s * a, np.clip(s, 0.8, 1.3) * a)
    else:
        pg_tok = -np.clip(np.exp(new - old), 0.8, 1.3) * a * new
    log_r = new - data["ref"]
    k3 = np.exp(-log_r) - 1 + log_r
    want_pg = np_aggregate(pg_tok * tis_w, mask, agg, 24)
    want = want_pg + 0.1 * np_aggregate(k3, mask, agg, 24) - 0.01 * np_aggregate(ent, mask, agg, 24)
    np.testing.assert_allclose(float(sums["pg_loss"]), want_pg, rtol=1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(sums["kl"]), (k3 * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(whole["correction/weight_mean"]), (tis_w * mask).sum() / mask.sum(), rtol=1e-5)
    # KL(rollout || old) from the rollout's samples: k3 with log_r = log p_rollout - log p_old.
    log_r_roll = data["rollout"].astype(np.float64) - old
    k3_roll = np.exp(-log_r_roll) - 1 + log_r_roll
    np.testing.assert_allclose(float(whole["mismatch/kl_k3"]), (k3_roll * mask).sum() / mask.sum(), rtol=1e-5)
    abs_diff = np.abs(log_r_roll)
    np.testing.assert_allclose(float(whole["mismatch/abs_diff_mean"]), (abs_diff * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(whole["mismatch/abs_diff_max"]), abs_diff[mask].max(), rtol=1e-5)
    ratio = np.exp(new - old)[mask]
    if loss_type != "gspo":
        np.testing.assert_allclose(float(maxes["ratio_max"]), ratio.max(), rtol=1e-5)
        np.testing.assert_allclose(float(-maxes["neg_ratio_min"]), ratio.min(), rtol=1e-5)


def test_kl_in_reward_keeps_kl_out_of_the_loss(data):
    cfg = AlgorithmConfig(name="t", kl_coef=0.5, kl_in_reward=True)
    mask = f32(data["mask"])
    batch = {"loss_mask": mask, "advantages": f32(data["adv_B"]), "old_logprobs": f32(data["old"]),
             "ref_logprobs": f32(data["ref"])}
    w = aggregation_weights(mask, cfg.loss_agg)
    loss, sums, _, _ = rl_objective(cfg, f32(data["new"]), jnp.zeros((B, T)), batch, w, mask / mask.sum())
    assert float(loss) == pytest.approx(float(sums["pg_loss"])) and "kl_loss" not in sums and "kl" in sums


def test_missing_batch_keys_fail_with_the_fix(data):
    mask = f32(data["mask"])
    base = {"tokens": mask, "valid": mask, "loss_mask": mask, "advantages": f32(data["adv_B"])}
    w = aggregation_weights(mask, "token-mean")
    lp = f32(data["new"])
    with pytest.raises(ValueError, match=r"needs batch keys \['ref_logprobs'\]"):
        rl_objective(AlgorithmConfig(name="t", kl_coef=0.1), lp, lp, base, w, w)
    with pytest.raises(ValueError, match=r"needs batch keys \['rollout_logprobs'\]"):
        rl_objective(AlgorithmConfig(name="t", correction=tis(2.0)), lp, lp, base, w, w)
    ppo = AlgorithmConfig(name="ppo", advantage_estimator="gae", group_size=1, value_coef=0.5)
    with pytest.raises(ValueError, match="value_head=init_value_head"):
        rl_objective(ppo, lp, lp, base, w, w)
    with pytest.raises(ValueError, match=r"\['old_values', 'returns'\]"):
        rl_objective(ppo, lp, lp, base, w, w, values_BT=lp)


def test_decoupled_ppo_for_stale_batches_matches_numpy(data):
    """Asynchronous RL (`AsyncConfig.max_staleness`): the batch was sampled by an older policy (the
    behaviour policy, `rollout_logprobs`); the update's ratio is taken against the proximal policy
    (the parameters the update starts from, `old_logprobs`), and each token is weighted by the
    truncated ratio proximal / behaviour (decoupled PPO). Removing the correction changes the loss
    and its gradient."""
    rng = np.random.default_rng(5)
    mask, prox, new, a = data["mask"], data["old"], data["new"], data["adv_BT"]
    behaviour = prox + rng.normal(0, 0.5, (B, T))  # a few versions back: far from the proximal policy
    cap = 1.5
    cfg = AlgorithmConfig(name="t", loss_agg="token-mean", eps_low=0.2, eps_high=0.28, correction=tis(cap))
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv_B"]), "old_logprobs": f32(prox),
             "rollout_logprobs": f32(behaviour)}
    w = aggregation_weights(f32(mask), cfg.loss_agg)
    tw = f32(mask) / mask.sum()

    def loss_of(c):
        return lambda lp: rl_objective(c, lp, jnp.zeros((B, T)), batch, w, tw)

    loss, sums, maxes, _ = loss_of(cfg)(f32(new))
    weight = np.minimum(np.exp(prox - behaviour), cap)
    want = np_aggregate(weight * np_ppo(new, prox, a, 0.2, 0.28), mask, "token-mean")
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(maxes["ratio_max"]), np.exp(new - prox)[mask].max(), rtol=1e-5)  # vs proximal
    assert (weight[mask] == cap).any() and (weight[mask] < 0.7).any()  # truncated above, down-weighted below
    # The gradient: the clipped surrogate's, times the (constant) weight.
    g = np.asarray(jax.grad(lambda lp: loss_of(cfg)(lp)[0])(f32(new)))
    r = np.exp(new - prox)
    inside = np.where(a > 0, r <= 1.28, r >= 0.8)  # tokens the clip leaves a gradient on
    np.testing.assert_allclose(g, np.where(mask & inside, -weight * r * a / mask.sum(), 0.0), rtol=1e-4, atol=1e-7)
    plain = cfg.replace(correction=CorrectionConfig())
    assert abs(float(loss_of(plain)(f32(new))[0]) - want) > 1e-3
    assert np.abs(np.asarray(jax.grad(lambda lp: loss_of(plain)(lp)[0])(f32(new))) - g).max() > 1e-3


@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("shape", ["on-policy", "old-logprob pass"])
def test_importance_correction_in_every_pass_shape(data, loss_type, shape):
    """TIS (rollout engine vs trainer) where the update's own forward pass is the old policy (no
    `old_logprobs`: minibatches=1, nothing stale) and where a separate old-logprob pass supplied
    it (here equal to the parameters the update starts from): the same loss and gradient, the
    float64 reference's: ratio 1, each token weighted by min(pi_old / pi_rollout, cap)."""
    mask, new, a, cap = data["mask"], data["new"], data["adv_BT"], 1.5
    cfg = AlgorithmConfig(name="t", loss_type=loss_type, loss_agg="token-mean", eps_low=0.2, eps_high=0.28,
                          correction=tis(cap))
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv_B"]), "rollout_logprobs": f32(data["rollout"])}
    if shape == "old-logprob pass":
        batch["old_logprobs"] = f32(new)
    w = aggregation_weights(f32(mask), cfg.loss_agg)
    tw = f32(mask) / mask.sum()

    def loss_of(c):
        return lambda lp: rl_objective(c, lp, jnp.zeros((B, T)), batch, w, tw)[0]

    weight = np.where(mask, np.minimum(np.exp(new - data["rollout"]), cap), 0.0)
    assert (weight[mask] == cap).any() and (weight[mask] < 0.7).any()
    n = mask.sum()
    if loss_type == "cispo":  # -sg(clip(r)) a log pi: the value carries log pi itself
        want = -(weight * a * new).sum() / n
    else:  # ratio (token or sequence) 1: -a per token
        want = -(weight * a).sum() / n
    # Every form's gradient is -weight * a * d log pi_t per token (GSPO's sequence ratio is written
    # per token, s_t = sg(s) pi_t / sg(pi_t), as `gspo_loss` says).
    want_g = np.where(mask, -weight * a / n, 0.0)
    np.testing.assert_allclose(float(loss_of(cfg)(f32(new))), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(loss_of(cfg))(f32(new))), want_g, rtol=1e-4, atol=1e-7)
    plain = cfg.replace(correction=CorrectionConfig())  # without the correction: another gradient
    assert np.abs(np.asarray(jax.grad(loss_of(plain))(f32(new))) - want_g).max() > 1e-3


def test_sequence_terms_see_an_episode_of_two_rows_as_one_sequence(data):
    """`rows_per_sequence` = 2 (an agent episode trained as two rows): GSPO's ratio, a
    sequence-level IS weight and a sequence mask are the episode's (rows 0-1 and 2-3), against
    float64 numpy; per-token outputs come back `[B, T]`; the mismatch metrics count episodes."""
    lo, hi = 0.2, 0.3
    corr = CorrectionConfig(is_level="sequence", is_cap=1.5, mask_level="sequence", mask_low=0.5, mask_high=2.0)
    cfg = AlgorithmConfig(name="t", loss_type="gspo", loss_agg="seq-mean-token-mean", eps_low=lo, eps_high=hi,
                          correction=corr)
    mask, old, new, rollout = (data[k][:4].astype(np.float64) for k in ("mask", "old", "new", "rollout"))
    adv = np.repeat([1.5, -0.7], 2)  # one advantage per episode, on both its rows
    batch = {"loss_mask": f32(mask), "advantages": f32(adv), "old_logprobs": f32(old),
             "rollout_logprobs": f32(rollout)}
    w = aggregation_weights(f32(mask), cfg.loss_agg, rows_per_sequence=2)
    loss, sums, _, tokens = rl_objective(cfg, f32(new), jnp.zeros((4, T)), batch, w, f32(mask) / mask.sum(),
                                         rows_per_sequence=2)
    assert tokens["trainer_logprobs"].shape == (4, T)
    per_episode, kept = [], []
    for e in range(2):
        rows = slice(2 * e, 2 * e + 2)
        m, n = mask[rows], mask[rows].sum()
        s = np.exp(((new[rows] - old[rows]) * m).sum() / n)
        log_w = (np.clip(old[rows] - rollout[rows], -20, 20) * m).sum()
        keep = np.log(0.5) <= log_w <= np.log(2.0)
        kept.append(keep)
        pg = -min(s * adv[2 * e], np.clip(s, 1 - lo, 1 + hi) * adv[2 * e]) * np.exp(min(log_w, np.log(1.5)))
        per_episode.append(pg * keep)
    # Episode 0 is kept (capped), episode 1 rejected; row by row, three of the four rows would be.
    assert kept == [True, False] and per_episode[0] != 0
    np.testing.assert_allclose(float(sums["pg_loss"]), np.mean(per_episode), rtol=1e-5)
    whole = batch_metrics(cfg, tokens, batch, rows_per_sequence=2)
    assert float(whole["correction/seq_masked_frac"]) == pytest.approx(1 - np.mean(kept))
