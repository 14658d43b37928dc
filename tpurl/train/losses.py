"""Policy losses, loss aggregation and KL estimators of the GRPO/PPO family (the rollout
corrections they take: `tpurl.train.correction`).

Every function works on per-token arrays `[B, T]` aligned with the token they score (see
`logprobs.py`): `logprobs[b, t] = log pi(tokens[b, t] | tokens[b, :t])`, and a `loss_mask` that is 1
on completion tokens. Per-token losses are *minimized*.

Aggregation is expressed as per-token weights computed once on the whole batch
(`aggregation_weights`), so that the loss is `sum(weights * token_loss)`: a sum over tokens is
linear, so splitting the batch into micro-batches and adding their losses (and gradients) gives
exactly the full-batch result, whichever mode is used.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from tpurl.train.config import KL_ESTIMATORS, LOSS_AGGS, AlgorithmConfig
from tpurl.train.correction import MAX_LOG_RATIO, correction_weights, mismatch_metrics

# exp() arguments of ratios are clipped at +-MAX_LOG_RATIO (20, one home with the corrections'):
# ratios beyond e^20 only arise from broken rollouts and would otherwise overflow to inf and
# poison the whole batch.
# Where the k3 KL estimate leaves exp(-log r) for its tangent (see `kl_estimate`).
_K3_LOG_RATIO_BOUND = 10.0


def aggregation_weights(loss_mask_BT: jax.Array, mode: str, *, norm_len: int | None = None,
                        rows_per_sequence: int = 1) -> jax.Array:
    """Per-token weights `w_BT` such that the aggregated loss is `sum(w_BT * token_loss_BT)`.

    token-mean               every completion token of the batch weighs the same (DAPO)
    seq-mean-token-mean      mean over sequences of each sequence's token mean (GRPO)
    seq-mean-token-sum       mean over sequences of each sequence's token sum
    seq-mean-token-sum-norm  token sum divided by B * norm_len, a constant (Dr. GRPO); norm_len
                             is required (the rollout's max_new_tokens): the padded length T
                             varies between batches and would bring back a length bias
    Sequences without completion tokens are not counted in the sequence means. With
    `rows_per_sequence` = S, each S consecutive rows are one sequence (an agent episode trained as
    several rows, `tpurl.rl.batch`): B / S sequences, whatever the episodes' rows hold.
    """
    m = jnp.asarray(loss_mask_BT, jnp.float32)
    return _weights(rows_as_sequences(m, rows_per_sequence), mode, norm_len).reshape(m.shape)


def _weights(m: jax.Array, mode: str, norm_len: int | None) -> jax.Array:
    len_B = m.sum(axis=1)
    num_seqs = jnp.maximum((len_B > 0).sum(), 1).astype(jnp.float32)
    if mode == "token-mean":
        return m / jnp.maximum(m.sum(), 1.0)
    if mode == "seq-mean-token-mean":
        return m / (jnp.maximum(len_B, 1.0)[:, None] * num_seqs)
    if mode == "seq-mean-token-sum":
        return m / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError(f"loss aggregation 'seq-mean-token-sum-norm' needs a positive norm_len, got "
                             f"{norm_len}; pass the rollout's max_new_tokens (AlgorithmConfig.loss_norm_len)")
        return m / float(m.shape[0] * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGS}")


def aggregate(token_loss_BT: jax.Array, loss_mask_BT: jax.Array, mode: str, *, norm_len: int | None = None,
              rows_per_sequence: int = 1):
    """`sum(aggregation_weights(mask, mode) * token_loss)`: one number from per-token losses."""
    return jnp.sum(aggregation_weights(loss_mask_BT, mode, norm_len=norm_len, rows_per_sequence=rows_per_sequence)
                   * token_loss_BT)


def kl_estimate(logprobs_BT: jax.Array, ref_logprobs_BT: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With log_r = log pi - log pi_ref:  k1 = log_r (unbiased, high variance, can be negative);
    k2 = log_r^2 / 2 (biased, low variance); k3 = exp(-log_r) - 1 + log_r (unbiased, >= 0).
    k3 is exact for log_r >= -10 (a token ~22,000 times less likely under the policy than under
    the reference); below, it continues along its tangent at -10, so value and gradient stay
    bounded (|gradient| < e^10 per token), the estimate stays convex and >= 0, and descent still
    moves the policy towards the reference (clipping only the exponent flips the gradient's sign).
    """
    log_r = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        return _k3(log_r)
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def _k3(log_r):
    """exp(-x) - 1 + x at x = max(log_r, -10), plus its slope there times the distance below the
    bound: exact above the bound, the tangent line below it (gradient 1 - exp(-x) everywhere)."""
    x = jnp.maximum(log_r, -_K3_LOG_RATIO_BOUND)
    inv_r = jnp.exp(-x)
    return inv_r - 1.0 + x + (1.0 - inv_r) * (log_r - x)


def _ratio(logprobs, old_logprobs):
    return jnp.exp(jnp.clip(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _clipped_surrogate(ratio, adv_BT, eps_low: float, eps_high: float):
    """max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A) per token, with the clip indicators."""
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(-ratio * adv_BT, -clipped * adv_BT)
    info = {
        "ratio": ratio,
        "clipped_low": ((ratio < 1.0 - eps_low) & (adv_BT < 0)).astype(jnp.float32),
        "clipped_high": ((ratio > 1.0 + eps_high) & (adv_BT > 0)).astype(jnp.float32),
    }
    return loss, info


def ppo_clip_loss(logprobs_BT, old_logprobs_BT, adv_BT, *, eps_low: float, eps_high: float,
                  dual_clip: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped surrogate with decoupled clip range [1 - eps_low, 1 + eps_high] (DAPO's
    clip-higher) and optional dual clip: for A < 0 the loss is capped at dual_clip * |A| so that a
    huge ratio on a bad token cannot blow up the update.

    Returns the per-token loss and per-token indicators: `ratio`, `clipped_low` (ratio below the
    range with A < 0: the clip zeroes the gradient), `clipped_high` (above it with A > 0),
    `dual_clipped`.
    """
    ratio = _ratio(logprobs_BT, old_logprobs_BT)
    loss, info = _clipped_surrogate(ratio, adv_BT, eps_low, eps_high)
    if dual_clip is not None:
        bound = -dual_clip * adv_BT
        info["dual_clipped"] = ((adv_BT < 0) & (loss > bound)).astype(jnp.float32)
        loss = jnp.where(adv_BT < 0, jnp.minimum(loss, bound), loss)
    return loss, info


def gspo_loss(logprobs_BT, old_logprobs_BT, adv_BT, loss_mask_BT, *, eps_low: float,
              eps_high: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO: the importance ratio of a sequence is the geometric mean of its token ratios,
    s = exp(mean_t(log pi - log pi_old)), clipped as in PPO. Per token it is written
    s_t = sg(s) * pi_t / sg(pi_t) (value s, gradient s * grad log pi_t), which is GSPO-token and
    equals GSPO when the advantage is the same for all tokens of a sequence.
    """
    m = jnp.asarray(loss_mask_BT, jnp.float32)
    log_r = (logprobs_BT - old_logprobs_BT) * m
    seq_log_r_B = log_r.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
    seq_log_r_BT = jax.lax.stop_gradient(seq_log_r_B)[:, None] + logprobs_BT - jax.lax.stop_gradient(logprobs_BT)
    ratio = jnp.exp(jnp.clip(seq_log_r_BT, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, adv_BT, eps_low, eps_high)


def cispo_loss(logprobs_BT, old_logprobs_BT, adv_BT, *, eps_low: float,
               eps_high: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, stop-gradient IS ratio,
    loss = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * log pi. Unlike PPO's clip no token
    loses its gradient; the clip only bounds its weight."""
    ratio = _ratio(logprobs_BT, old_logprobs_BT)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    loss = -weight * adv_BT * logprobs_BT
    info = {
        "ratio": ratio,
        "clipped_low": (ratio < 1.0 - eps_low).astype(jnp.float32),
        "clipped_high": (ratio > 1.0 + eps_high).astype(jnp.float32),
    }
    return loss, info


def value_loss(values_BT, old_values_BT, returns_BT, *, clip: float | None = None) -> jax.Array:
    """Per-token critic loss 0.5 * (V - R)^2; with `clip`, PPO's pessimistic clipped version
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
    loss = jnp.square(values_BT - returns_BT)
    if clip is not None:
        v_clip = old_values_BT + jnp.clip(values_BT - old_values_BT, -clip, clip)
        loss = jnp.maximum(loss, jnp.square(v_clip - returns_BT))
    return 0.5 * loss


def broadcast_advantages(advantages, shape_BT) -> jax.Array:
    """Sequence advantages `[B]` repeated over time, or token advantages `[B, T]` as they are."""
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        return adv[:, None] * jnp.ones(shape_BT, jnp.float32)
    if adv.shape != tuple(shape_BT):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape_BT)}, got {adv.shape}")
    return adv


def check_batch(cfg: AlgorithmConfig, batch: Mapping[str, jax.Array], *, has_values: bool) -> None:
    """Fail early (at trace time) when the batch lacks what the algorithm needs, instead of
    silently dropping a loss term."""
    need = ["loss_mask", "advantages"]
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        need.append("ref_logprobs")  # the reference policy's, from the loop's logprobs phase
    if cfg.correction.active:
        need.append("rollout_logprobs")  # the engine's logprobs of the sampled tokens
    if cfg.value_coef > 0:
        need += ["old_values", "returns"]  # from critic.make_value_fn and advantages.gae
        if not has_values:
            raise ValueError(f"algorithm {cfg.name!r} trains a critic (value_coef={cfg.value_coef}); create the "
                             "state with init_train_state(..., value_head=init_value_head(hidden_size))")
    missing = [k for k in need if k not in batch]
    if missing:
        raise ValueError(f"algorithm {cfg.name!r} needs batch keys {missing}; got {sorted(batch)}")


# The batch entries the objective and the batch metrics read, per token ([B, T]) or per row ([B]).
OBJECTIVE_KEYS = ("loss_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs", "old_values",
                  "returns")


def rows_as_sequences(x: jax.Array, rows: int) -> jax.Array:
    """Each `rows` consecutive rows as one sequence: `[B, T]` -> `[B / rows, rows * T]`; a per-row
    value `[B]` (equal within a sequence: an episode's advantage) -> `[B / rows]`."""
    if x.shape[0] % rows:
        raise ValueError(f"{x.shape[0]} rows do not split into sequences of {rows} rows")
    if x.ndim == 1:
        return x[::rows]
    b, t = x.shape
    return x.reshape(b // rows, rows * t)


def _as_sequences(batch: Mapping[str, jax.Array], rows: int) -> dict[str, jax.Array]:
    return {k: rows_as_sequences(v, rows) for k, v in batch.items() if k in OBJECTIVE_KEYS}


def rl_objective(cfg: AlgorithmConfig, logprobs_BT, entropy_BT, batch: Mapping[str, jax.Array],
                 weights_BT, token_weights_BT, values_BT=None, *, rows_per_sequence: int = 1):
    """`_rl_objective` (below); with `rows_per_sequence` = S, each S consecutive rows are one
    sequence (an agent episode's rows, `tpurl.rl.batch`) for every sequence-level term: GSPO's
    ratio, sequence-level corrections. The per-token outputs come back as `[B, T]`."""
    if rows_per_sequence == 1:
        return _rl_objective(cfg, logprobs_BT, entropy_BT, batch, weights_BT, token_weights_BT, values_BT)
    b, t = logprobs_BT.shape
    seqs = functools.partial(rows_as_sequences, rows=rows_per_sequence)
    loss, sums, maxes, tokens = _rl_objective(
        cfg, seqs(logprobs_BT), seqs(entropy_BT), _as_sequences(batch, rows_per_sequence), seqs(weights_BT),
        seqs(token_weights_BT), None if values_BT is None else seqs(values_BT))
    return loss, sums, maxes, {k: v.reshape(b, t) for k, v in tokens.items()}


def _rl_objective(cfg: AlgorithmConfig, logprobs_BT, entropy_BT, batch: Mapping[str, jax.Array],
                  weights_BT, token_weights_BT, values_BT=None):
    """The full RL loss of one (micro-)batch and its metrics.

    `weights_BT` are the aggregation weights and `token_weights_BT` = mask / (completion tokens of
    the whole batch), both precomputed on the full batch so that micro-batch results add up.
    Without `old_logprobs` in the batch the update is on-policy (pi_old = sg(pi), ratio 1).

    With `rollout_logprobs` in the batch, `cfg.correction` weighs the token losses
    (`tpurl.train.correction`: IS weights and masks of pi_old / pi_rollout), and the trainer's
    logprobs of the sampled tokens are returned for the mismatch metrics: the old policy's, or the
    update's own forward (stop-gradient) when the batch has no `old_logprobs` (on-policy: the
    parameters the step starts from are the old policy, so no separate old-policy pass is needed)
    or the rollout's are the old policy (`CorrectionConfig.bypass`, whatever `old_logprobs` holds).

    Returns `(loss, sums, maxes, tokens)`: `sums` are metrics that add over micro-batches (token
    means, loss terms), `maxes` ones that combine by max (`*_max`, and `neg_*_min` for minima),
    `tokens` per-token arrays `[B, T]` for metrics of the whole batch (`trainer_logprobs`).
    """
    check_batch(cfg, batch, has_values=values_BT is not None)
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    own = jax.lax.stop_gradient(logprobs_BT)
    old = batch["rollout_logprobs"] if cfg.correction.bypass else batch.get("old_logprobs")
    old = own if old is None else old
    adv = broadcast_advantages(batch["advantages"], logprobs_BT.shape)
    if cfg.loss_type == "ppo":
        token_loss, info = ppo_clip_loss(logprobs_BT, old, adv, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                         dual_clip=cfg.dual_clip)
    elif cfg.loss_type == "gspo":
        token_loss, info = gspo_loss(logprobs_BT, old, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    else:
        token_loss, info = cispo_loss(logprobs_BT, old, adv, eps_low=cfg.eps_low, eps_high=cfg.eps_high)

    tw = token_weights_BT
    sums = {name: jnp.sum(tw * info[key]) for name, key in
            (("clip_frac_low", "clipped_low"), ("clip_frac_high", "clipped_high"), ("ratio_mean", "ratio"))}
    if "dual_clipped" in info:
        sums["dual_clip_frac"] = jnp.sum(tw * info["dual_clipped"])
    tokens = {}
    if "rollout_logprobs" in batch:
        if cfg.correction.weighs:
            token_loss = token_loss * correction_weights(cfg.correction, old, batch["rollout_logprobs"], mask)
        tokens["trainer_logprobs"] = own if cfg.correction.bypass else old
    maxes = {}

    pg_loss = jnp.sum(weights_BT * token_loss)
    loss = pg_loss
    sums["pg_loss"] = pg_loss
    if "ref_logprobs" in batch:
        kl_BT = kl_estimate(logprobs_BT, batch["ref_logprobs"], cfg.kl_estimator)
        sums["kl"] = jnp.sum(tw * kl_BT)
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            kl_loss = jnp.sum(weights_BT * kl_BT)
            sums["kl_loss"] = kl_loss
            loss = loss + cfg.kl_coef * kl_loss
    sums["entropy"] = jnp.sum(tw * entropy_BT)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * jnp.sum(weights_BT * entropy_BT)
    if values_BT is not None and cfg.value_coef > 0:
        v_loss = jnp.sum(weights_BT * value_loss(values_BT, batch["old_values"], batch["returns"],
                                                 clip=cfg.value_clip))
        sums["value_loss"] = v_loss
        loss = loss + cfg.value_coef * v_loss
    sums["loss"] = loss
    ratio_masked = jnp.where(mask > 0, info["ratio"], 1.0)
    maxes.update(ratio_max=ratio_masked.max(), neg_ratio_min=-ratio_masked.min())
    return loss, sums, maxes, tokens


def batch_metrics(cfg: AlgorithmConfig, tokens: Mapping[str, jax.Array], batch: Mapping[str, jax.Array], *,
                  rows_per_sequence: int = 1):
    """The metrics of the whole update batch from `rl_objective`'s per-token outputs: the
    rollout/trainer mismatch and the correction's effect (`correction.mismatch_metrics`; each
    `rows_per_sequence` consecutive rows one sequence)."""
    if "trainer_logprobs" not in tokens:
        return {}
    seqs = functools.partial(rows_as_sequences, rows=rows_per_sequence)
    return mismatch_metrics(cfg.correction, seqs(tokens["trainer_logprobs"]), seqs(batch["rollout_logprobs"]),
                            seqs(batch["loss_mask"]))


def sft_objective(logprobs_BT, entropy_BT, batch: Mapping[str, jax.Array], weights_BT, token_weights_BT):
    """Cross-entropy on the completion tokens only (`loss_mask`), aggregated by `weights_BT`."""
    loss = -jnp.sum(weights_BT * logprobs_BT)
    sums = {"loss": loss, "nll": -jnp.sum(token_weights_BT * logprobs_BT),
            "entropy": jnp.sum(token_weights_BT * entropy_BT)}
    return loss, sums, {}, {}
