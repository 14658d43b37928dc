"""Rollout corrections and mismatch metrics (`tpurl.train.correction`) against float64 numpy:
each correction's weights and the corrected loss's gradient, each shown to differ from the
reference once the correction is removed or its bound moved; the metrics of a whole batch;
bypass mode; every algorithm preset with every correction; bad settings in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.train.config import ALGORITHMS, AlgorithmConfig
from tpurl.train.correction import (CORRECTIONS, CorrectionConfig, correction_preset, correction_weights,
                                    mismatch_metrics)
from tpurl.train.losses import aggregation_weights, batch_metrics, rl_objective

B, T = 128, 10
WEIGHING = [name for name, c in CORRECTIONS.items() if c.weighs]


def f32(x):
    return jnp.asarray(x, jnp.float32)


@pytest.fixture(scope="module")
def data():
    """Rows whose rollout/trainer gaps range from float noise to far outside every bound, so each
    correction keeps some tokens (and sequences) and rejects or truncates others, and any bound
    moved half-way to 1 changes some."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, T + 1, B)
    lengths[-1] = 0  # a row without completion tokens
    mask = np.arange(T)[None, :] >= T - lengths[:, None]
    # Each row's log pi_old - log pi_rollout scatters around its own offset, the offsets +-1e-5 to
    # +-2.5 in log steps of about 1.2x, so every bound (and every bound moved) falls between rows.
    offset = rng.permutation(np.concatenate([np.logspace(-5, 0.4, B // 2), -np.logspace(-5, 0.4, B // 2)]))[:, None]
    old = -np.abs(rng.normal(1.0, 0.5, (B, T)))
    rollout = old - offset * (1 + 0.5 * rng.normal(0, 1, (B, T)))
    new = old + rng.normal(0, 0.3, (B, T))
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -0.8)
    return dict(mask=mask, old=old, rollout=rollout, new=new, adv=adv)


def np_weights(cfg: CorrectionConfig, old, rollout, mask):
    """float64 reference: (IS weight, kept) per token."""
    log_w = np.clip(old - rollout, -20, 20) * mask
    n = np.maximum(mask.sum(1), 1)
    seq, geo = log_w.sum(1), log_w.sum(1) / n
    if cfg.is_level == "token":
        is_w = np.minimum(np.exp(log_w), cfg.is_cap)
    elif cfg.is_level == "sequence":
        is_w = np.repeat(np.minimum(np.exp(seq), cfg.is_cap)[:, None], T, 1)
    else:
        is_w = np.ones((B, T))

    def inside(x):
        return (np.exp(x) >= cfg.mask_low) & (np.exp(x) <= cfg.mask_high)

    if cfg.mask_level == "token":
        kept = inside(log_w)
    elif cfg.mask_level in ("sequence", "geometric"):
        kept = np.repeat(inside(seq if cfg.mask_level == "sequence" else geo)[:, None], T, 1)
    else:
        kept = np.ones((B, T), bool)
    return is_w, kept


def np_corrected(cfg, old, rollout, mask):
    is_w, kept = np_weights(cfg, old, rollout, mask)
    return np.where(kept, is_w, 0.0)


def moved(cfg: CorrectionConfig) -> list[CorrectionConfig]:
    """The same correction with each of its bounds moved half-way to 1 (in log space)."""
    out = []
    if cfg.is_level:
        out.append(dataclasses.replace(cfg, is_cap=cfg.is_cap ** 0.5))
    if cfg.mask_level:
        out.append(dataclasses.replace(cfg, mask_low=cfg.mask_low ** 0.5))
        out.append(dataclasses.replace(cfg, mask_high=cfg.mask_high ** 0.5))
    return out


@pytest.mark.parametrize("name", WEIGHING)
def test_each_correction_weighs_like_float64_numpy(data, name):
    cfg = correction_preset(name)
    mask = data["mask"]
    got = np.asarray(correction_weights(cfg, f32(data["old"]), f32(data["rollout"]), f32(mask)))
    want = np_corrected(cfg, data["old"], data["rollout"], mask)
    np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), rtol=1e-5, atol=1e-7)
    # The data reach every bound: removing the correction or moving a bound changes the weights.
    assert np.abs(np.where(mask, got - 1.0, 0)).max() > 1e-3, "the correction changes nothing here"
    for other in moved(cfg):
        alt = np_corrected(other, data["old"], data["rollout"], mask)
        assert np.abs(np.where(mask, got - alt, 0)).max() > 1e-3, other
    is_w, kept = np_weights(cfg, data["old"], data["rollout"], mask)
    if cfg.mask_level:
        assert (mask & kept).any() and (mask & ~kept).any()  # some kept, some rejected
    if cfg.is_level:
        assert (mask & kept & (is_w < cfg.is_cap)).any()
        # truncated and kept, unless the mask rejects everything above the cap (icepop)
        assert (mask & kept & (is_w == cfg.is_cap)).any() or (cfg.mask_level and cfg.mask_high <= cfg.is_cap)


def np_ppo(new, old, a, eps_low, eps_high):
    r = np.exp(new - old)
    return np.maximum(-r * a, -np.clip(r, 1 - eps_low, 1 + eps_high) * a), r


@pytest.mark.parametrize("name", WEIGHING)
def test_the_corrected_loss_and_gradient_match_float64_numpy(data, name):
    """PPO's clipped surrogate (token mean) times the correction's stop-gradient weights: value and
    gradient; without the correction, or with a bound moved, both differ."""
    mask, old, new, rollout = data["mask"], data["old"], data["new"], data["rollout"]
    a = np.repeat(data["adv"][:, None], T, 1)
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv"]), "old_logprobs": f32(old),
             "rollout_logprobs": f32(rollout)}
    w_agg = aggregation_weights(f32(mask), "token-mean")
    tw = f32(mask) / mask.sum()

    def loss_of(c):
        algo = AlgorithmConfig(name="t", loss_agg="token-mean", eps_low=0.2, eps_high=0.28, correction=c)
        return lambda lp: rl_objective(algo, lp, jnp.zeros((B, T)), batch, w_agg, tw)[0]

    cfg = correction_preset(name)
    weight = np_corrected(cfg, old, rollout, mask)
    pg, r = np_ppo(new, old, a, 0.2, 0.28)
    n = mask.sum()
    np.testing.assert_allclose(float(loss_of(cfg)(f32(new))), (weight * pg * mask).sum() / n, rtol=1e-5)
    g = np.asarray(jax.grad(loss_of(cfg))(f32(new)))
    inside = np.where(a > 0, r <= 1.28, r >= 0.8)  # tokens the clip leaves a gradient on
    want_g = np.where(mask & inside, -weight * r * a / n, 0.0)
    np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-7)
    for other in [CorrectionConfig(), *moved(cfg)]:
        assert np.abs(np.asarray(jax.grad(loss_of(other))(f32(new))) - want_g).max() > 1e-4, other


