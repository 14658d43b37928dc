"""From a step's scored rollouts to the advantages the update trains on, for every algorithm preset.

Three ways rewards become advantages, chosen by the `AlgorithmConfig`:

    group estimators   grpo / dr_grpo / rloo / reinforce_pp over the `[P, G]` reward matrix
                       (`compute_advantages`), one advantage per episode, which each of its
                       sequences trains with (an episode of S rows, `tpurl.rl.batch`);
    + KL in the reward `kl_in_reward` (rloo, reinforce_pp presets): each episode's reward first
                       loses `kl_coef * sum_t KL_t(old || ref)` over its sequences' completion
                       tokens (`kl_penalty`), so the penalty is baselined like the reward;
    GAE (PPO critic)   per-token rewards (task reward on the last completion token, minus the
                       per-token KL penalty with `kl_in_reward`), the old policy's values, then
                       `gae` and `whiten` over the completion tokens: advantages `[B, T]` plus
                       the `old_values` / `returns` the value loss needs. An episode of several
                       rows is one trajectory: its rows in the order of their last calls (latest
                       last), the reward on the last completion token of the latest, each row's
                       last token bootstrapping from the next row's first (GAE's scan then runs
                       over S x T positions of E rows, not T of S x E).

The KL is that of the policy that produced the batch (the trainer's old-policy logprobs of the
sampled tokens) to the reference policy, estimated with `kl_estimator`. Everything runs in one
jitted function per run.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.sharding.host import to_host
from tpurl.train.advantages import compute_advantages, gae, kl_penalty, token_rewards, whiten
from tpurl.train.config import AlgorithmConfig
from tpurl.train.losses import kl_estimate

# fn(rewards_PG, loss_mask_BT, old_logprobs_BT, ref_logprobs_BT | None, old_values_BT | None)
#   -> (batch entries {"advantages", ["old_values", "returns"]}, per-sequence advantages [B], stats)
AdvantageFn = Callable[..., tuple[dict[str, jax.Array], jax.Array, dict[str, jax.Array]]]


def _masked_mean(x_BT, mask_BT):
    m = mask_BT.astype(jnp.float32)
    return (x_BT * m).sum() / jnp.maximum(m.sum(), 1.0)


def _chronological(x_BT, *, rows: int, back: bool = False):
    """Each episode's `rows` rows (latest first, `tpurl.rl.batch`) as one row of `rows * T`
    tokens in the order they were sampled, `[E, rows * T]`; `back`: the inverse."""
    x = jnp.asarray(x_BT)
    if rows == 1:
        return x
    t = x.shape[1] // rows if back else x.shape[1]
    flipped = x.reshape(-1, rows, t)[:, ::-1]
    return flipped.reshape(-1, t) if back else flipped.reshape(-1, rows * t)


def _advantages(rewards_PG, loss_mask_BT, old_logprobs_BT, ref_logprobs_BT, old_values_BT, *,
                algo: AlgorithmConfig):
    r_PG = jnp.asarray(rewards_PG, jnp.float32)
    mask = jnp.asarray(loss_mask_BT, jnp.float32)
    per_episode = mask.shape[0] // r_PG.size  # S: an episode's rows, each with its reward (tpurl.rl.batch)
    if mask.shape[0] != r_PG.size * per_episode:
        raise ValueError(f"advantages: {mask.shape[0]} rows are not {r_PG.size} episodes of the same number of rows")

    def episode_sum(x_B):
        return x_B.reshape(-1, per_episode).sum(axis=1)

    penalize = algo.kl_penalty_in_reward
    if penalize and ref_logprobs_BT is None:
        raise ValueError(f"algorithm {algo.name!r} puts the KL in the reward: pass the reference logprobs")
    extra: dict[str, jax.Array] = {}

    if algo.uses_critic:
        if old_values_BT is None:
            raise ValueError(f"algorithm {algo.name!r} uses GAE: pass the old policy's values (critic.make_value_fn)")
        kl_BT = kl_estimate(old_logprobs_BT, ref_logprobs_BT, algo.kl_estimator) * mask if penalize else None
        chrono = functools.partial(_chronological, rows=per_episode)  # an episode: one trajectory
        r_ET = token_rewards(r_PG.reshape(-1), chrono(mask), None if kl_BT is None else chrono(kl_BT),
                             algo.kl_coef if penalize else 0.0)
        adv_ET, returns_ET = gae(r_ET, chrono(old_values_BT), chrono(mask), gamma=algo.gamma, lam=algo.gae_lambda)
        raw_adv, returns = chrono(adv_ET, back=True), chrono(returns_ET, back=True)
        adv_BT = whiten(raw_adv, mask)
        values = jnp.asarray(old_values_BT, jnp.float32) * mask
        batch = {"advantages": adv_BT, "old_values": values, "returns": returns}
        per_seq = (adv_BT * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
        stats = {"adv_mean": _masked_mean(adv_BT, mask), "raw_adv_mean": _masked_mean(raw_adv, mask),
                 "value_mean": _masked_mean(values, mask), "return_mean": _masked_mean(returns, mask)}
        if penalize:
            extra["kl_penalty"] = episode_sum(algo.kl_coef * kl_BT.sum(axis=1))
        shaped = r_ET.sum(axis=1)
    else:
        if penalize:  # the episode's reward loses the KL of every sequence it trains
            extra["kl_penalty"] = episode_sum(kl_penalty(old_logprobs_BT, ref_logprobs_BT, mask, kl_coef=algo.kl_coef,
                                                         estimator=algo.kl_estimator))
            shaped = r_PG.reshape(-1) - extra["kl_penalty"]
        else:
            shaped = r_PG.reshape(-1)
        adv_E, stats = compute_advantages(shaped.reshape(r_PG.shape), algo.advantage_estimator, eps=algo.adv_eps,
                                          reinforce_pp_baseline=algo.reinforce_pp_baseline)
        per_seq = jnp.repeat(adv_E, per_episode)
        batch = {"advantages": per_seq}
    if penalize:
        stats["kl_penalty_mean"] = extra["kl_penalty"].mean()
        stats["shaped_reward_mean"] = shaped.mean()
    return batch, per_seq, stats


def make_advantage_fn(algo: AlgorithmConfig) -> AdvantageFn:
    """The jitted advantage computation of `algo` (see the module docstring).

    `fn(rewards_PG, loss_mask_BT, old_logprobs_BT, ref_logprobs_BT, old_values_BT)` returns
    `(batch, per_sequence, stats)`: `batch` holds the update-batch entries (`advantages` `[B]` or,
    for GAE, `[B, T]` with `old_values` and `returns`), `per_sequence` one advantage per sequence
    (the token mean for GAE) for trajectory logs, and scalar `stats` (with the KL in the reward:
    `kl_penalty_mean`, the mean penalty subtracted from an episode's reward, and
    `shaped_reward_mean`). `ref_logprobs_BT` may be None without a KL penalty in the reward,
    `old_values_BT` without a critic."""
    return jax.jit(functools.partial(_advantages, algo=algo))


def advantages_for_update(out) -> tuple[dict[str, jax.Array], np.ndarray, dict[str, float]]:
    """`make_advantage_fn`'s outputs as the update takes them: the batch entries stay on the
    device (the update reads them there), the per-sequence advantages `[B]` and the stats come to
    the host for the logs (one small transfer)."""
    batch, (per_seq, stats) = out[0], to_host(out[1:])
    return batch, np.asarray(per_seq), {k: float(v) for k, v in stats.items()}
