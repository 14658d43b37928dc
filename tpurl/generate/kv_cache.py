"""The paged KV pool: shapes, sizing from a memory budget, sharding, and prompt writes.

Letters: L layers, K kv heads, P pages (in the pool) or prompts (of a prefill batch, in `write_*`),
S page size, H head_dim, M max pages per sequence, T prompt positions, W sequences inserted at once.

The pool is `{"k": [L, K, P, S, H], "v": [L, K, P, S, H]}`: the per-layer layout of JAX's paged
attention kernels, stacked over layers so that the model's layer scan hands each layer its own
`[K, P, S, H]` slice. It lives in the engine's decode state (a donated pytree), never in the engine
object, so dropping the decode state frees it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tpurl.models.config import ModelConfig


def to_cache(x: jax.Array, dtype) -> jax.Array:
    """`x` (keys or values) cast to a cache's `dtype`; a one-byte float cache saturates at the
    format's largest finite value (a plain cast turns anything beyond it into NaN in e4m3, inf in
    e5m2)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1 and x.dtype != dtype:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(dtype)


POOL_AXES = ("layers", "kv_heads", "pages", None, "head_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCacheShape:
    """The pool's shape. `num_pages` pages per replica pool (the page-id space of the page table,
    whose sentinel is `num_pages`); `replicas` independent pools stacked along the pages axis (one per
    data replica, that axis sharded over the replicas' mesh axes; 1 for a single pool)."""

    num_layers: int
    num_kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int
    max_pages_per_seq: int
    dtype: str
    replicas: int = 1

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_kv_heads, self.replicas * self.num_pages, self.page_size, self.head_dim)

    def sequence_pages(self, prompt_length: int, max_new_tokens: int) -> int:
        """Pages of one whole sequence: its cached positions are the prompt and every generated
        token but the last one (which is never fed back)."""
        return -(-(prompt_length + max_new_tokens - 1) // self.page_size)


def bytes_per_page(model_cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one page across all layers, K and V together (the unit the pool is sized in)."""
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * page_size * model_cfg.head_dim * jnp.dtype(
        dtype).itemsize


def pages_for_budget(model_cfg: ModelConfig, page_size: int, dtype, budget_bytes_per_device: int,
                     kv_shards: int = 1) -> int:
    """How many pages fit in `budget_bytes_per_device` when the kv-head axis is split `kv_shards` ways."""
    per_device = bytes_per_page(model_cfg, page_size, dtype) // kv_shards
    return int(budget_bytes_per_device // per_device)


def pool_pages(engine_cfg, model_cfg: ModelConfig, dtype, device: jax.Device, kv_shards: int,
               default: int) -> int:
    """Pages of one replica's pool for `engine_cfg` (an `EngineConfig`): its `num_pages`, or what
    its `kv_memory_bytes` / `kv_memory_fraction` of `device` hold with the kv heads split
    `kv_shards` ways, else `default` (every slot at max_seq_len)."""
    if engine_cfg.num_pages is not None:
        return engine_cfg.num_pages
    if engine_cfg.kv_memory_bytes is None and engine_cfg.kv_memory_fraction is None:
        return default
    budget = engine_cfg.kv_memory_bytes or int(engine_cfg.kv_memory_fraction * device_memory_bytes(device))
    num_pages = pages_for_budget(model_cfg, engine_cfg.page_size, dtype, budget, kv_shards)
    if num_pages < 1:
        raise ValueError(f"EngineConfig: a KV budget of {budget} bytes per device holds no page of "
                         f"{bytes_per_page(model_cfg, engine_cfg.page_size, dtype) // kv_shards} "
                         "bytes; raise the budget or lower page_size")
    return num_pages


def device_memory_bytes(device: jax.Device) -> int:
    """Usable memory of one device, for budgets given as a fraction."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(f"device {device} reports no memory limit (CPU?); size the KV pool with "
                         "EngineConfig.num_pages or kv_memory_bytes instead of kv_memory_fraction")
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def shard_ways(spec: P, mesh: Mesh, dim: int = 1) -> int:
    """Into how many pieces `spec` splits dimension `dim` on `mesh`."""
    axes = spec[dim] if len(spec) > dim else None
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def init_pool(shape: PagedCacheShape, fill: float = 0.0) -> dict[str, jax.Array]:
    """A fresh pool (call inside jit with the pool's out_shardings to create it in place).
    `fill=nan` poisons it."""
    x = jnp.full(shape.pool_shape, fill, jnp.dtype(shape.dtype))
    return {"k": x, "v": x}


def write_prompts(pool: dict[str, jax.Array], k_LPTKH: jax.Array, v_LPTKH: jax.Array, table_PM: jax.Array,
                  length_P: jax.Array) -> dict[str, jax.Array]:
    """Write prompt positions `[0, length_P[p])` of every prompt `p` of a prefill batch into the
    pages of `table_PM[p]` (one scatter for the whole batch).

    A row whose table is all sentinels writes nothing (a prompt whose first pages this call does
    not write, or batch padding); positions from `length_P[p]` on are bucket padding and dropped.
    """
    num_pages, page_size = pool["k"].shape[2], pool["k"].shape[3]
    t = k_LPTKH.shape[2]
    t_T = jnp.arange(t, dtype=jnp.int32)
    page_PT = jnp.take(table_PM, t_T // page_size, axis=1, mode="fill", fill_value=num_pages)
    page_PT = jnp.where(t_T[None, :] < length_P[:, None], page_PT, num_pages)
    row_PT = jnp.broadcast_to(t_T % page_size, page_PT.shape)
    out = {}
    for name, x_LPTKH in (("k", k_LPTKH), ("v", v_LPTKH)):
        x_LKPTH = to_cache(jnp.transpose(x_LPTKH, (0, 3, 1, 2, 4)), pool[name].dtype)
        out[name] = pool[name].at[:, :, page_PT, row_PT].set(x_LKPTH, mode="drop")
    return out


def write_tails(pool: dict[str, jax.Array], k_LPTKH: jax.Array, v_LPTKH: jax.Array, row_W: jax.Array,
                page_W: jax.Array, start_W: jax.Array, length_W: jax.Array) -> dict[str, jax.Array]:
    """Write each sequence's own last prompt page: positions `[start_W[w], length_W[w])` of prompt
    `row_W[w]` (fewer than a page; `start` is page aligned) into page `page_W[w]`.

    These are the later samples of a group: their full prompt pages are shared with the first
    sample, only the partial page is their own. Only that page's rows are gathered, never a whole
    prompt per sequence. A sentinel page writes nothing.
    """
    num_pages, page_size = pool["k"].shape[2], pool["k"].shape[3]
    t = k_LPTKH.shape[2]
    s_S = jnp.arange(page_size, dtype=jnp.int32)
    t_WS = start_W[:, None] + s_S[None, :]
    page_WS = jnp.where(t_WS < length_W[:, None], page_W[:, None], num_pages)
    src_WS = jnp.minimum(t_WS, t - 1)  # rows past the prompt are dropped above; keep the gather in range
    row_WS = jnp.broadcast_to(s_S, page_WS.shape)
    out = {}
    for name, x_LPTKH in (("k", k_LPTKH), ("v", v_LPTKH)):
        x_LWSKH = x_LPTKH[:, row_W[:, None], src_WS]
        x_LKWSH = to_cache(jnp.transpose(x_LWSKH, (0, 3, 1, 2, 4)), pool[name].dtype)
        out[name] = pool[name].at[:, :, page_WS, row_WS].set(x_LKWSH, mode="drop")
    return out


def fill_pages(pool: dict[str, jax.Array], pages: jax.Array, value: float) -> dict[str, jax.Array]:
    """Fill the listed pages (any index shape; sentinel entries ignored) with `value`: NaN poisons
    them (isolation tests), 0 scrubs them (for the Pallas kernels, which let NaN in masked rows
    through)."""
    num_pages = pool["k"].shape[2]
    pages = jnp.where(pages < num_pages, pages, num_pages)
    return {name: x.at[:, :, pages].set(value, mode="drop") for name, x in pool.items()}
