"""Advantage estimators of the GRPO family (per sequence) and GAE (per token, for PPO).

Shapes: P prompts, G completions per prompt (a *group*), B = P * G sequences, T tokens.

Group estimators turn a `[P, G]` reward matrix into per-sequence advantages:

    grpo          (r - mean_g) / (std_g + eps)      std with Bessel's correction, as TRL/verl do
    dr_grpo       r - mean_g                         (Dr. GRPO: the std division biases the update)
    rloo          r - mean of the *other* members    = G/(G-1) * (r - mean_g)
    reinforce_pp  (r - mean_g) / (std_batch + eps)   REINFORCE++-baseline (needs G >= 2: with G = 1
                                                     every advantage would be 0, so it is an error);
                                                     without the baseline (any G, e.g. one sample
                                                     per prompt), (r - mean_batch) / (std_batch + eps)

A group whose (valid) rewards are all equal carries no learning signal: the group estimators give
it exactly zero advantage and it is counted as *degenerate* (DAPO's dynamic sampling drops those
groups and refills the batch; `keep_groups` says which to keep). `valid_PG` marks the members that
exist, so groups may be ragged (e.g. a failed rollout); missing members get zero advantage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpurl.train.config import ESTIMATORS
from tpurl.train.losses import kl_estimate

GROUP_ESTIMATORS = tuple(e for e in ESTIMATORS if e != "gae")


def _masked_group_stats(r_PG, m_PG):
    n_P = m_PG.sum(axis=1)
    mean_P = (r_PG * m_PG).sum(axis=1) / jnp.maximum(n_P, 1.0)
    sq_P = (jnp.square(r_PG - mean_P[:, None]) * m_PG).sum(axis=1)
    return n_P, mean_P, sq_P


def degenerate_groups(rewards_PG: jax.Array, valid_PG: jax.Array | None = None, *, tol: float = 0.0) -> jax.Array:
    """`[P]` bool: groups whose valid rewards all lie within `tol` of each other (or that have fewer
    than two valid members), i.e. groups with no relative signal."""
    r = jnp.asarray(rewards_PG, jnp.float32)
    m = jnp.ones(r.shape, bool) if valid_PG is None else jnp.asarray(valid_PG, bool)
    hi = jnp.where(m, r, -jnp.inf).max(axis=1)
    lo = jnp.where(m, r, jnp.inf).min(axis=1)
    return (m.sum(axis=1) < 2) | (hi - lo <= tol)


def keep_groups(rewards_PG: jax.Array, valid_PG: jax.Array | None = None) -> jax.Array:
    """DAPO dynamic sampling: `[P]` bool of the groups worth training on (not degenerate)."""
    return ~degenerate_groups(rewards_PG, valid_PG)


def compute_advantages(rewards_PG: jax.Array, estimator: str, *, valid_PG: jax.Array | None = None,
                       eps: float = 1e-6, reinforce_pp_baseline: bool = True,
                       flatten: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence advantages from a `[P, G]` reward matrix (members of a group adjacent in B).

    Returns `(advantages, stats)`: advantages `[P * G]` (or `[P, G]` with `flatten=False`), float32,
    zero for degenerate groups and invalid members; stats hold `degenerate_groups` (count),
    `reward_mean`, `reward_std` (over valid members) and `adv_mean`, `adv_std`.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {GROUP_ESTIMATORS} "
                         "(GAE is `gae(...)`, per token)")
    r = jnp.asarray(rewards_PG, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards_PG must be [num_prompts, group_size], got shape {r.shape}")
    if estimator == "reinforce_pp" and reinforce_pp_baseline and r.shape[1] < 2:
        raise ValueError(f"reinforce_pp with reinforce_pp_baseline=True needs group_size >= 2 (got rewards_PG "
                         f"{r.shape}: a group of one is its own baseline, so every advantage would be 0); "
                         "use reinforce_pp_baseline=False for one sample per prompt")
    valid = jnp.ones(r.shape, bool) if valid_PG is None else jnp.asarray(valid_PG, bool)
    m = valid.astype(jnp.float32)
    n_P, mean_P, sq_P = _masked_group_stats(r, m)
    degenerate_P = degenerate_groups(r, valid)
    centered = (r - mean_P[:, None]) * m

    if estimator == "grpo":
        std_P = jnp.sqrt(sq_P / jnp.maximum(n_P - 1.0, 1.0))
        adv = centered / (std_P[:, None] + eps)
    elif estimator == "dr_grpo":
        adv = centered
    elif estimator == "rloo":
        adv = centered * (n_P / jnp.maximum(n_P - 1.0, 1.0))[:, None]
    else:  # reinforce_pp
        total = jnp.maximum(m.sum(), 1.0)
        # With the baseline, x is zero-mean per group and hence over the batch; without it,
        # the batch mean is the baseline. Either way only the batch std normalizes.
        x = (centered if reinforce_pp_baseline else r - (r * m).sum() / total) * m
        batch_std = jnp.sqrt((jnp.square(x) * m).sum() / jnp.maximum(total - 1.0, 1.0))
        adv = x / (batch_std + eps)
    # Without a baseline REINFORCE++ does not use groups at all, so only count degenerate ones.
    group_based = estimator != "reinforce_pp" or reinforce_pp_baseline
    if group_based:
        adv = jnp.where(degenerate_P[:, None], 0.0, adv)
    adv = adv * m

    total = jnp.maximum(m.sum(), 1.0)
    r_mean = (r * m).sum() / total
    a_mean = adv.sum() / total
    stats = {
        "degenerate_groups": degenerate_P.sum().astype(jnp.int32),
        "reward_mean": r_mean,
        "reward_std": jnp.sqrt((jnp.square(r - r_mean) * m).sum() / total),
        "adv_mean": a_mean,
        "adv_std": jnp.sqrt((jnp.square(adv - a_mean) * m).sum() / total),
    }
    return (adv.reshape(-1) if flatten else adv), stats


def gae(rewards_BT: jax.Array, values_BT: jax.Array, mask_BT: jax.Array, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation over the masked (completion) tokens of each sequence.

    `values_BT[b, t]` is the critic's value of the state before token t, `rewards_BT[b, t]` the
    reward for emitting it (typically the task reward on the last completion token minus a
    per-token KL penalty). Positions outside `mask_BT` are skipped (the recursion links each
    completion token to the next one), and the state after the last one is terminal (value 0).

    Returns `(advantages_BT, returns_BT)`, both zero outside the mask; returns = advantages + values.
    """
    r = jnp.asarray(rewards_BT, jnp.float32)
    v = jnp.asarray(values_BT, jnp.float32)
    m = jnp.asarray(mask_BT, bool)

    def back(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_v - v_t
        a_t = delta + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros_B = jnp.zeros(r.shape[:1], jnp.float32)
    _, adv_TB = jax.lax.scan(back, (zeros_B, zeros_B), (r.T, v.T, m.T), reverse=True)
    adv = adv_TB.T
    return adv, jnp.where(m, adv + v, 0.0)


def whiten(x_BT: jax.Array, mask_BT: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """Normalize `x` to unit variance (and zero mean) over the masked tokens; zero outside the mask."""
    m = jnp.asarray(mask_BT, jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean = (x_BT * m).sum() / n
    var = (jnp.square(x_BT - mean) * m).sum() / n
    y = (x_BT - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return y * m


def token_rewards(seq_rewards_B: jax.Array, mask_BT: jax.Array, kl_BT: jax.Array | None = None,
                  kl_coef: float = 0.0) -> jax.Array:
    """Per-token rewards for GAE: the sequence reward on its last completion token, minus
    `kl_coef * kl_BT` on every completion token (KL in the reward, as PPO-RLHF does)."""
    m = jnp.asarray(mask_BT, jnp.float32)
    t = m.shape[1]
    last_B = (t - 1) - jnp.argmax(m[:, ::-1], axis=1)
    is_last = (jnp.arange(t)[None, :] == last_B[:, None]) & (m.sum(axis=1) > 0)[:, None]
    r = jnp.where(is_last, jnp.asarray(seq_rewards_B, jnp.float32)[:, None], 0.0)
    if kl_BT is not None and kl_coef:
        r = r - kl_coef * kl_BT * m
    return r * m


def kl_penalized_rewards(seq_rewards_B: jax.Array, logprobs_BT: jax.Array, ref_logprobs_BT: jax.Array,
                         mask_BT: jax.Array, *, kl_coef: float, estimator: str = "k1") -> jax.Array:
    """KL in the reward for the sequence-level estimators: r - kl_coef * sum_t KL_t over the
    completion tokens (RLOO, REINFORCE++). For GAE use `token_rewards` with the per-token KL."""
    return jnp.asarray(seq_rewards_B, jnp.float32) - kl_penalty(logprobs_BT, ref_logprobs_BT, mask_BT,
                                                                kl_coef=kl_coef, estimator=estimator)


def kl_penalty(logprobs_BT: jax.Array, ref_logprobs_BT: jax.Array, mask_BT: jax.Array, *, kl_coef: float,
               estimator: str = "k1") -> jax.Array:
    """`[B]` what the KL in the reward takes from each sequence's reward: kl_coef * sum_t KL_t."""
    kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, estimator) * jnp.asarray(mask_BT, jnp.float32)
    return kl_coef * kl_BT.sum(axis=1)
