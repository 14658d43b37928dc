"""Attention over a paged KV cache: a pure-jnp reference and the Pallas kernels that ship with JAX.

Letters: B sequences (decode slots), N query heads, K kv heads, G = N / K query heads per kv head,
H head_dim, P pages in the pool, S page size (tokens per page), M max pages per sequence, T tokens.

Layout (the kernels'): `k_pages, v_pages: [K, P, S, H]` for one layer, `page_table: [B, M]` (page
ids; entries past a sequence's pages may hold the out-of-range sentinel P), `lengths: [B]` (the
number of valid key positions of each sequence; position t lives in page `page_table[b, t // S]`,
row `t % S`).

Implementations (`impl`):
  "reference"   gather + masked softmax in jnp; runs on every backend, exact in fp32. Masked
                positions never contribute, even if their pages hold NaN (free pages may be
                poisoned in tests).
  "pallas_tpu"  `jax.experimental.pallas.ops.tpu.paged_attention`. Note: without quantization
                scales the kernel casts K and V to bfloat16 after loading them
                (`_maybe_dequantize`), so it matches the fp32 reference only to bf16 precision;
                and it masks with `qk + mask_value`, so NaN in a masked row of a partially used
                page would propagate (it is only ever read for positions < length here).
  "pallas_gpu"  `jax.experimental.pallas.ops.gpu.paged_attention` (Triton); needs
                `M % k_splits == 0`.
  "auto"        the kernel of the default backend (TPU, GPU) and the reference elsewhere.
Both kernels take pre-scaled queries; `paged_attention` scales by 1/sqrt(H) for every impl.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tpurl.models.transformer import DenseAttention

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
_MASKED = -1e30  # finite, so an all-masked row (an idle slot) yields zeros instead of NaN


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The concrete implementation for `impl` on `backend` (default: JAX's default backend)."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not known; use one of {IMPLS}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(backend, "reference")


def gather_pages(pages_KPSH: jax.Array, page_table_BM: jax.Array) -> jax.Array:
    """Each sequence's keys (or values) in order, `[B, K, M*S, H]`; sentinel pages read as zeros."""
    k, _, s, h = pages_KPSH.shape
    b, m = page_table_BM.shape
    g_KBMSH = pages_KPSH.at[:, page_table_BM].get(mode="fill", fill_value=0)
    return jnp.transpose(g_KBMSH, (1, 0, 2, 3, 4)).reshape(b, k, m * s, h)


