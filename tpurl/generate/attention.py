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
                (`_maybe_dequantize`), so it matches the fp32 reference only to bf16 precision.
  "pallas_gpu"  `jax.experimental.pallas.ops.gpu.paged_attention` (Triton); needs
                `M % k_splits == 0`.
  "auto"        the kernel of the default backend (TPU, GPU) and the reference elsewhere.
Both kernels take pre-scaled queries; `paged_attention` scales by 1/sqrt(H) for every impl. Both
compute the masked rows of a sequence's last page too (`qk + mask_value`, `p @ v`), so NaN left
there by a previous owner would propagate: the engine scrubs reused pages when it runs a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tpurl.generate.kv_cache import to_cache
from tpurl.models.invariant import decode_window_attention
from tpurl.models.attention import DenseAttention

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
_MASKED = -1e30  # finite, so an all-masked row (an idle slot) yields zeros instead of NaN
# Cached positions per step of the reference decode attention's loop (rounded to whole pages).
CHUNK_TOKENS = 64


# The kernels' modules, imported when an implementation is resolved (before any tracing), so that a
# JAX build without them falls back (`auto`) or fails with a clear error (explicit choice) up front.
_KERNEL_MODULES = {
    "pallas_tpu": ("jax.experimental.pallas.ops.tpu.paged_attention", "jax.experimental.pallas.tpu"),
    "pallas_gpu": ("jax.experimental.pallas.ops.gpu.paged_attention",),
}


