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

import copy
import math
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.models.config import ATTENTION_IMPLS, ModelConfig
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
TOP_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens": ("vocab", "embed"),
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}
ACT_BTD = ("batch", "seq", "embed")


def identity_constrain(x: jax.Array, _axes: tuple) -> jax.Array:
    """The `constrain` of an unsharded run: leaves every array where it is."""
    return x


class Attention(Protocol):
    """`(q_BTNH, k_BTKH, v_BTKH, cache_layer) -> (out_BTNH, new_cache_layer)`; q and k are rotated."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any) -> tuple[jax.Array, Any]: ...


def causal_padding_mask(valid_BT: jax.Array) -> jax.Array:
    """Boolean mask `[B, 1, T, T]`: query i sees key j iff j <= i and key j is a real token.

    Works for left and right padding alike (order is by index; positions are passed separately).
    A padded query row may see nothing; its output is finite and must be ignored by the caller.
    """
    t = valid_BT.shape[1]
    causal_TT = jnp.tril(jnp.ones((t, t), dtype=bool))
    return (causal_TT[None, :, :] & valid_BT[:, None, :].astype(bool))[:, None]


def key_ends_mask(ends_BT: jax.Array) -> jax.Array:
    """Boolean mask `[B, 1, T, T]` of packed rows: query i sees key j iff j <= i < ends[j].

    `ends[j]` is one past the last column that may see token j (0 on padding, which sees and is
    seen by nothing). With one sequence per segment, that is the segment's end: causal attention
    within each segment. With a prefix tree laid out depth first (sequences sharing a prompt,
    `tpurl.train.packing`), it is the end of j's subtree: every sequence through j sees it.
    """
    ends = jnp.asarray(ends_BT, jnp.int32)
    t = ends.shape[1]
    col = jnp.arange(t, dtype=jnp.int32)
    causal_TT = col[None, :] <= col[:, None]
    seen_BTT = col[None, :, None] < ends[:, None, :]
    return (causal_TT[None, :, :] & seen_BTT)[:, None]


_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _default_backend() -> str:
    """"cuda", "rocm", "cpu", "tpu", ...: `jax.default_backend()` with CUDA and ROCm told apart
    (both report "gpu", and only CUDA has cuDNN)."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def resolve_attention_impl(impl: str, dtype, *, head_dim: int | None = None, backend: str | None = None) -> str:
    """The `jax.nn.dot_product_attention` implementation for `ModelConfig.attention_impl`.

    "xla" and "cudnn" are returned as they are. "auto" is "cudnn" on a CUDA GPU when the compute
    dtype is bf16/fp16 (cuDNN's fused attention has no fp32 kernel) and `head_dim` is a multiple of
    8 up to 128 (what every supported GPU generation accepts), else "xla". `backend` defaults to
    the running one ("gpu"/"cuda" count as CUDA; "rocm" has no cuDNN).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {impl!r} is unknown; use one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    backend = _default_backend() if backend is None else backend
    head_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= 128)
    if backend in ("gpu", "cuda") and jnp.dtype(dtype) in _HALF_DTYPES and head_ok:
        return "cudnn"
    return "xla"


class DenseAttention:
    """Full-sequence attention with a causal + padding mask; ignores (and returns) the cache.

    `implementation` is "xla", "cudnn" or None; None lets the model choose from its config
    (`ModelConfig.attention_impl`, see `Transformer.__call__`). cuDNN gets the same boolean mask
    (it turns it into an additive bias) plus `is_causal=True`, so that it can skip the blocks above
    the diagonal; the mask, not `query_seq_lengths`, carries the padding because cuDNN's sequence
    lengths assume right padding and rollouts are left-padded. cuDNN's backward pass with a bias
    needs an even sequence length, so an odd one falls back to XLA (shapes are static: this is
    decided at trace time).

    `key_ends_BT` (optional) makes it the attention of packed rows (`tpurl.train.packing`):
    several sequences per row, each attending causally within itself and to the prefix it shares
    (`key_ends_mask`). Both masks are causal, so the XLA path computes the scores in
    `query_blocks` causal query blocks (`causal_blocked_attention`); None takes the model's
    `ModelConfig.attention_query_blocks`.
    """

    def __init__(self, valid_BT: jax.Array, implementation: str | None = None, *,
                 key_ends_BT: jax.Array | None = None, query_blocks: int | None = None):
        if implementation not in (None, "xla", "cudnn"):
            raise ValueError(f"DenseAttention implementation={implementation!r}; use 'xla', 'cudnn' or None")
        if query_blocks is not None and query_blocks < 1:
            raise ValueError(f"DenseAttention query_blocks={query_blocks} must be >= 1 or None (the model's)")
        self.valid_BT = valid_BT
        self.mask = causal_padding_mask(valid_BT) if key_ends_BT is None else key_ends_mask(key_ends_BT)
        # The XLA path adds the mask as a bias, built here once for all layers (the scan closes over it).
        self.bias = mask_bias(self.mask)
        self.implementation = implementation
        self.query_blocks = query_blocks

    def for_model(self, cfg: ModelConfig) -> DenseAttention:
        """This attention with what it leaves unset taken from `cfg` (`attention_impl` resolved for
        this backend, `attention_query_blocks`); the mask is shared, not recomputed."""
        out = copy.copy(self)
        if out.implementation is None:
            out.implementation = resolve_attention_impl(cfg.attention_impl, cfg.compute_dtype, head_dim=cfg.head_dim)
        if out.query_blocks is None:
            out.query_blocks = cfg.attention_query_blocks
        return out

    def __call__(self, q, k, v, cache):
        if self.implementation == "cudnn" and q.shape[1] % 2 == 0:
            out = jax.nn.dot_product_attention(q, k, v, mask=self.mask, is_causal=True, implementation="cudnn")
        else:
            # No query_blocks (not called through a model's `for_model`): one product.
            out = causal_blocked_attention(q, k, v, self.bias, self.query_blocks or 1)
        return out, cache


_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def mask_bias(mask_B1TS: jax.Array) -> jax.Array:
    """The additive float32 form of a boolean attention mask: 0 where a key is seen, a large
    finite negative where not (finite: a query that sees nothing gets a uniform, finite row)."""
    return jnp.where(mask_B1TS, 0.0, _MASKED).astype(jnp.float32)


def grouped_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, bias_B1TS: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(H) + bias) v with grouped kv heads (G = N / K query heads per kv head).

    Equal to `jax.nn.dot_product_attention(..., mask, implementation="xla")` wherever a query sees
    at least one key (a query that sees none gets the mean of v either way, but here its cotangent
    reaches q and k; the model never reads such outputs: they sit on padding). The heads are moved
    in front once (`[B, K, G*T, H]`, `[B, K, S, H]`), so both products are plain batched matmuls over
    contiguous operands and the softmax runs along the last axis: on XLA:CPU this avoids the
    transposed copies that the BTNH einsums cost around every product, forward and backward. The
    mask is an additive bias shared by all layers (no per-layer select), and the 1/sqrt(H) scale
    is applied to q (T x H values) instead of the logits (T x S).
    """
    b, t, n, h = q_BTNH.shape
    s, kv = k_BSKH.shape[1], k_BSKH.shape[2]
    g = n // kv
    # Scaled in float32, rounded once (as the decode engine does): a bf16 scale would round twice.
    scale_dtype = jnp.promote_types(q_BTNH.dtype, jnp.float32)
    q_BKMH = (q_BTNH.astype(scale_dtype) * h ** -0.5).astype(q_BTNH.dtype).reshape(b, t, kv, g, h)
    q_BKMH = q_BKMH.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    logits_dtype = jnp.promote_types(q_BTNH.dtype, jnp.float32)  # bf16 compute: float32 logits and softmax
    logits_BKGTS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BKSH,
                              preferred_element_type=logits_dtype).reshape(b, kv, g, t, s)
    bias_B11TS = bias_B1TS[:, :, None].astype(logits_dtype)
    probs_BKMS = jax.nn.softmax(logits_BKGTS + bias_B11TS, axis=-1).reshape(b, kv, g * t, s)
    out_BKMH = jnp.einsum("BKMS,BKSH->BKMH", probs_BKMS.astype(v_BSKH.dtype), v_BKSH)
    return out_BKMH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


