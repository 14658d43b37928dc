"""The dense attention of training, scoring and prefill: masks, kernels and causal query blocks.

Letters: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K,
H head_dim.

`DenseAttention` is the model's `Attention` over whole sequences (causal + padding mask, or causal
within each sequence of packed rows), with the kernel chosen by `ModelConfig.attention_impl`
(cuDNN flash attention on CUDA GPUs in bf16/fp16, else XLA, whose scores are computed in causal
query blocks). The rollout engine passes its own paged-KV attention instead
(`tpurl.generate.attention`).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tpurl.models.config import ATTENTION_IMPLS, ModelConfig
from tpurl.models.invariant import window_attention


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

    `window` (bitwise mode, `ModelConfig.attention_window`): each query attends over a window of
    the keys it sees instead (`tpurl.models.invariant.window_attention`), batch-invariantly.
    """

    def __init__(self, valid_BT: jax.Array, implementation: str | None = None, *,
                 key_ends_BT: jax.Array | None = None, query_blocks: int | None = None,
                 window: int | None = None):
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
        self.window = window

    def for_model(self, cfg: ModelConfig) -> DenseAttention:
        """This attention with what it leaves unset taken from `cfg` (`attention_impl` resolved for
        this backend, `attention_query_blocks`); the mask is shared, not recomputed."""
        out = copy.copy(self)
        if out.implementation is None:
            out.implementation = resolve_attention_impl(cfg.attention_impl, cfg.compute_dtype, head_dim=cfg.head_dim)
        if out.query_blocks is None:
            out.query_blocks = cfg.attention_query_blocks
        if out.window is None:
            out.window = cfg.attention_window
        return out

    def __call__(self, q, k, v, cache):
        if self.window is not None:
            return window_attention(q, k, v, self.mask[:, 0], self.window), cache
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
