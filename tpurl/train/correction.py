"""Rollout corrections: what the update does about the gap between the rollout engine's logprobs
and the trainer's, and the metrics that measure that gap.

The engine samples with one program (decode steps, bf16 weights, its batch) and the trainer
scores the same tokens with another (one forward, fp32 masters, other shapes), and an
asynchronous batch was sampled by an older policy: the behaviour policy `pi_rollout` is not the
trainer's old policy `pi_old`. With `w_t = pi_old(t) / pi_rollout(t)` per completion token (the
sampled ones: `loss_mask`), a `CorrectionConfig` weighs each token's policy loss by
stop-gradient weights:

    is_level  "token": min(w_t, is_cap) (truncated importance sampling, TIS); "sequence":
              min(prod_t w_t, is_cap) for every token of the sequence
    mask_level  a weight 0 (rejection) where the ratio leaves [mask_low, mask_high]: "token" per
              token w_t; "sequence" the sequence's prod_t w_t; "geometric" its geometric mean
              exp(mean_t log w_t), which does not grow with the length
    bypass    the rollout's logprobs are the old policy (`pi_old := pi_rollout`): no old-logprob
              pass (a forward per step saved where the update needs one), PPO's clip bounds
              pi / pi_rollout directly; nothing is left for is_level or mask_level to correct

Both weights multiply (a masked token weighs 0, a kept one its IS weight); the loss's
aggregation is unchanged, so masked tokens still count in its normaliser. IcePop (IS weight w_t
where w_t is in [0.5, 5], else 0) is `is_level="token"` with `is_cap=5` and a token mask over
[0.5, 5]: `correction_preset("icepop")`. Ratios are computed in log space with the exponent
clipped at +-20, so a broken rollout gives large finite numbers, never inf.

Metrics (`mismatch_metrics`, every step, on the whole update batch): the KL from the rollout to
the trainer's policy estimated on the rollout's samples (`kl_k1` = mean of log pi_rollout -
log pi_trainer, `kl_k3` Schulman's k3), the chi-square `chi2` = mean of (w - 1)^2, the token
ratio's `ratio_max`, `ratio_min` and `ratio_p99`, the absolute logprob difference's mean and max,
and the correction's effect: `weight_mean`, `token_masked_frac`, `seq_masked_frac` (sequences
with every token masked) and `truncated_frac` (tokens whose IS weight was capped). The trainer's
policy is the old policy the update starts from; in bypass mode, the update's own forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tpurl.config_types import check_types

IS_LEVELS = ("token", "sequence")
MASK_LEVELS = ("token", "sequence", "geometric")
# The clip of every ratio's exp() argument, here and in the policy losses: beyond e^20 a rollout is broken.
MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """How the update corrects the rollout/trainer mismatch (see the module docstring).
    The default corrects nothing (the metrics are still measured)."""

    is_level: str | None = None
    is_cap: float = 2.0
    mask_level: str | None = None
    mask_low: float = 0.5
    mask_high: float = 2.0
    bypass: bool = False

    def __post_init__(self):
        check_types(self)
        if self.is_level not in (None,) + IS_LEVELS:
            raise ValueError(f"CorrectionConfig.is_level={self.is_level!r}; use one of {IS_LEVELS} or None")
        if self.mask_level not in (None,) + MASK_LEVELS:
            raise ValueError(f"CorrectionConfig.mask_level={self.mask_level!r}; use one of {MASK_LEVELS} or None")
        if not self.is_cap >= 1:
            raise ValueError(f"CorrectionConfig.is_cap={self.is_cap} must be >= 1 (a weight cap; 2.0 is common)")
        if not 0 <= self.mask_low < 1 < self.mask_high:
            raise ValueError(f"CorrectionConfig mask bounds [{self.mask_low}, {self.mask_high}] must hold 1 "
                             "strictly inside, with mask_low >= 0 (e.g. [0.5, 2.0])")
        if self.bypass and (self.is_level or self.mask_level):
            raise ValueError("CorrectionConfig.bypass makes the rollout's logprobs the old policy, so the ratio "
                             "is_level/mask_level would correct is 1; set them None (PPO's clip bounds pi / pi_rollout)")

    @property
    def weighs(self) -> bool:
        """Whether the update's token losses are multiplied by correction weights."""
        return self.is_level is not None or self.mask_level is not None

    @property
    def active(self) -> bool:
        """Whether the update corrects for the behaviour policy at all (what a stale batch needs)."""
        return self.weighs or self.bypass


CORRECTIONS: dict[str, CorrectionConfig] = {
    "none": CorrectionConfig(),
    "tis": CorrectionConfig(is_level="token", is_cap=2.0),
    "seq_tis": CorrectionConfig(is_level="sequence", is_cap=2.0),
    "token_mask": CorrectionConfig(mask_level="token", mask_low=0.5, mask_high=2.0),
    "seq_mask": CorrectionConfig(mask_level="sequence", mask_low=0.5, mask_high=2.0),
    "geo_mask": CorrectionConfig(mask_level="geometric", mask_low=0.999, mask_high=1.001),
    "icepop": CorrectionConfig(is_level="token", is_cap=5.0, mask_level="token", mask_low=0.5, mask_high=5.0),
    "bypass": CorrectionConfig(bypass=True),
}