def np_metrics(cfg, trainer, rollout, mask):
    on = mask
    diff = rollout - trainer
    w = np.exp(np.clip(-diff, -20, 20))
    is_w, kept = np_weights(cfg, trainer, rollout, mask)
    weight = np.where(kept, is_w, 0.0)
    cap_hit = np.zeros_like(on) if not cfg.is_level else (
        (np.clip(trainer - rollout, -20, 20) > np.log(cfg.is_cap)) if cfg.is_level == "token" else
        np.repeat((np.clip(trainer - rollout, -20, 20) * mask).sum(1)[:, None] > np.log(cfg.is_cap), T, 1))
    rows = on.any(1)
    return {
        "mismatch/kl_k1": diff[on].mean(),
        "mismatch/kl_k3": (np.exp(-diff) - 1 + diff)[on].mean(),
        "mismatch/chi2": ((w - 1) ** 2)[on].mean(),
        "mismatch/ratio_max": w[on].max(),
        "mismatch/ratio_min": w[on].min(),
        "mismatch/ratio_p99": np.quantile(w[on], 0.99),
        "mismatch/abs_diff_mean": np.abs(diff)[on].mean(),
        "mismatch/abs_diff_max": np.abs(diff)[on].max(),
        "correction/weight_mean": weight[on].mean(),
        "correction/token_masked_frac": (~kept)[on].mean(),
        "correction/seq_masked_frac": (rows & ~(kept & on).any(1)).sum() / rows.sum(),
        "correction/truncated_frac": (cap_hit & kept)[on].mean(),
    }


@pytest.mark.parametrize("name", ["none", *WEIGHING])
def test_mismatch_metrics_match_float64_numpy(data, name):
    cfg = correction_preset(name)
    mask = data["mask"]

    def metrics(c):
        return {k: float(v) for k, v in mismatch_metrics(c, f32(data["old"]), f32(data["rollout"]), f32(mask)).items()}

    got = metrics(cfg)
    want = np_metrics(cfg, data["old"], data["rollout"], mask)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-7, err_msg=key)
    for other in moved(cfg):  # a bound moved shows in what the correction did
        alt = metrics(other)
        assert any(abs(alt[k] - got[k]) > 1e-4 for k in got if k.startswith("correction/")), other
    if name != "none":  # what the correction did shows; without it nothing is masked or truncated
        plain = mismatch_metrics(CorrectionConfig(), f32(data["old"]), f32(data["rollout"]), f32(mask))
        assert float(plain["correction/weight_mean"]) == pytest.approx(1.0)
        assert float(plain["correction/token_masked_frac"]) == float(plain["correction/truncated_frac"]) == 0
        assert abs(float(got["correction/weight_mean"]) - 1.0) > 1e-3


def test_a_broken_rollout_gives_finite_weights_and_metrics():
    mask = np.ones((2, 4), bool)
    old = np.zeros((2, 4))
    rollout = np.array([[-60.0, 60.0, 0.0, -1e4], [1e4, 0.0, 0.0, 0.0]])
    for cfg in CORRECTIONS.values():
        w = correction_weights(cfg, f32(old), f32(rollout), f32(mask))
        m = mismatch_metrics(cfg, f32(old), f32(rollout), f32(mask))
        assert np.isfinite(np.asarray(w)).all() and all(np.isfinite(float(v)) for v in m.values()), cfg
        empty = mismatch_metrics(cfg, f32(old), f32(rollout), jnp.zeros((2, 4)))  # no sampled token: no ratio
        assert all(np.isfinite(float(v)) for k, v in empty.items() if not k.startswith("mismatch/ratio_"))
        assert float(empty["mismatch/ratio_max"]) == -np.inf and float(empty["mismatch/ratio_min"]) == np.inf