# Blocks of `causal_blocked_attention` are at most `t // MIN_QUERY_BLOCK` (fewer, wider blocks).
MIN_QUERY_BLOCK = 32


def query_block_cuts(t: int, blocks: int) -> list[int]:
    """Boundaries of the query blocks of `causal_blocked_attention` over `t` queries: `blocks` nearly
    equal blocks (at most `t // MIN_QUERY_BLOCK`, at least one), the inner cuts on multiples of 8
    (of 128 once blocks are 256 wide: whole tiles of an accelerator's lanes)."""
    n = max(1, min(blocks, t // MIN_QUERY_BLOCK))
    unit = 128 if t // n >= 256 else 8
    return [0] + [unit * round(i * t / n / unit) for i in range(1, n)] + [t]


def causal_blocked_fraction(t: int, s: int, blocks: int) -> float:
    """The fraction of the full `[t, s]` scores that `causal_blocked_attention` computes."""
    cuts = query_block_cuts(t, blocks)
    return sum((b - a) * (b + s - t) for a, b in zip(cuts, cuts[1:])) / (t * s)


def causal_blocked_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, bias_B1TS: jax.Array,
                             blocks: int) -> jax.Array:
    """`grouped_attention` under a causal mask, its queries in `blocks` blocks (`query_block_cuts`),
    each against only the keys up to its last query: the products skip the key blocks above the
    diagonal. Queries are the last T of the S keys' positions (query i sits at key S - T + i); the
    mask must hide every later key, as causal masks do. Each block is its own pair of products and
    softmax, independent of the others (on XLA:CPU, which runs a batched product on one thread,
    they run concurrently). A query that sees no key at all (padding) gets the mean of v over its
    block's keys instead of all keys; the model never reads such outputs."""
    t, s = q_BTNH.shape[1], k_BSKH.shape[1]
    cuts = query_block_cuts(t, blocks)
    if len(cuts) == 2:
        return grouped_attention(q_BTNH, k_BSKH, v_BSKH, bias_B1TS)
    outs = [grouped_attention(q_BTNH[:, a:b], k_BSKH[:, :b + s - t], v_BSKH[:, :b + s - t],
                              bias_B1TS[:, :, a:b, :b + s - t]) for a, b in zip(cuts, cuts[1:])]
    return jnp.concatenate(outs, axis=1)


def dense_attention(cfg: ModelConfig, valid_BT: jax.Array) -> DenseAttention:
    """`DenseAttention` with `cfg`'s choices (`DenseAttention.for_model`: the implementation
    `cfg.attention_impl` resolves to here, `cfg.attention_query_blocks`)."""
    return DenseAttention(valid_BT).for_model(cfg)


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contract the last `n_in` axes of `x` with the first `n_in` axes of `w`, as one rank-2 matmul.

    `dense(x_BTD, w_DNH)` is `einsum("BTD,DNH->BTNH")` computed as `[B*T, D] @ [D, N*H]`. The
    reshapes are free (row-major merges), and on XLA:CPU the backward pass of the rank-3 einsum
    lays the activation gradients out transposed (copies; docs/performance.md); the rank-2 form
    has none.
    """
    lead, ins, outs = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if x.shape[x.ndim - n_in:] != ins:
        raise ValueError(f"dense: input axes {x.shape[x.ndim - n_in:]} do not match the weight's {ins}")
    k = math.prod(ins)
    return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *outs)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, the MLP's activation, with a one-pass backward.

    Autodiff of `silu(g) * u` spreads the backward over several elementwise kernels (the product
    rule inside silu gives two terms that are added afterwards); written out, both cotangents come
    from one read of (g, u, dh): du = dh * g * s, dg = dh * u * s * (1 + g * (1 - s)), s = sigmoid(g).
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
    gate, up = res
    s = jax.nn.sigmoid(gate)
    dh_s = dh * s
    return dh_s * up * (1 + gate * (1 - s)), dh_s * gate


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 (as Hugging Face does), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (_lead(weight.astype(jnp.float32), y.ndim) * y).astype(x.dtype)


def _lead(w: jax.Array, ndim: int) -> jax.Array:
    """`w` with leading unit dims up to rank `ndim` (explicit broadcasting; tests raise on rank promotion)."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def _param(rngs: nnx.Rngs, shape, axes, dtype, std: float | None) -> nnx.Param:
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0.0:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    names = ["input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm",
             "gate_proj", "up_proj", "down_proj"]
    if cfg.attention_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    return tuple(names)


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "input_layernorm": (d,), "post_attention_layernorm": (d,),
        "q_proj": (d, n, h), "k_proj": (d, k, h), "v_proj": (d, k, h), "o_proj": (n, h, d),
        "q_bias": (n, h), "k_bias": (k, h), "v_bias": (k, h), "q_norm": (h,), "k_norm": (h,),
        "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
    }


