"""Decoder-only transformer (Llama 3 / Qwen2 / Qwen3) in Flax NNX, with scanned layers.

Letters in array names (nanodo style): B batch, T query positions, S key positions, D embed,
F mlp, V vocab, N query heads, K kv heads, H head_dim, L layers.

Parameters are `nnx.Param`s that carry their logical axis names in the `logical_axes` metadata
(see `tpurl.sharding.axes`); the layers' parameters are stacked along a leading `layers` axis and
the forward pass is one `jax.lax.scan` over them, so compile time does not grow with depth.

Attention is pluggable: each layer computes rotated q/k and v and hands them to an `Attention`
callable together with that layer's slice of an optional cache. `DenseAttention` (causal + padding
mask, or causal within each sequence of packed rows; `jax.nn.dot_product_attention`) serves training
and scoring, with the kernel chosen by
`ModelConfig.attention_impl` (cuDNN flash attention on CUDA GPUs in bf16/fp16, else XLA); the
rollout engine passes its paged-KV attention. A `constrain(x, logical_axes)` callable, supplied by
a layout, pins weights and activations to their compute sharding at the point of use (see
`tpurl.sharding.layout`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.models import lora, moe, quant
from tpurl.models.attention import Attention, DenseAttention, dense_attention
from tpurl.models.config import ModelConfig
from tpurl.models.invariant import matmul_rows, rounded, rowwise_pair, runtime_zero
from tpurl.models.ops import dense, lead, rms_norm, swiglu
from tpurl.models.rope import apply_rope, rope_cos_sin

Constrain = Callable[[jax.Array, tuple], jax.Array]

# Logical axes of each stacked layer parameter, without the leading "layers" axis.
LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "input_layernorm": ("norm",),
    "q_proj": ("embed", "heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "q_bias": ("heads", "head_dim"),
    "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    "q_norm": ("norm",),
    "k_norm": ("norm",),
    "o_proj": ("heads", "head_dim", "embed"),
    "post_attention_layernorm": ("norm",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}
LAYER_AXES.update(moe.MOE_AXES)
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")  # a dense layer's MLP, stacked over the dense layers
TOP_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens": ("vocab", "embed"),
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}
ACT_BTD = ("batch", "seq", "embed")


def identity_constrain(x: jax.Array, _axes: tuple) -> jax.Array:
    """The `constrain` of an unsharded run: leaves every array where it is."""
    return x


def _param(rngs: nnx.Rngs, shape, axes, dtype, std: float | None) -> nnx.Param:
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0.0:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    names = ["input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm"]
    if "dense" in cfg.layer_kinds:
        names += MLP_NAMES
    if cfg.attention_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    if "moe" in cfg.layer_kinds:
        names += list(moe.MOE_AXES)
    if cfg.quantization is not None:
        names += [quant.scale_name(n) for n in names if n in quant.INPUT_AXES]
    return tuple(names)


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "q_bias": (n, h), "k_bias": (k, h),
              "v_bias": (k, h), "q_norm": (h,), "k_norm": (h,), **cfg.projection_shapes()}
    if cfg.moe is not None:
        e, f = cfg.moe.num_experts, cfg.moe.intermediate_size
        shapes.update(router=(d, e), experts_gate=(e, d, f), experts_up=(e, d, f), experts_down=(e, f, d))
    return shapes


def stack_kind(name: str) -> str | None:
    """Which layers a layer parameter is stacked over: "dense" (the dense layers' MLP), "moe" (the
    sparse layers'), None (every layer). A quantized weight's scale goes with its weight."""
    name = quant.weight_of(name) or name
    if name in MLP_NAMES:
        return "dense"
    return "moe" if name in moe.MOE_AXES else None


class DecoderLayers(nnx.Module):
    """All layers' parameters, each stacked along a leading `layers` axis (a mixture-of-experts
    model's MLP parameters over the layers of their kind, `stack_kind`); with `cfg.lora`, each
    target's adapter too (`nnx.LoRAParam`s `<target>_lora_a`, `<target>_lora_b`); with
    `cfg.quantization`, the projections and experts in float8 with their scales (`tpurl.models.quant`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        shapes = _layer_shapes(cfg)
        for name in layer_param_names(cfg):
            if quant.weight_of(name):
                continue  # made with its weight
            if name.endswith("norm"):
                std = None
            elif name.endswith("bias"):
                std = 0.0
            else:
                std = cfg.initializer_range
            kind = stack_kind(name)
            count = cfg.num_layers if kind is None else len(cfg.layers_of(kind))
            param = _param(rngs, (count, *shapes[name]), ("layers", *LAYER_AXES[name]), cfg.weight_dtype, std)
            setattr(self, name, param)
            if cfg.quantization is not None and name in quant.INPUT_AXES:
                q, s = quant.quantize(param[...], name)
                param.set_value(q)
                setattr(self, quant.scale_name(name), nnx.Param(s, logical_axes=("layers", *_param_axes(
                    quant.scale_name(name)))))
        if cfg.lora is not None:
            # From the stream's base key, not a draw of it: the base weights stay those of the plain model.
            for name, param in lora.adapter_params(cfg, lora.adapter_key(rngs.params.key[...])).items():
                setattr(self, name, param)

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def _param_axes(name: str) -> tuple[str, ...]:
    """Logical axes of a layer parameter, adapter or scale, without `layers`."""
    if name in LAYER_AXES:
        return LAYER_AXES[name]
    if quant.weight_of(name):
        return quant.drop_inputs(LAYER_AXES[quant.weight_of(name)], quant.weight_of(name), stacked=False)
    target, _, which = name.rpartition("_lora_")
    return lora.adapter_axes(target)[which == "b"]


def _project(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, name: str, drop, n_in: int = 1) -> jax.Array:
    """`x @ p[name]`, plus the adapter's low-rank path where `name` has one, on `drop(x, name)` (x
    with the adapter's own dropout mask in training forwards, else x)."""
    y = dense(x, p[name], n_in, bitwise=cfg.bitwise)
    if cfg.lora is not None and name in cfg.lora.targets:
        a, b = lora.adapter_names(name)
        y = y + lora.low_rank(drop(x, name), p[a], p[b], cfg.lora.scale, name)
    return y


def decoder_layer(cfg: ModelConfig, p: dict[str, jax.Array], x_BTD: jax.Array, cos_BTH, sin_BTH,
                  attention: Attention, cache, constrain: Constrain, drop=None, routes_BTK=None, weights_BT=None,
                  zero=None):
    """One pre-norm decoder layer: `(x, cache, routing)`. `p` holds this layer's (unstacked)
    parameters; `drop(x, target)` (training forwards of a LoRA model with dropout) is a targeted
    projection's adapter input. A sparse layer replays `routes_BTK` when given and returns its
    routes and router statistics over `weights_BT` (`moe.moe_mlp`); a dense layer's routing is None.
    `zero`: bitwise mode's runtime 0 (`invariant.runtime_zero`)."""
    dt = cfg.compute_dtype
    p = _compute_weights({name: constrain(w, _param_axes(name)) for name, w in p.items()}, dt)
    drop = drop or (lambda x, _target: x)
    eps = cfg.rms_norm_eps
    # Bitwise mode: every op's result rounded before the next op reads it (`invariant.rounded`).
    pin = (lambda x: rounded(x, zero)) if cfg.bitwise else (lambda x: x)  # noqa: E731
    h = pin(rms_norm(x_BTD, p["input_layernorm"], eps, bitwise=cfg.bitwise))
    q, k, v = (pin(_project(cfg, p, h, name, drop)) for name in ("q_proj", "k_proj", "v_proj"))
    if cfg.attention_bias:
        q, k, v = q + lead(p["q_bias"], 4), k + lead(p["k_bias"], 4), v + lead(p["v_bias"], 4)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], eps, bitwise=cfg.bitwise), rms_norm(k, p["k_norm"], eps, bitwise=cfg.bitwise)
    q, k = (pin(apply_rope(x, cos_BTH, sin_BTH, zero=zero)) for x in (q, k))
    attn_BTNH, cache = attention(q, k, v, cache)
    x_BTD = pin(x_BTD + pin(_project(cfg, p, pin(attn_BTNH.astype(dt)), "o_proj", drop, n_in=2)))
    x_BTD = constrain(x_BTD, ACT_BTD)
    h = pin(rms_norm(x_BTD, p["post_attention_layernorm"], eps, bitwise=cfg.bitwise))
    routing = None
    if "router" in p:  # a sparse layer: its experts
        out, experts, stats = moe.moe_mlp(h, p, cfg.moe, routes_BTK, weights_BT)
        x_BTD, routing = x_BTD + out, (experts, stats)
    else:
        gate, up = pin(_project(cfg, p, h, "gate_proj", drop)), pin(_project(cfg, p, h, "up_proj", drop))
        act = pin(rowwise_pair(swiglu, gate, up)) if cfg.bitwise else swiglu(gate, up)
        x_BTD = pin(x_BTD + pin(_project(cfg, p, act, "down_proj", drop)))
    return constrain(x_BTD, ACT_BTD), cache, routing