def correction_preset(name: str, **overrides) -> CorrectionConfig:
    """A named correction, optionally with fields replaced (`correction_preset("tis", is_cap=3.0)`)."""
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; known corrections: {', '.join(sorted(CORRECTIONS))}")
    return dataclasses.replace(CORRECTIONS[name], **overrides)


def _log_ratios(old_BT, rollout_BT, mask_BT):
    """Per-token log w (0 off the mask) and per-sequence sum and mean of log w."""
    m = jnp.asarray(mask_BT, jnp.float32)
    log_w = jnp.clip(old_BT - rollout_BT, -MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    seq_sum_B = log_w.sum(axis=1)
    return log_w, seq_sum_B, seq_sum_B / jnp.maximum(m.sum(axis=1), 1.0)


def _outside(log_x, low: float, high: float):
    """log_x's ratio is outside [low, high] (low 0: no lower bound)."""
    below = log_x < jnp.log(low) if low > 0 else jnp.zeros_like(log_x, bool)
    return below | (log_x > jnp.log(high))


def _parts(cfg: CorrectionConfig, ratios):
    """(IS weight [B, T], kept [B, T] bool, truncated [B, T] bool) of the sampled tokens, from
    their `_log_ratios`."""
    log_w, seq_sum_B, seq_mean_B = ratios
    shape = log_w.shape
    log_cap = jnp.log(cfg.is_cap)
    if cfg.is_level == "token":
        is_w, truncated = jnp.exp(jnp.minimum(log_w, log_cap)), log_w > log_cap
    elif cfg.is_level == "sequence":
        seq = jnp.broadcast_to(seq_sum_B[:, None], shape)
        is_w, truncated = jnp.exp(jnp.minimum(seq, log_cap)), seq > log_cap
    else:
        is_w, truncated = jnp.ones(shape), jnp.zeros(shape, bool)
    if cfg.mask_level == "token":
        kept = ~_outside(log_w, cfg.mask_low, cfg.mask_high)
    elif cfg.mask_level in ("sequence", "geometric"):
        seq = seq_sum_B if cfg.mask_level == "sequence" else seq_mean_B
        kept = jnp.broadcast_to(~_outside(seq, cfg.mask_low, cfg.mask_high)[:, None], shape)
    else:
        kept = jnp.ones(shape, bool)
    return is_w, kept, truncated


def correction_weights(cfg: CorrectionConfig, old_BT, rollout_BT, mask_BT) -> jax.Array:
    """The stop-gradient weights `[B, T]` the token losses are multiplied by (1 where `cfg` weighs
    nothing)."""
    is_w, kept, _ = _parts(cfg, _log_ratios(old_BT, rollout_BT, mask_BT))
    return jax.lax.stop_gradient(jnp.where(kept, is_w, 0.0))


def mismatch_metrics(cfg: CorrectionConfig, trainer_BT, rollout_BT, mask_BT) -> dict[str, jax.Array]:
    """The rollout/trainer mismatch of the batch's sampled tokens and what `cfg` did about it
    (names under `mismatch/` and `correction/`; see the module docstring)."""
    m = jnp.asarray(mask_BT, jnp.float32)
    on = m > 0
    n_tok = jnp.maximum(m.sum(), 1.0)
    seq_on = on.any(axis=1)
    n_seq = jnp.maximum(seq_on.sum(), 1).astype(jnp.float32)
    diff = jnp.where(on, rollout_BT - trainer_BT, 0.0)  # log pi_rollout - log pi_trainer
    ratios = _log_ratios(trainer_BT, rollout_BT, mask_BT)
    log_w = ratios[0]  # -diff, clipped
    w = jnp.exp(log_w)

    def mean(x):
        return jnp.sum(jnp.where(on, x, 0.0)) / n_tok

    is_w, kept, truncated = _parts(cfg, ratios)
    kept = kept | ~on
    weight = jnp.where(kept, is_w, 0.0)
    return {
        "mismatch/kl_k1": mean(diff),
        "mismatch/kl_k3": mean(w - 1.0 - log_w),
        "mismatch/chi2": mean(jnp.square(w - 1.0)),
        # A batch without sampled tokens has none: -inf, inf and nan (a step's minibatches combine
        # by max, min and a mean of the finite ones, `tpurl.rl.step`).
        "mismatch/ratio_max": jnp.max(jnp.where(on, w, -jnp.inf)),
        "mismatch/ratio_min": jnp.min(jnp.where(on, w, jnp.inf)),
        "mismatch/ratio_p99": jnp.nanquantile(jnp.where(on, w, jnp.nan), 0.99),
        "mismatch/abs_diff_mean": mean(jnp.abs(diff)),
        "mismatch/abs_diff_max": jnp.max(jnp.abs(diff)),
        "correction/weight_mean": mean(weight),
        "correction/token_masked_frac": mean((~kept).astype(jnp.float32)),
        "correction/seq_masked_frac": jnp.sum(seq_on & ~(kept & on).any(axis=1)) / n_seq,
        "correction/truncated_frac": mean((truncated & kept).astype(jnp.float32)),
    }