class DecoderLayers(nnx.Module):
    """All layers' parameters, each stacked along a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        shapes = _layer_shapes(cfg)
        for name in layer_param_names(cfg):
            if name.endswith("norm"):
                std = None
            elif name.endswith("bias"):
                std = 0.0
            else:
                std = cfg.initializer_range
            setattr(self, name, _param(rngs, (cfg.num_layers, *shapes[name]), ("layers", *LAYER_AXES[name]),
                                       cfg.weight_dtype, std))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def decoder_layer(cfg: ModelConfig, p: dict[str, jax.Array], x_BTD: jax.Array, cos_BTH, sin_BTH,
                  attention: Attention, cache, constrain: Constrain):
    """One pre-norm decoder layer. `p` holds this layer's (unstacked) parameters."""
    dt = cfg.compute_dtype
    p = {name: constrain(w, LAYER_AXES[name]).astype(dt) for name, w in p.items()}
    eps = cfg.rms_norm_eps
    h = rms_norm(x_BTD, p["input_layernorm"], eps)
    q, k, v = dense(h, p["q_proj"]), dense(h, p["k_proj"]), dense(h, p["v_proj"])
    if cfg.attention_bias:
        q, k, v = q + _lead(p["q_bias"], 4), k + _lead(p["k_bias"], 4), v + _lead(p["v_bias"], 4)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    q, k = apply_rope(q, cos_BTH, sin_BTH), apply_rope(k, cos_BTH, sin_BTH)
    attn_BTNH, cache = attention(q, k, v, cache)
    x_BTD = x_BTD + dense(attn_BTNH.astype(dt), p["o_proj"], n_in=2)
    x_BTD = constrain(x_BTD, ACT_BTD)
    h = rms_norm(x_BTD, p["post_attention_layernorm"], eps)
    gate, up = dense(h, p["gate_proj"]), dense(h, p["up_proj"])
    x_BTD = x_BTD + dense(swiglu(gate, up), p["down_proj"])
    return constrain(x_BTD, ACT_BTD), cache


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
                 cache: Any = None, constrain: Constrain | None = None, unroll: int = 1) -> tuple[jax.Array, Any]:
        """Final hidden states `[B, T, D]` (after the last norm) and the updated per-layer cache.

        `cache` is a pytree whose leaves have a leading `layers` axis (or None); each layer sees
        its own slice. Logits come from `self.logits(hidden)` so that callers that only need a
        few log-probabilities can avoid materializing `[B, T, V]` (see train/logprobs.py).
        `unroll`: layers per scan iteration (full-sequence forwards pass `ModelConfig.unroll_layers`).
        """
        cfg = self.config
        constrain = constrain or identity_constrain
        if isinstance(attention, DenseAttention):
            attention = attention.for_model(cfg)
        emb_VD = constrain(self.embed_tokens[...], TOP_AXES["embed_tokens"])
        x_BTD = constrain(jnp.take(emb_VD, tokens_BT, axis=0).astype(cfg.compute_dtype), ACT_BTD)
        cos, sin = rope_cos_sin(positions_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

        def body(x, layer):
            p, c = layer
            return decoder_layer(cfg, p, x, cos, sin, attention, c, constrain)

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
        x_BTD, cache = jax.lax.scan(body, x_BTD, (self.layers.stacked(), cache),
                                    unroll=min(unroll, cfg.num_layers))
        return rms_norm(x_BTD, self.norm[...], cfg.rms_norm_eps), cache

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