def _import_kernel(impl: str) -> tuple:
    """The kernel modules of `impl` (raises ImportError when this JAX build lacks them)."""
    return tuple(importlib.import_module(name) for name in _KERNEL_MODULES[impl])


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The concrete implementation for `impl` on `backend` (default: JAX's default backend).

    A kernel is only returned if its modules import: `auto` then falls back to the reference, an
    explicit kernel choice raises a one-line ValueError.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not known; use one of {IMPLS}")
    if impl == "reference":
        return impl
    chosen = impl
    if impl == "auto":
        backend = backend or jax.default_backend()
        chosen = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(backend, "reference")
        if chosen == "reference":
            return chosen
    try:
        _import_kernel(chosen)
    except ImportError as e:
        if impl == "auto":
            warnings.warn(f"attention_impl='auto': the {chosen} kernel does not import ({e}); using 'reference'")
            return "reference"
        raise ValueError(f"attention_impl={impl!r}: its kernel does not import in this JAX build ({e}); "
                         "use 'auto' or 'reference'") from None
    return chosen


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
    device attends with all heads of its sequences.

    `page_axes`: the mesh axes the pool's pages axis is split over: `()` (one pool, replicated over
    the batch axes) or `batch_axes` (one pool per data replica: the replica holding slots block `r`
    holds pool block `r`, and page-table entries are ids local to that block). With per-replica
    pools every pool access (the reference path's gather and scatter too) runs under `shard_map`,
    so that no replica ever reads another's pages."""

    mesh: Mesh
    batch_axes: tuple[str, ...] = ()
    kv_axes: tuple[str, ...] = ()
    page_axes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.page_axes and self.page_axes != self.batch_axes:
            raise ValueError(f"KernelSharding: page_axes={self.page_axes} must be () or batch_axes="
                             f"{self.batch_axes} (a replica's slots use its own pool)")

    @property
    def replicas(self) -> int:
        """Independent page pools (1: one pool, page ids global)."""
        return math.prod(self.mesh.shape[a] for a in self.page_axes)

    def pool_spec(self, ndim_before_pages: int) -> P:
        """Spec of a pool array `[..., K, P, ...]` whose kv-head axis is at `ndim_before_pages - 1`."""
        return P(*(None,) * (ndim_before_pages - 1), spec_entry(self.kv_axes), spec_entry(self.page_axes))


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a tuple of mesh axes (None, one name, or the tuple)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def on_replicas(fn, sharding: KernelSharding | None, in_specs, out_specs):
    """`fn` run per data replica (under `shard_map` with these specs) when the pool is split into
    per-replica pools, else `fn` itself (one pool: GSPMD partitions it as before)."""
    if sharding is None or not sharding.page_axes:
        return fn
    return jax.shard_map(fn, mesh=sharding.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


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
        b_ax, k_ax = spec_entry(sharding.batch_axes), spec_entry(sharding.kv_axes)
        local = functools.partial(paged_attention, impl=impl, interpret=interpret)
        pages = sharding.pool_spec(1)
        return jax.shard_map(
            local, mesh=sharding.mesh, check_vma=False,
            in_specs=(P(b_ax, k_ax, None), pages, pages, P(b_ax), P(b_ax, None)),
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
    modules = _import_kernel(impl)  # already imported by resolve_impl: a lookup in sys.modules
    if impl == "pallas_tpu":
        kernel, pltpu = modules

        def call():
            return kernel.paged_attention(q_BNH, k_pages_KPSH, v_pages_KPSH, lengths_B, table,
                                          pages_per_compute_block=_largest_divisor_at_most(m, 8))

        if interpret:
            with pltpu.force_tpu_interpret_mode():
                return call()
        return call()
    (kernel,) = modules
    k_splits = _largest_divisor_at_most(m, 16)
    return kernel.paged_attention(q_BNH, k_pages_KPSH, v_pages_KPSH, table, lengths_B, k_splits=k_splits,
                                  pages_per_compute_block=_largest_divisor_at_most(m // k_splits, 8),
                                  interpret=interpret)


def new_token_slot(page_table_BM: jax.Array, lengths_B: jax.Array, active_B: jax.Array, num_pages: int,
                   page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, row) where each slot's next token is cached; idle slots get the sentinel page."""
    col_B1 = (lengths_B // page_size)[:, None]
    page_B = jnp.take_along_axis(page_table_BM, col_B1, axis=1, mode="fill", fill_value=num_pages)[:, 0]
    return jnp.where(active_B, page_B, num_pages), lengths_B % page_size


def softmax_with_new(s_cached_BKGT: jax.Array, valid_BT: jax.Array, s_new_BKG: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """One softmax over the valid cached positions and the step's own new key (float32).

    Returns the weights of the cached positions `[B, K, G, T]` (zero where invalid) and of the new
    key `[B, K, G]`. The new token always attends to itself, so an idle row is finite too.
    """
    s_cached_BKGT = jnp.where(valid_BT[:, None, None, :], s_cached_BKGT, _MASKED)
    m_BKG = jnp.maximum(jnp.max(s_cached_BKGT, axis=-1), s_new_BKG)
    e_cached = jnp.exp(s_cached_BKGT - m_BKG[..., None])
    e_new = jnp.exp(s_new_BKG - m_BKG)
    denom = jnp.sum(e_cached, axis=-1) + e_new
    return e_cached / denom[..., None], e_new / denom


def gather_layer_pages(pool_LKPSH: jax.Array, layer, page_table_BM: jax.Array) -> jax.Array:
    """Layer `layer`'s pages of every slot, `[K, B, M, S, H]`, in one gather (page ids clipped into
    range). The kv-head axis leads, as the attention dots want their batch axes (K, B) laid out, so
    no transposing copy of the gathered pages is needed."""
    _, k, _, s, h = pool_LKPSH.shape
    table_BM = page_table_BM.astype(jnp.int32)
    idx_BM2 = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), table_BM.shape), table_BM], axis=-1)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(0, 3, 4), collapsed_slice_dims=(0, 2),
                                          start_index_map=(0, 2))
    return jax.lax.gather(pool_LKPSH, idx_BM2, dims, slice_sizes=(1, k, 1, s, h),
                          mode=jax.lax.GatherScatterMode.CLIP)


class PagedPoolAccess:
    """Reads and writes of the paged pool `[L, K, P, S, H]` from inside the model's layer scan, per
    data replica when the pool is split into per-replica pools (`KernelSharding.page_axes`)."""

    def __init__(self, pool: dict[str, jax.Array], page_table_BM: jax.Array, sharding: KernelSharding | None):
        self.pool = pool
        self.page_table = page_table_BM
        self.sharding = sharding
        replicas = sharding.replicas if sharding is not None else 1
        # Page ids are local to a replica's pool: the sentinel is the local page count.
        self.num_pages, self.page_size = pool["k"].shape[2] // replicas, pool["k"].shape[3]
        if sharding is not None:
            self._b = spec_entry(sharding.batch_axes)
            self._pool5, self._pool4 = sharding.pool_spec(2), sharding.pool_spec(1)

    def layer_indices(self) -> jax.Array:
        """The model's per-layer "cache" of a reference pass: each layer's index into the pool."""
        return jnp.arange(self.pool["k"].shape[0], dtype=jnp.int32)

    def gather_layer(self, layer, page_table_BM: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Every slot's pages of one layer, keys and values `[K, B, M, S, H]` (M: the columns of
        `page_table_BM`, default the whole table); sentinel entries are clipped to a real page
        (mask them by position)."""
        table = self.page_table if page_table_BM is None else page_table_BM
        gather = self._on_replicas(gather_layer_pages, ("pool5", None, "b"), "kb")
        return gather(self.pool["k"], layer, table), gather(self.pool["v"], layer, table)

    def scatter(self, name: str, upd_LKB, page_B, row_B) -> jax.Array:
        """The pool `name` with `upd_LKB[:, :, b...]` written at `(page_B[b...], row_B[b...])` for all
        layers in place (sentinel pages are dropped)."""
        return self._on_replicas(
            lambda x, u, pg, row: x.at[:, :, pg, row].set(u, mode="drop"),
            ("pool5", "pool5", "b", "b"), "pool5")(self.pool[name], to_cache(upd_LKB, self.pool[name].dtype), page_B,
                                                   row_B)

    def _on_replicas(self, fn, in_names, out_name):
        """`on_replicas` with specs named: "pool5" `[L, K, P, ...]`, "pool4" `[K, P, ...]`, "b" a
        slot-major array, "kb" `[K, B, ...]` gathered pages, None replicated."""
        if self.sharding is None or not self.sharding.page_axes:
            return fn
        k_ax = spec_entry(self.sharding.kv_axes)
        specs = {"pool5": self._pool5, "pool4": self._pool4, "b": P(self._b), "kb": P(k_ax, self._b),
                 None: P()}
        return on_replicas(fn, self.sharding, tuple(specs[n] for n in in_names), specs[out_name])


class PagedDecodeAttention(PagedPoolAccess):
    """The model's `Attention` for one decode step (T = 1) over the paged pool `[L, K, P, S, H]`.

    Use: `cache = attn.model_cache()`; `hidden, out = model(..., attention=attn, cache=cache)`;
    `pool = attn.updated_pool(out)`.

    Reference impl: the pool is read-only inside the layer scan. The model's cache is just the
    layer index; each layer gathers its sequences' cached pages straight from the full pool,
    attends over them plus the step's own new k/v in one softmax, and returns the new k/v. After
    the scan, `updated_pool` writes all layers' new k/v with one in-place scatter into the donated
    pool. So a step's memory traffic is the pages it reads, never the whole pool.

    Kernel impls (which take one layer's `[K, P, S, H]` and attend over pages only): each layer
    receives its pool slice through the scan, writes its new k/v into it, then calls the kernel; the
    scan restacks the slices (the whole pool is rewritten every step).

    Idle slots write nothing: their page index is the out-of-range sentinel and the scatter drops it,
    so they can never touch another sequence's page.

    `window` (bitwise mode, `ModelConfig.attention_window`; reference impl only): each slot attends
    over its pages' first `window` positions with its new key at its own position
    (`tpurl.models.invariant.decode_window_attention`), as the trainer's forward does.
    """

    def __init__(self, pool: dict[str, jax.Array], page_table_BM: jax.Array, lengths_B: jax.Array,
                 active_B: jax.Array, *, impl: str = "auto", interpret: bool = False,
                 sharding: KernelSharding | None = None, window: int | None = None):
        super().__init__(pool, page_table_BM, sharding)
        self.lengths = lengths_B
        self.active = active_B
        self.impl = resolve_impl(impl)
        if window is not None and self.impl != "reference":
            raise ValueError(f"bitwise decode needs EngineConfig.attention_impl='reference', not {self.impl!r}")
        self.window = window
        self.interpret = interpret
        self.page_B, self.row_B = new_token_slot(page_table_BM, lengths_B, active_B, self.num_pages, self.page_size)

    def model_cache(self):
        if self.impl == "reference":
            return self.layer_indices()
        return (self.pool["k"], self.pool["v"])

    def updated_pool(self, cache_out) -> dict[str, jax.Array]:
        if self.impl != "reference":
            return {"k": cache_out[0], "v": cache_out[1]}
        return {name: self.scatter(name, jnp.transpose(new_LB1KH[:, :, 0], (0, 2, 1, 3)), self.page_B, self.row_B)
                for name, new_LB1KH in zip(("k", "v"), cache_out)}

    def __call__(self, q_BTNH, k_BTKH, v_BTKH, cache):
        if self.window is not None:
            return self._window(q_BTNH, k_BTKH, v_BTKH, cache)
        if self.impl == "reference":
            return self._reference(q_BTNH, k_BTKH, v_BTKH, cache)
        k_pages, v_pages = cache
        write = self._on_replicas(lambda x, u, pg, row: x.at[:, pg, row].set(u, mode="drop"),
                                  ("pool4", "pool4", "b", "b"), "pool4")
        # [K, B, H] updates: shard_map splits their B axis (dim 1) like the pool's pages.
        k_pages = write(k_pages, to_cache(jnp.swapaxes(k_BTKH[:, 0], 0, 1), k_pages.dtype), self.page_B, self.row_B)
        v_pages = write(v_pages, to_cache(jnp.swapaxes(v_BTKH[:, 0], 0, 1), v_pages.dtype), self.page_B, self.row_B)
        lengths = jnp.where(self.active, self.lengths + 1, 0)
        out_BNH = paged_attention(q_BTNH[:, 0], k_pages, v_pages, lengths, self.page_table, impl=self.impl,
                                  interpret=self.interpret, sharding=self.sharding)
        return out_BNH[:, None], (k_pages, v_pages)

    def _window(self, q_BTNH, k_BTKH, v_BTKH, layer):
        """Bitwise mode: every page of each slot gathered in position order, attended in a window."""
        keys, vals = self.gather_layer(layer)  # [K, B, M, S, H]
        kv, b, m, s, h = keys.shape
        positions = lambda x: jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(b, m * s, kv, h)  # noqa: E731
        lengths_B = jnp.where(self.active, self.lengths, 0)
        out_BNH = decode_window_attention(q_BTNH[:, 0], positions(keys), positions(vals), lengths_B, k_BTKH[:, 0],
                                          v_BTKH[:, 0], self.window)
        return out_BNH[:, None], (k_BTKH, v_BTKH)

    def _reference(self, q_BTNH, k_BTKH, v_BTKH, layer):
        """Online softmax over chunks of `CHUNK_TOKENS` cached positions (plus the step's own new
        key), for as many chunks as the longest active sequence needs: a step reads the pages in
        use, not the whole page table's width, and no chunk's gathered pages outlive it. Everything
        is laid out kv-head major (`[K, B, ...]`), like the gathered pages."""
        b, _, n, h = q_BTNH.shape
        kv, s = self.pool["k"].shape[1], self.pool["k"].shape[3]
        g, c = n // kv, min(max(1, CHUNK_TOKENS // s), self.page_table.shape[1])
        q_BKGH = (q_BTNH[:, 0].astype(jnp.float32) / math.sqrt(h)).astype(q_BTNH.dtype).reshape(b, kv, g, h)
        q_KBGH = jnp.swapaxes(q_BKGH, 0, 1)
        m = self.page_table.shape[1]
        table_BM = jnp.pad(self.page_table, ((0, 0), (0, -m % c)), constant_values=self.num_pages)
        lengths_B = jnp.where(self.active, self.lengths, 0)
        s_new_KBG = jnp.einsum("BKGH,BKH->KBG", q_BKGH, k_BTKH[:, 0], preferred_element_type=jnp.float32)

        def chunk(i, carry):
            max_KBG, sum_KBG, acc_KBGH = carry
            keys, vals = self.gather_layer(layer, jax.lax.dynamic_slice_in_dim(table_BM, i * c, c, axis=1))
            valid_BT = (i * c * s + jnp.arange(c * s, dtype=jnp.int32))[None, :] < lengths_B[:, None]
            # Keys are the scores dot's left operand (positions by head_dim, as gathered); only the
            # small scores are transposed. The barrier keeps XLA from folding that transpose into
            # the dot (which would make the keys its transposed right operand, a slower matmul).
            s_KBTG = jnp.einsum("KBTH,KBGH->KBTG", keys.reshape(kv, b, c * s, h), q_KBGH,
                                preferred_element_type=jnp.float32)
            s_KBGT = jnp.swapaxes(jax.lax.optimization_barrier(s_KBTG), 2, 3)
            s_KBGT = jnp.where(valid_BT[None, :, None], s_KBGT, _MASKED)
            new_max = jnp.maximum(max_KBG, jnp.max(s_KBGT, axis=3))
            e_KBGT = jnp.exp(s_KBGT - new_max[..., None])
            scale = jnp.exp(max_KBG - new_max)
            # Zero masked values too: 0 * NaN would leak poison from unused page rows.
            vals = jnp.where(valid_BT[None, :, :, None], vals.reshape(kv, b, c * s, h), 0).astype(jnp.float32)
            acc_KBGH = acc_KBGH * scale[..., None] + jnp.einsum("KBGT,KBTH->KBGH", e_KBGT, vals)
            return new_max, sum_KBG * scale + jnp.sum(e_KBGT, axis=3), acc_KBGH

        # The new key starts the running softmax: its weight exp(0) = 1 at the running max.
        init = (s_new_KBG, jnp.ones_like(s_new_KBG), jnp.broadcast_to(
            jnp.swapaxes(v_BTKH[:, 0], 0, 1)[:, :, None, :].astype(jnp.float32), (kv, b, g, h)))
        chunks = (jnp.max(lengths_B) + c * s - 1) // (c * s)
        _, sum_KBG, acc_KBGH = jax.lax.fori_loop(0, chunks, chunk, init)
        out_BKGH = jnp.swapaxes(acc_KBGH / sum_KBG[..., None], 0, 1)
        return out_BKGH.reshape(b, 1, n, h).astype(q_BTNH.dtype), (k_BTKH, v_BTKH)


class PrefillAttention:
    """Causal attention over a padded prompt that also hands back the layer's k/v as its cache output
    (the scan stacks them into `[L, B, T, K, H]`: the prefix that `insert` copies into the cache).
    `query_blocks`: `ModelConfig.attention_query_blocks` (XLA's attention in causal query blocks);
    `window`: `ModelConfig.attention_window` (bitwise mode)."""

    def __init__(self, valid_BT: jax.Array, query_blocks: int, window: int | None = None):
        self.dense = DenseAttention(valid_BT, query_blocks=query_blocks, window=window)

    def __call__(self, q, k, v, cache):
        out, _ = self.dense(q, k, v, None)
        return out, (k, v)
