"""The decode state's layout: the KV cache's shape and sharding, and the per-slot arrays.

Letters: B decode slots, M max pages per sequence.

Paged cache: KV heads go over the layout's tensor axes where they divide (the layout replicates
them otherwise, as it does for the k/v projections). When the slots split over data replicas, the
pool is one pool per replica, its pages axis over the same mesh axes, so that no replica holds, or
writes, another's pages. Dense cache: one `max_seq_len` line per slot, sharded like the slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.generate import kv_cache
from tpurl.generate.attention import KernelSharding, spec_entry
from tpurl.generate.dense import CACHE_AXES, init_dense_cache
from tpurl.generate.protocol import EngineConfig
from tpurl.models.config import ModelConfig
from tpurl.sharding.layout import Layout


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The KV cache of an engine: its shape (`PagedCacheShape`, or the dense `[L, B, T, K, H]`), the
    number of replica pools, its sharding and (paged) the kernels' view of that sharding."""

    shape: kv_cache.PagedCacheShape | tuple[int, ...]
    replicas: int
    sharding: NamedSharding
    kernel_sharding: KernelSharding | None = None


def _as_tuple(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def cache_layout(m: ModelConfig, cfg: EngineConfig, cache_dtype, mesh: Mesh, layout: Layout,
                 slot_layout: Layout) -> CacheLayout:
    """The cache of an engine of `cfg` on `mesh` (`slot_layout`: how its decode slots are laid out)."""
    if cfg.cache != "paged":
        shape = (m.num_layers, cfg.max_slots, cfg.max_seq_len, m.num_kv_heads, m.head_dim)
        return CacheLayout(shape, 1, NamedSharding(mesh, slot_layout.spec(CACHE_AXES, mesh, shape=shape,
                                                                           what="dense KV cache")))
    max_pages = -(-cfg.max_seq_len // cfg.page_size)
    probe = (m.num_layers, m.num_kv_heads, 1, cfg.page_size, m.head_dim)
    spec = layout.spec(kv_cache.POOL_AXES, mesh, shape=probe, what="KV page pool")
    shards = kv_cache.shard_ways(spec, mesh)
    batch_spec = slot_layout.spec(("batch",), mesh, shape=(cfg.max_slots,), what="decode slots")
    batch_axes, kv_axes = _as_tuple(batch_spec[0]), _as_tuple(spec[1])
    page_axes = batch_axes if batch_axes and not set(batch_axes) & set(kv_axes) else ()
    replicas = int(np.prod([mesh.shape[a] for a in page_axes], dtype=np.int64))
    if page_axes:
        spec = P(spec[0], spec[1], spec_entry(page_axes))
    num_pages = kv_cache.pool_pages(cfg, m, cache_dtype, mesh.devices.flat[0], shards,
                                    default=cfg.max_slots // replicas * max_pages)
    shape = kv_cache.PagedCacheShape(
        num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, num_pages=num_pages, page_size=cfg.page_size,
        head_dim=m.head_dim, max_pages_per_seq=max_pages, dtype=jnp.dtype(cache_dtype).name, replicas=replicas)
    return CacheLayout(shape, replicas, NamedSharding(mesh, spec),
                       KernelSharding(mesh, batch_axes=batch_axes, kv_axes=kv_axes, page_axes=page_axes))


def slot_specs(max_slots: int, max_stop_tokens: int, shape: kv_cache.PagedCacheShape | None
               ) -> dict[str, tuple[tuple[int, ...], object, object]]:
    """Per-slot decode-state arrays: name -> (shape, dtype, initial value); `shape`: the paged
    pool's (None for the dense cache, which has no page table)."""
    b = max_slots
    fields = {
        "tokens": ((b,), jnp.int32, 0),          # next token to feed
        "lengths": ((b,), jnp.int32, 0),         # cached positions = position of the next token
        "active": ((b,), jnp.bool_, False),
        "seeds": ((b,), jnp.uint32, 0),
        "steps": ((b,), jnp.int32, 0),           # tokens generated so far (the next key index)
        "remaining": ((b,), jnp.int32, 0),       # tokens still allowed
        "temperature": ((b,), jnp.float32, 1.0),
        "top_k": ((b,), jnp.int32, 0),
        "top_p": ((b,), jnp.float32, 1.0),
        "stop_ids": ((b, max_stop_tokens), jnp.int32, -1),
    }
    if shape is not None:
        fields["page_table"] = ((b, shape.max_pages_per_seq), jnp.int32, shape.num_pages)  # sentinel: no page
    return fields


def init_state(cache: CacheLayout, cache_dtype, fields: dict, fill: float) -> dict:
    """A fresh decode state (inside jit): the cache filled with `fill`, every slot field at its
    initial value."""
    if isinstance(cache.shape, kv_cache.PagedCacheShape):
        state = {"cache": kv_cache.init_pool(cache.shape, fill)}
    else:
        state = {"cache": init_dense_cache(cache.shape, cache_dtype, fill)}
    for name, (shape, dtype, value) in fields.items():
        state[name] = jnp.full(shape, value, dtype)
    return state


def clear_slots(state: dict, clear_B, num_pages: int | None) -> dict:
    """`state` with the slots of `clear_B` deactivated (inside jit); with a paged cache of
    `num_pages` pages, their page tables point at nothing (the out-of-range page)."""
    state = dict(state)
    state["active"] = state["active"] & ~clear_B
    if num_pages is not None:
        state["page_table"] = jnp.where(clear_B[:, None], num_pages, state["page_table"])
    return state
