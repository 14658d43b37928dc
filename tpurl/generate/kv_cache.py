"""The paged KV pool: shapes, sizing from a memory budget, sharding, and prompt writes.

Letters: L layers, K kv heads, P pages, S page size, H head_dim, M max pages per sequence,
T prompt positions.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.models.config import ModelConfig

POOL_AXES = ("layers", "kv_heads", "pages", None, "head_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCacheShape:
    num_layers: int
    num_kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int
    max_pages_per_seq: int
    dtype: str

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_kv_heads, self.num_pages, self.page_size, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        """Pages holding `num_tokens` cached positions."""
        return -(-num_tokens // self.page_size)


def bytes_per_page(model_cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one page across all layers, K and V together (the unit the pool is sized in)."""
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * page_size * model_cfg.head_dim * jnp.dtype(
        dtype).itemsize


def pages_for_budget(model_cfg: ModelConfig, page_size: int, dtype, budget_bytes_per_device: int,
                     kv_shards: int = 1) -> int:
    """How many pages fit in `budget_bytes_per_device` when the kv-head axis is split `kv_shards` ways."""
    per_device = bytes_per_page(model_cfg, page_size, dtype) // kv_shards
    return int(budget_bytes_per_device // per_device)


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


def write_prompt(pool: dict[str, jax.Array], k_LTKH: jax.Array, v_LTKH: jax.Array, table_row_M: jax.Array,
                 start: jax.Array, true_length: jax.Array) -> dict[str, jax.Array]:
    """Write prompt positions `[start, true_length)` of one sequence into its pages.

    Positions before `start` are in pages shared with an earlier sequence of the same group (already
    written); positions from `true_length` on are bucket padding. Both are dropped, as are positions
    whose page entry is the sentinel.
    """
    num_pages, page_size = pool["k"].shape[2], pool["k"].shape[3]
    t_idx = jnp.arange(k_LTKH.shape[1], dtype=jnp.int32)
    page_T = jnp.take(table_row_M, t_idx // page_size, mode="fill", fill_value=num_pages)
    page_T = jnp.where((t_idx >= start) & (t_idx < true_length), page_T, num_pages)
    row_T = t_idx % page_size
    out = {}
    for name, x_LTKH in (("k", k_LTKH), ("v", v_LTKH)):
        x_LKTH = jnp.swapaxes(x_LTKH, 1, 2).astype(pool[name].dtype)
        out[name] = pool[name].at[:, :, page_T, row_T].set(x_LKTH, mode="drop")
    return out


def fill_pages(pool: dict[str, jax.Array], pages_M: jax.Array, value: float) -> dict[str, jax.Array]:
    """Fill the listed pages (sentinel entries ignored) with `value`: NaN poisons them (isolation
    tests), 0 scrubs them (for the Pallas kernels, which let NaN in masked rows through)."""
    num_pages = pool["k"].shape[2]
    pages_M = jnp.where(pages_M < num_pages, pages_M, num_pages)
    return {name: x.at[:, :, pages_M].set(value, mode="drop") for name, x in pool.items()}