def _compute_weights(p: dict[str, jax.Array], dt) -> dict[str, jax.Array]:
    """A layer's parameters in the compute dtype; quantized weights dequantized with their scales
    (which then drop out)."""
    out = {}
    for name, w in p.items():
        if quant.weight_of(name):
            continue
        scale = p.get(quant.scale_name(name))
        out[name] = w.astype(dt) if scale is None else quant.dequantize(w, scale, name, dt, stacked=False)
    return out


def _stacked_routing(routings: list) -> moe.Routing | None:
    """The sparse layers' `(experts, stats)` of every segment as one `moe.Routing` (None: dense)."""
    if not routings:
        return None
    experts, stats = (jax.tree.map(lambda *x: jnp.concatenate(x), *parts) for parts in zip(*routings))
    return moe.Routing(experts=experts, stats=stats)


def _segment_params(stacked: dict[str, jax.Array], kind: str, first: int, end: int, row: int) -> dict[str, jax.Array]:
    """The parameters of layers `first:end`, all of `kind`: every layer's rows `first:end`, and the
    kind's own MLP rows from `row` (its stack counts only the layers of that kind)."""
    out = {}
    for name, w in stacked.items():
        own = stack_kind(name)
        if own is None:
            out[name] = w[first:end]
        elif own == kind:
            out[name] = w[row:row + end - first]
    return out


