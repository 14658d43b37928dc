"""The auxiliary losses and metrics of a mixture-of-experts model's routers, in a training forward.

A sparse layer's `RouterStats` (`tpurl.models.moe`: routed choices and router probabilities per
expert, the squared log-partition, over the micro-batch's real tokens) give per layer the
load-balancing loss (Hugging Face's for one layer: K, the experts per token, when balanced) and
the router z-loss (`moe.balance_losses`). The update adds
`MoeConfig.balance_loss_coef` and `z_loss_coef` times their mean over the sparse layers, each
micro-batch weighted by its share of the batch's loss tokens (as every other term of the loss).

Metrics, summed over the micro-batches with the same weights (so they are batch means):
`moe/balance_loss`, `moe/z_loss` (means over layers), per sparse layer (`<i>` its index among all
the model's layers) `moe/l<i>/balance`,
`moe/l<i>/share_max` and `share_min` (the busiest and idlest expert's share of the routed choices;
1 / E each when balanced), with few experts (E <= `SHARES_UP_TO`) every expert's share
`moe/l<i>/e<j>`, and `moe/route_agreement` (the mean fraction of a token's own top-K that the
routes it was given kept: below 1 where a router replay overrode the trainer's own routes).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from tpurl.models.moe import MoeConfig, RouterStats, balance_losses

SHARES_UP_TO = 32  # every expert's share is logged per layer up to this many experts


def router_aux(moe: MoeConfig, stats: RouterStats, share: jax.Array,
               layers: Sequence[int]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss term, metric sums)` of the stacked `stats` of one micro-batch whose loss tokens are
    `share` of the batch's; `layers`: the model layer of each row of `stats`
    (`ModelConfig.layers_of("moe")`), which names the per-layer metrics."""
    k = moe.experts_per_token
    balance_L, z_L = balance_losses(stats, k)
    loss = (moe.balance_loss_coef * jnp.mean(balance_L) + moe.z_loss_coef * jnp.mean(z_L)) * share
    shares_LE = stats.counts_E / (jnp.maximum(stats.tokens, 1.0)[:, None] * k)
    sums = {"moe/balance_loss": jnp.mean(balance_L) * share, "moe/z_loss": jnp.mean(z_L) * share,
            "moe/route_agreement": jnp.mean(stats.agree / jnp.maximum(stats.tokens, 1.0)) * share}
    if len(layers) != balance_L.shape[0]:
        raise ValueError(f"router_aux: {balance_L.shape[0]} sparse layers' statistics but {len(layers)} layer indices")
    for row, i in enumerate(layers):
        sums[f"moe/l{i}/balance"] = balance_L[row] * share
        sums[f"moe/l{i}/share_max"] = jnp.max(shares_LE[row]) * share
        sums[f"moe/l{i}/share_min"] = jnp.min(shares_LE[row]) * share
        if moe.num_experts <= SHARES_UP_TO:
            sums.update({f"moe/l{i}/e{j}": shares_LE[row, j] * share for j in range(moe.num_experts)})
    return loss, sums
