"""Mixture-of-experts MLP layers (Qwen3-MoE): configuration, routing and the dropless expert
computation.

Letters: T tokens (every position of the batch, flattened), D embed, E experts, F an expert's
MLP width, K experts per token.

A sparse layer replaces the SwiGLU MLP by E experts (each a SwiGLU MLP of width F) and a router
`W_r[D, E]`. Each token goes to the K experts of highest router probability (softmax over all E,
in float32, then top-K; `norm_topk_prob` renormalizes the K probabilities to sum to 1), and its
output is the probability-weighted sum of those experts' outputs: Qwen3-MoE's rule.

Dropless: every token reaches every expert it chose (no capacity factor). The T x K (token,
expert) pairs are sorted by expert and each expert's contiguous group runs through its weights in
one grouped matmul (`jax.lax.ragged_dot`, group sizes counted from the routes); the outputs are
unsorted and summed per token. `dense_experts` computes every expert on every token and masks:
the reference the grouped computation is tested against.

Which layers are sparse: layer i is when `i` is not in `dense_layers` and `(i + 1) %
sparse_step == 0` (Hugging Face's `decoder_sparse_step` and `mlp_only_layers`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tpurl.config_types import check_types
from tpurl.models.ops import swiglu

# Logical axes of a sparse layer's parameters (without the leading `layers` axis).
MOE_AXES: dict[str, tuple[str | None, ...]] = {
    "router": ("embed", None),
    "experts_gate": ("experts", "embed", "expert_mlp"),
    "experts_up": ("experts", "embed", "expert_mlp"),
    "experts_down": ("experts", "expert_mlp", "embed"),
}
# The experts' own weights (stacked over the experts: what a token reads only for its K experts).
EXPERT_NAMES = tuple(name for name, axes in MOE_AXES.items() if axes[0] == "experts")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """The sparse MLP layers of a mixture-of-experts model (see the module docstring).

    `num_experts` E, `experts_per_token` K, `intermediate_size` F (each expert's MLP width);
    `norm_topk_prob`: the K routing weights of a token sum to 1; `sparse_step` and `dense_layers`
    decide which layers are sparse. Training options: `balance_loss_coef` and `z_loss_coef` weigh
    the load-balancing loss (per layer on Hugging Face's scale, K when balanced: a checkpoint's
    `router_aux_loss_coef` is a sensible value) and the router z-loss (`balance_losses`, mean over
    sparse layers) in the update and the warm start; `router_replay`: the rollout records each
    token's experts per sparse layer and the trainer's passes route the same tokens to the same
    experts.
    """

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool = True
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    balance_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    router_replay: bool = False

    def __post_init__(self):
        check_types(self)
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(f"MoeConfig: need num_experts >= 1 and intermediate_size >= 1, got {self.num_experts}, "
                             f"{self.intermediate_size}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"MoeConfig.experts_per_token={self.experts_per_token} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.sparse_step < 1:
            raise ValueError(f"MoeConfig.sparse_step={self.sparse_step} must be >= 1 (1: every layer sparse)")
        if any(i < 0 for i in self.dense_layers):
            raise ValueError(f"MoeConfig.dense_layers={self.dense_layers} holds a negative layer index")
        for name in ("balance_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoeConfig.{name}={getattr(self, name)} must be >= 0 (0: off)")

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` is a sparse (experts) layer."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """What a forward's sparse layers did, stacked over them: `experts [Ls, B, T, K]` each token's
    experts, `stats` their `RouterStats` (when the forward was given token weights, else None)."""

    experts: jax.Array
    stats: RouterStats | None = None


def layer_kinds(num_layers: int, moe: MoeConfig | None) -> tuple[str, ...]:
    """Each layer's MLP: "dense" or "moe"."""
    return tuple("moe" if moe is not None and moe.sparse(i) else "dense" for i in range(num_layers))


def segments(kinds: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """The runs of consecutive layers of one kind: `(kind, first layer, end layer, first index in
    that kind's stack)`; the layer scan runs once per segment."""
    out, seen = [], {"dense": 0, "moe": 0}
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            kind = kinds[start]
            out.append((kind, start, i, seen[kind]))
            seen[kind] += i - start
            start = i
    return out


def route(h_TD: jax.Array, w_router_DE: jax.Array, k: int, norm_topk: bool
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(weights_TK, experts_TK, logits_TE)`: each token's K experts (highest router probability
    first), their routing weights (in h's dtype) and the router's float32 logits."""
    logits_TE = jnp.dot(h_TD, w_router_DE.astype(h_TD.dtype), preferred_element_type=jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    top_TK, experts_TK = jax.lax.top_k(probs_TE, k)
    return _weights(top_TK, norm_topk).astype(h_TD.dtype), experts_TK.astype(jnp.int32), logits_TE


def replayed(logits_TE: jax.Array, experts_TK: jax.Array, norm_topk: bool, dtype) -> jax.Array:
    """The routing weights of given routes (a router replay): the router's probabilities at
    `experts_TK`, renormalized as `route` does."""
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    return _weights(jnp.take_along_axis(probs_TE, experts_TK, axis=-1), norm_topk).astype(dtype)


def _weights(top_TK: jax.Array, norm_topk: bool) -> jax.Array:
    return top_TK / jnp.sum(top_TK, axis=-1, keepdims=True) if norm_topk else top_TK


def grouped_experts(h_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array, w_gate_EDF: jax.Array,
                    w_up_EDF: jax.Array, w_down_EFD: jax.Array) -> jax.Array:
    """Each token's weighted sum of its experts' SwiGLU outputs `[T, D]`, dropless (see the module
    docstring): the T x K pairs sorted by expert, three grouped matmuls, unsorted and summed."""
    t, k = experts_TK.shape
    e = w_gate_EDF.shape[0]
    flat_N = experts_TK.reshape(-1)
    order_N = jnp.argsort(flat_N, stable=True)
    x_ND = jnp.take(h_TD, order_N // k, axis=0)
    sizes_E = jnp.bincount(flat_N, length=e).astype(jnp.int32)
    gate = jax.lax.ragged_dot(x_ND, w_gate_EDF, sizes_E)
    up = jax.lax.ragged_dot(x_ND, w_up_EDF, sizes_E)
    y_ND = jax.lax.ragged_dot(swiglu(gate, up), w_down_EFD, sizes_E)
    y_ND = y_ND * jnp.take(weights_TK.reshape(-1), order_N)[:, None]
    y_TKD = jnp.take(y_ND, jnp.argsort(order_N), axis=0).reshape(t, k, -1)
    return jnp.sum(y_TKD, axis=1)


def dense_experts(h_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array, w_gate_EDF: jax.Array,
                  w_up_EDF: jax.Array, w_down_EFD: jax.Array) -> jax.Array:
    """The same as `grouped_experts`, computed as every expert on every token, masked: E times the
    FLOPs; the reference the grouped computation is tested against."""
    e = w_gate_EDF.shape[0]
    gate = jnp.einsum("TD,EDF->ETF", h_TD, w_gate_EDF)
    up = jnp.einsum("TD,EDF->ETF", h_TD, w_up_EDF)
    y_ETD = jnp.einsum("ETF,EFD->ETD", swiglu(gate, up), w_down_EFD)
    mask_TKE = jax.nn.one_hot(experts_TK, e, dtype=weights_TK.dtype)
    combine_TE = jnp.einsum("TK,TKE->TE", weights_TK, mask_TKE)
    return jnp.einsum("TE,ETD->TD", combine_TE, y_ETD)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """One sparse layer's router over weighted tokens (weights 0 on padding): `counts_E` the routed
    (token, choice) pairs per expert, `probs_E` the router probabilities summed per expert, `z` the
    summed squared log-partition `logsumexp(logits)^2`, `tokens` the summed weights, `agree` the
    summed fraction of a token's own top-K that the replayed routes kept (1 without replay)."""

    counts_E: jax.Array
    probs_E: jax.Array
    z: jax.Array
    tokens: jax.Array
    agree: jax.Array


def router_stats(logits_TE: jax.Array, experts_TK: jax.Array, own_TK: jax.Array, w_T: jax.Array) -> RouterStats:
    """`RouterStats` of routes `experts_TK` (the router's own top-K: `own_TK`) over weights `w_T`."""
    e, k = logits_TE.shape[-1], experts_TK.shape[-1]
    w_T = w_T.astype(jnp.float32)
    counts = jnp.einsum("T,TKE->E", w_T, jax.nn.one_hot(experts_TK, e, dtype=jnp.float32))
    probs = jnp.einsum("T,TE->E", w_T, jax.nn.softmax(logits_TE, axis=-1))
    lse_T = jax.nn.logsumexp(logits_TE, axis=-1)
    kept_T = jnp.sum(jnp.any(own_TK[:, :, None] == experts_TK[:, None, :], axis=-1), axis=-1) / k
    return RouterStats(counts_E=counts, probs_E=probs, z=jnp.sum(w_T * lse_T ** 2), tokens=jnp.sum(w_T),
                       agree=jnp.sum(w_T * kept_T))


def balance_losses(stats: RouterStats, k: int) -> tuple[jax.Array, jax.Array]:
    """Per layer `(load-balancing loss, router z-loss)` of stacked `RouterStats` (leading layer
    axis): `E * sum_e f_e P_e` with f_e the fraction of tokens routed to expert e (the K choices of
    a token summing to K) and P_e its mean router probability, as Hugging Face's
    `load_balancing_loss_func` computes it for one layer (K when perfectly balanced), and the mean
    squared log-partition (ST-MoE's z-loss)."""
    n = jnp.maximum(stats.tokens, 1.0)[..., None]
    e = stats.counts_E.shape[-1]
    balance = e * jnp.sum((stats.counts_E / n) * (stats.probs_E / n), axis=-1)
    return balance, stats.z / n[..., 0]


def moe_mlp(h_BTD: jax.Array, p: dict[str, jax.Array], moe: MoeConfig, experts_BTK: jax.Array | None = None,
            weights_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """A sparse layer's MLP on `h[B, T, D]` with its parameters `p` (`MOE_AXES`): `(out_BTD,
    experts_BTK, stats)`. `experts_BTK` (optional) replays given routes instead of the router's
    top-K (their weights still come from this router; -1 rows keep the router's own); `weights_BT`
    (optional) asks for the router's statistics over those token weights (`RouterStats`, else
    None)."""
    b, t, d = h_BTD.shape
    h_TD = h_BTD.reshape(b * t, d)
    weights, own, logits = route(h_TD, p["router"], moe.experts_per_token, moe.norm_topk_prob)
    experts = own
    if experts_BTK is not None:  # a token whose given routes are -1 (none recorded) keeps its own
        given = experts_BTK.reshape(b * t, -1).astype(jnp.int32)
        experts = jnp.where(given >= 0, given, own)
        weights = replayed(logits, experts, moe.norm_topk_prob, h_TD.dtype)
    out = grouped_experts(h_TD, weights, experts, p["experts_gate"], p["experts_up"], p["experts_down"])
    stats = None if weights_BT is None else router_stats(logits, experts, own, weights_BT.reshape(-1))
    return out.reshape(b, t, d), experts.reshape(b, t, -1), stats


def token_routes(routing: Routing) -> jax.Array:
    """A forward's experts per sparse layer `[Ls, B, T, K]` as per-row routes `[B, T, Ls, K]` (what
    the engine records for a router replay)."""
    return jnp.transpose(routing.experts, (1, 2, 0, 3))


def routing_args(moe: MoeConfig | None, routes_XTLK, weights_XT) -> dict:
    """The router arguments of a model forward over rows `[X, T]` (`Transformer.__call__`):
    replayed routes (`routes_XTLK`, each token's experts per sparse layer, -1: its own; as the
    model takes them, `[L, X, T, K]`), the real tokens' weights for the routers' statistics, and
    `with_routing`. A model without sparse layers (`moe` None) ignores them."""
    routes = None if routes_XTLK is None else jnp.transpose(jnp.asarray(routes_XTLK, jnp.int32), (2, 0, 1, 3))
    weights = jnp.asarray(weights_XT, jnp.float32) if moe is not None else None
    return {"routes": routes, "router_weights": weights, "with_routing": True}