def _dropout(key: jax.Array, rate: float, x: jax.Array, target: str) -> jax.Array:
    """Inverted dropout of `x` at `rate` for `target`'s adapter: its own mask (as PEFT draws one per
    module), from `key` folded with the target's index."""
    keep = jax.random.bernoulli(jax.random.fold_in(key, list(lora.PROJECTIONS).index(target)), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    """Llama 3 / Qwen2 / Qwen3 decoder. Parameter names follow Hugging Face's (see models/hf.py)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        wdt = cfg.weight_dtype
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), TOP_AXES["embed_tokens"], wdt,
                                   cfg.initializer_range)
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.norm = _param(rngs, (cfg.hidden_size,), TOP_AXES["norm"], wdt, None)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), TOP_AXES["lm_head"], wdt,
                                  cfg.initializer_range)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array, *, attention: Attention,
                 cache: Any = None, constrain: Constrain | None = None, unroll: int = 1,
                 dropout_key: jax.Array | None = None, routes: jax.Array | None = None,
                 router_weights: jax.Array | None = None, with_routing: bool = False):
        """Final hidden states `[B, T, D]` (after the last norm) and the updated per-layer cache.

        `cache` is a pytree whose leaves have a leading `layers` axis (or None); each layer sees
        its own slice. Logits come from `self.logits(hidden)` so that callers that only need a
        few log-probabilities can avoid materializing `[B, T, V]` (see train/logprobs.py).
        `unroll`: layers per scan iteration (full-sequence forwards pass `ModelConfig.unroll_layers`).
        `dropout_key`: a training forward's key for the adapters' dropout (`LoraConfig.dropout`);
        None (scoring, rollout) drops nothing.
        A mixture-of-experts model: `routes [Ls, B, T, K]` replays given experts per sparse layer;
        `router_weights [B, T]` (0 on padding) asks for the routers' statistics; `with_routing`
        returns `(hidden, cache, routing)`, routing a `moe.Routing` (None for a dense model).
        """
        cfg = self.config
        constrain = constrain or identity_constrain
        if isinstance(attention, DenseAttention):
            attention = attention.for_model(cfg)
        emb_VD = constrain(self.embed_tokens[...], TOP_AXES["embed_tokens"])
        x_BTD = constrain(jnp.take(emb_VD, tokens_BT, axis=0).astype(cfg.compute_dtype), ACT_BTD)
        cos, sin = rope_cos_sin(positions_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.attention_window)
        zero = runtime_zero(tokens_BT) if cfg.bitwise else None

        dropping = dropout_key is not None and cfg.lora is not None and cfg.lora.dropout > 0
        keys = jax.random.split(dropout_key, cfg.num_layers) if dropping else None

        def body(x, layer):
            p, c, key, r = layer
            drop = None if key is None else functools.partial(_dropout, key, cfg.lora.dropout)
            x, c, routing = decoder_layer(cfg, p, x, cos, sin, attention, c, constrain, drop, r, router_weights, zero)
            return x, (c, routing)

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
        stacked, caches, routings = self.layers.stacked(), [], []
        for kind, first, end, row in moe.segments(cfg.layer_kinds):
            seg_routes = None if routes is None or kind != "moe" else routes[row:row + end - first]
            xs = (stacked, cache, keys, seg_routes)
            if (first, end) != (0, cfg.num_layers):  # layers of mixed kinds: one scan per run of a kind
                xs = (_segment_params(stacked, kind, first, end, row),
                      *(jax.tree.map(lambda x: x[first:end], t) for t in (cache, keys)), seg_routes)
            x_BTD, (out, routing) = jax.lax.scan(body, x_BTD, xs, unroll=min(unroll, end - first))
            caches.append(out)
            if routing is not None:
                routings.append(routing)
        cache = caches[0] if len(caches) == 1 else jax.tree.map(lambda *c: jnp.concatenate(c), *caches)
        # Bitwise mode: the final norm's weight in the compute dtype, as the layers' are (`_compute_weights`),
        # so rollout weights cast to it by the sync compute what the trainer's masters do.
        norm = self.norm[...].astype(cfg.compute_dtype) if cfg.bitwise else self.norm[...]
        hidden = rms_norm(x_BTD, norm, cfg.rms_norm_eps, bitwise=cfg.bitwise)
        if not with_routing:
            return hidden, cache
        return hidden, cache, _stacked_routing(routings)

    def unembedding(self, constrain: Constrain | None = None) -> jax.Array:
        """The output projection `[D, V]` in compute dtype (the transposed embedding when tied)."""
        constrain = constrain or identity_constrain
        if self.config.tie_word_embeddings:
            w_DV = constrain(self.embed_tokens[...], TOP_AXES["embed_tokens"]).T
        else:
            w_DV = constrain(self.lm_head[...], TOP_AXES["lm_head"])
        return w_DV.astype(self.config.compute_dtype)

    def logits(self, hidden_BTD: jax.Array, constrain: Constrain | None = None) -> jax.Array:
        """Float32 logits `[B, T, V]`."""
        if self.config.bitwise:
            b, t, d = hidden_BTD.shape
            w_DV = self.unembedding(constrain)
            return matmul_rows(hidden_BTD.reshape(b * t, d), w_DV, jnp.float32).reshape(b, t, -1)
        return jnp.einsum("BTD,DV->BTV", hidden_BTD, self.unembedding(constrain),
                          preferred_element_type=jnp.float32)


def forward_logits(model: Transformer, tokens_BT: jax.Array, valid_BT: jax.Array | None = None,
                   positions_BT: jax.Array | None = None, constrain: Constrain | None = None) -> jax.Array:
    """Logits of a padded batch (no cache). Positions default to the count of real tokens before
    each token, which is right for both left and right padding."""
    if valid_BT is None:
        valid_BT = jnp.ones(tokens_BT.shape, dtype=bool)
    if positions_BT is None:
        positions_BT = positions_from_mask(valid_BT)
    hidden, _ = model(tokens_BT, positions_BT, attention=dense_attention(model.config, valid_BT),
                      constrain=constrain, unroll=model.config.unroll_layers)
    return model.logits(hidden, constrain)


def positions_from_mask(valid_BT: jax.Array) -> jax.Array:
    """Position of each token = number of real tokens before it (0 for leading padding)."""
    return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with `ShapeDtypeStruct` leaves (no memory), for computing shardings."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