def paged_attention_reference(q_BNH: jax.Array, k_pages_KPSH: jax.Array, v_pages_KPSH: jax.Array,
                              lengths_B: jax.Array, page_table_BM: jax.Array) -> jax.Array:
    """Single-query attention of each sequence over its first `lengths[b]` cached positions.

    `q` must already be scaled (kernel convention). Returns `[B, N, H]` in q's dtype; softmax in fp32.
    """
    b, n, h = q_BNH.shape
    kv = k_pages_KPSH.shape[0]
    keys_BKTH = gather_pages(k_pages_KPSH, page_table_BM)
    vals_BKTH = gather_pages(v_pages_KPSH, page_table_BM)
    t = keys_BKTH.shape[2]
    valid_BT = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths_B[:, None]
    q_BKGH = q_BNH.reshape(b, kv, n // kv, h)
    s_BKGT = jnp.einsum("BKGH,BKTH->BKGT", q_BKGH, keys_BKTH, preferred_element_type=jnp.float32)
    s_BKGT = jnp.where(valid_BT[:, None, None, :], s_BKGT, _MASKED)
    p_BKGT = jax.nn.softmax(s_BKGT, axis=-1)
    # Zero masked values too: 0 * NaN would otherwise leak poison from unused page rows.
    vals_BKTH = jnp.where(valid_BT[:, None, :, None], vals_BKTH, 0)
    out_BKGH = jnp.einsum("BKGT,BKTH->BKGH", p_BKGT, vals_BKTH.astype(jnp.float32))
    return out_BKGH.reshape(b, n, h).astype(q_BNH.dtype)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class KernelSharding:
    """How to run a Pallas kernel on a multi-device mesh: a kernel is one opaque custom call that the
    SPMD partitioner cannot split, so it runs under `shard_map`, each device on its own sequences
    (`batch_axes`, sharding B) and its own KV heads (`kv_axes`, sharding K in the pool and the
    matching contiguous block of query heads in q). With `kv_axes=()` (KV heads replicated) every
    device attends with all heads of its sequences."""

    mesh: Mesh
    batch_axes: tuple[str, ...] = ()
    kv_axes: tuple[str, ...] = ()


def _axes(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def paged_attention(q_BNH: jax.Array, k_pages_KPSH: jax.Array, v_pages_KPSH: jax.Array, lengths_B: jax.Array,
                    page_table_BM: jax.Array, *, impl: str = "auto", interpret: bool = False,
                    sharding: KernelSharding | None = None) -> jax.Array:
    """Decode attention over pages with unscaled queries (scaled here by 1/sqrt(H) for every impl).

    `interpret=True` runs the Pallas kernels in interpret mode (CPU checks of the kernels).
    `sharding`: run a kernel per device under `shard_map` (see `KernelSharding`); the reference
    needs none (XLA partitions it).
    """
    impl = resolve_impl(impl)
    if impl != "reference" and sharding is not None and sharding.mesh.size > 1:
        b_ax, k_ax = _axes(sharding.batch_axes), _axes(sharding.kv_axes)
        local = functools.partial(paged_attention, impl=impl, interpret=interpret)
        return jax.shard_map(
            local, mesh=sharding.mesh, check_vma=False,
            in_specs=(P(b_ax, k_ax, None), P(k_ax), P(k_ax), P(b_ax), P(b_ax, None)),
            out_specs=P(b_ax, k_ax, None))(q_BNH, k_pages_KPSH, v_pages_KPSH, lengths_B, page_table_BM)
    scale = 1.0 / math.sqrt(q_BNH.shape[-1])
    q_BNH = (q_BNH.astype(jnp.float32) * scale).astype(q_BNH.dtype)
    num_pages = k_pages_KPSH.shape[1]
    if impl == "reference":
        return paged_attention_reference(q_BNH, k_pages_KPSH, v_pages_KPSH, lengths_B, page_table_BM)
    # The kernels want every table entry in range; sentinel entries lie past `lengths` and are
    # never read for the result, so any valid page id will do.
    table = jnp.where(page_table_BM < num_pages, page_table_BM, 0).astype(jnp.int32)
    lengths_B = lengths_B.astype(jnp.int32)
    m = table.shape[1]
    if impl == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

        def call():
            return tpu_paged_attention(q_BNH, k_pages_KPSH, v_pages_KPSH, lengths_B, table,
                                       pages_per_compute_block=_largest_divisor_at_most(m, 8))

        if interpret:
            from jax.experimental.pallas import tpu as pltpu
            with pltpu.force_tpu_interpret_mode():
                return call()
        return call()
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
    k_splits = _largest_divisor_at_most(m, 16)
    return gpu_paged_attention(q_BNH, k_pages_KPSH, v_pages_KPSH, table, lengths_B, k_splits=k_splits,
                               pages_per_compute_block=_largest_divisor_at_most(m // k_splits, 8),
                               interpret=interpret)


class PagedDecodeAttention:
    """The model's `Attention` for one decode step (T = 1) over a paged cache.

    Per layer it receives `(k_pages, v_pages)` of that layer, writes each active slot's new k/v at
    position `lengths[b]` (page `page_table[b, lengths[b] // S]`, row `lengths[b] % S`), then
    attends over positions `[0, lengths[b]]`. Idle slots write nothing (their page index is the
    out-of-range sentinel and the scatter drops it), so they can never touch another sequence's page.
    """

    def __init__(self, page_table_BM: jax.Array, lengths_B: jax.Array, active_B: jax.Array, *,
                 impl: str = "auto", interpret: bool = False, sharding: KernelSharding | None = None):
        self.page_table = page_table_BM
        self.lengths = lengths_B
        self.active = active_B
        self.impl = impl
        self.interpret = interpret
        self.sharding = sharding

    def __call__(self, q_BTNH, k_BTKH, v_BTKH, cache):
        k_pages, v_pages = cache
        num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
        col_B = (self.lengths // page_size)[:, None]
        page_B = jnp.take_along_axis(self.page_table, col_B, axis=1, mode="fill", fill_value=num_pages)[:, 0]
        page_B = jnp.where(self.active, page_B, num_pages)
        row_B = self.lengths % page_size
        k_pages = k_pages.at[:, page_B, row_B].set(jnp.swapaxes(k_BTKH[:, 0], 0, 1).astype(k_pages.dtype),
                                                    mode="drop")
        v_pages = v_pages.at[:, page_B, row_B].set(jnp.swapaxes(v_BTKH[:, 0], 0, 1).astype(v_pages.dtype),
                                                    mode="drop")
        lengths = jnp.where(self.active, self.lengths + 1, 0)
        out_BNH = paged_attention(q_BTNH[:, 0], k_pages, v_pages, lengths, self.page_table, impl=self.impl,
                                  interpret=self.interpret, sharding=self.sharding)
        return out_BNH[:, None], (k_pages, v_pages)


class PrefillAttention:
    """Causal attention over a padded prompt that also hands back the layer's k/v as its cache output
    (the scan stacks them into `[L, B, T, K, H]`: the prefix that `insert` copies into the cache)."""

    def __init__(self, valid_BT: jax.Array):
        self.dense = DenseAttention(valid_BT)

    def __call__(self, q, k, v, cache):
        out, _ = self.dense(q, k, v, None)
        return out, (k, v)