def test_bypass_takes_the_rollout_as_the_old_policy(data):
    """Bypass: the update equals the normal path given the rollout's logprobs as the old policy's
    (the step passes them so, `tpurl.rl.step`), the old-logprob pass is not needed, and the
    mismatch is measured against the update's own forward."""
    mask, new, rollout = data["mask"], data["new"], data["rollout"]
    # Bypass ignores whatever old_logprobs the batch holds; the normal path is given the rollout's.
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv"]), "old_logprobs": f32(data["old"]),
             "rollout_logprobs": f32(rollout)}
    as_rollout = dict(batch, old_logprobs=f32(rollout))
    w_agg = aggregation_weights(f32(mask), "token-mean")
    tw = f32(mask) / mask.sum()
    normal = AlgorithmConfig(name="t", loss_agg="token-mean", minibatches=2)
    bypass = normal.replace(correction=correction_preset("bypass"))
    assert normal.needs_old_logprobs and not bypass.needs_old_logprobs
    assert normal.replace(kl_coef=0.1, kl_in_reward=True, minibatches=1).needs_old_logprobs
    assert not bypass.replace(kl_coef=0.1, kl_in_reward=True, minibatches=1).needs_old_logprobs

    def run(cfg, batch=batch):
        fn = lambda lp: rl_objective(cfg, lp, jnp.zeros((B, T)), batch, w_agg, tw)  # noqa: E731
        (loss, (_, _, tokens)), g = jax.value_and_grad(lambda lp: (lambda o: (o[0], o[1:]))(fn(lp)), has_aux=True)(
            f32(new))
        return float(loss), np.asarray(g), tokens

    loss_b, g_b, tok_b = run(bypass)
    loss_n, g_n, tok_n = run(normal, as_rollout)
    assert loss_b == loss_n and np.array_equal(g_b, g_n)
    assert abs(run(normal)[0] - loss_b) > 1e-4  # the old policy's logprobs give another loss
    np.testing.assert_array_equal(np.asarray(tok_b["trainer_logprobs"]), np.asarray(f32(new)))  # own forward
    np.testing.assert_array_equal(np.asarray(tok_n["trainer_logprobs"]), np.asarray(f32(rollout)))
    got = batch_metrics(bypass, tok_b, batch)["mismatch/abs_diff_mean"]
    np.testing.assert_allclose(float(got), np.abs(new - rollout)[mask].mean(), rtol=1e-5)
    with pytest.raises(ValueError, match=r"needs batch keys \['rollout_logprobs'\]"):
        rl_objective(bypass, f32(new), f32(new), {k: batch[k] for k in ("loss_mask", "advantages")}, w_agg, tw)


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_correction_combines_with_every_algorithm_preset(data, algo):
    mask = data["mask"]
    base = ALGORITHMS[algo]
    batch = {"loss_mask": f32(mask), "advantages": f32(data["adv"]), "old_logprobs": f32(data["old"]),
             "ref_logprobs": f32(data["old"]), "rollout_logprobs": f32(data["rollout"]),
             "old_values": f32(data["old"]), "returns": f32(data["old"])}
    w_agg = aggregation_weights(f32(mask), base.loss_agg, norm_len=T)
    tw = f32(mask) / mask.sum()
    values = f32(data["new"]) if base.value_coef > 0 else None
    losses = {}
    for name, corr in CORRECTIONS.items():
        cfg = base.replace(correction=corr)
        if corr.bypass:
            cfg_batch = dict(batch, old_logprobs=batch["rollout_logprobs"])
        else:
            cfg_batch = batch
        loss, sums, _, tokens = rl_objective(cfg, f32(data["new"]), jnp.zeros((B, T)), cfg_batch, w_agg, tw, values)
        metrics = batch_metrics(cfg, tokens, cfg_batch)
        assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values()), name
        losses[name] = float(sums["pg_loss"])
    assert len({round(v, 7) for v in losses.values()}) == len(losses), losses  # each correction acts


@pytest.mark.parametrize("kwargs,message", [
    (dict(is_level="tok"), "is_level='tok'"),
    (dict(mask_level="row"), "mask_level='row'"),
    (dict(is_cap=0.5), "is_cap=0.5 must be >= 1"),
    (dict(mask_low=1.2), r"mask bounds \[1.2, 2.0\] must hold 1"),
    (dict(mask_high=1.0), r"mask bounds \[0.5, 1.0\] must hold 1"),
    (dict(bypass=True, is_level="token"), "bypass makes the rollout's logprobs the old policy"),
])
def test_bad_correction_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        CorrectionConfig(**kwargs)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown correction 'tiss'; known corrections: bypass, geo_mask"):
        correction_preset("tiss")
