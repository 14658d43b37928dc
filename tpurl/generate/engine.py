"""The rollout engine: JetStream's Engine protocol over a paged (or dense) KV cache.

Letters: B decode slots, L layers, T prompt positions (a prefill bucket), K kv heads, H head_dim,
V vocab, G samples of one prompt, M max pages per sequence.

Protocol (as JetStream's `Engine`, plus logprobs and group sharing):

    state = engine.init_decode_state()                       # allocates the KV pool
    prefix, first = engine.prefill(params=p, padded_tokens=ids, true_length=n, sampling=s, seeds=(...))
    state = engine.insert(prefix, state, slot, sample_index=i)
    state, result = engine.generate(p, state)                 # one token for every active slot
    engine.free_resource(slot)                                # host-side; applied at the next call

* The decode state is a pytree of device arrays, donated to every `insert`/`generate` call: the
  caller must use the returned state and drop the old one. It holds the KV pool; the engine object
  does not, so **dropping the last reference to the decode state releases the pool** (e.g. before a
  training update; call `init_decode_state()` again for the next rollout; `driver.generate` does
  both itself). One decode state per engine is live at a time: `init_decode_state()` resets the
  host page bookkeeping, and a prefix's shared pages are only valid in the state they were written to.
* `generate` is one compiled program whatever the lengths; prefill compiles once per length bucket
  (`EngineConfig.prefill_buckets`); `trace_counts` counts traces (one per compilation).
* The first token of each sequence is sampled from the prefill's last logits (one per seed), so a
  group of G samples runs one prefill and its G sequences share the prompt's full pages.
* Pages are allocated at insert for the whole request (prompt + max_new_tokens), so a running
  sequence never waits for memory; a request that does not fit now waits (see `can_insert`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.generate import kv_cache
from tpurl.generate.allocator import PageAllocator
from tpurl.generate.attention import IMPLS, KernelSharding, PagedDecodeAttention, PrefillAttention, resolve_impl
from tpurl.generate.dense import CACHE_AXES, DenseDecodeAttention, init_dense_cache, write_prompt_dense
from tpurl.generate.sampling import SamplingConfig, sample_tokens
from tpurl.models.config import ModelConfig
from tpurl.models.transformer import abstract_model
from tpurl.sharding.layout import Layout

CACHE_KINDS = ("paged", "dense")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Shape and memory of a rollout engine.

    cache: "paged" (page pool shared by all slots) or "dense" (one max_seq_len line per slot).
    max_slots: concurrent sequences (the decode batch). max_seq_len: prompt + completion limit.
    page_size: tokens per page. Pool size (paged): `num_pages`, or `kv_memory_bytes` (per device),
    or `kv_memory_fraction` of a device's free memory; at most one; with none, enough pages for
    every slot at max_seq_len (the dense cache's memory).
    prefill_buckets: padded prompt lengths prefill compiles for; buckets above max_seq_len are
    capped to it. attention_impl: see `tpurl.generate.attention` ("auto" picks the backend's kernel).
    cache_dtype: KV dtype (default: the model's compute dtype). max_stop_tokens: stop ids per
    request checked on device. poison_free_pages: fill pages with NaN before (re)use (tests).
    kernel_interpret: run a Pallas attention kernel in interpret mode (checking kernels on CPU).
    """

    cache: str = "paged"
    max_slots: int
    max_seq_len: int
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    prefill_buckets: tuple[int, ...] = (32, 128, 512, 2048)
    attention_impl: str = "auto"
    cache_dtype: str | None = None
    max_stop_tokens: int = 8
    poison_free_pages: bool = False
    kernel_interpret: bool = False

    def __post_init__(self):
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"EngineConfig.cache={self.cache!r}; use one of {CACHE_KINDS}")
        for name in ("max_slots", "max_seq_len", "page_size", "max_stop_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        sizing = [n for n in ("num_pages", "kv_memory_bytes", "kv_memory_fraction") if getattr(self, n) is not None]
        if len(sizing) > 1:
            raise ValueError(f"EngineConfig: set at most one of num_pages / kv_memory_bytes / kv_memory_fraction, "
                             f"got {sizing}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not self.prefill_buckets or any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"EngineConfig.prefill_buckets must be non-empty positive lengths, got {self.prefill_buckets}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"EngineConfig.attention_impl={self.attention_impl!r}; use one of {IMPLS}")
        if self.cache_dtype is not None:
            try:
                jnp.dtype(self.cache_dtype)
            except TypeError:
                raise ValueError(f"EngineConfig.cache_dtype={self.cache_dtype!r} is not a dtype name") from None
        object.__setattr__(self, "prefill_buckets", tuple(sorted(set(int(b) for b in self.prefill_buckets))))

    @property
    def buckets(self) -> tuple[int, ...]:
        """The prefill lengths actually compiled: the configured ones, capped at max_seq_len."""
        return tuple(sorted({min(b, self.max_seq_len) for b in self.prefill_buckets}))


class ResultTokens(NamedTuple):
    """What one `generate` step (or a prefill, for its G first tokens) produced, per row.

    tokens: sampled ids; logprobs: `log_softmax(logits / T)[token]` (fp32); valid: the row produced
    a token; lengths: tokens generated so far for that sequence (this one included); done: the
    sequence finished on device (stop token or max_new_tokens) and takes no further steps.
    """

    tokens: jax.Array
    logprobs: jax.Array
    valid: jax.Array
    lengths: jax.Array
    done: jax.Array


@dataclasses.dataclass(eq=False)
class Prefix:
    """A prefilled prompt: its k/v `[L, T, K, H]` and the first token of each of its G samples.

    With G > 1, the first `insert` writes the prompt into fresh pages and the prefix keeps a
    reference to the full ones; later inserts share them. The reference is dropped when all G
    samples are inserted, or by `Engine.release_prefix`.
    """

    k: jax.Array
    v: jax.Array
    prompt_ids: np.ndarray
    sampling: SamplingConfig
    seeds: np.ndarray
    first_tokens: np.ndarray
    first_logprobs: np.ndarray
    shared_pages: list[int] | None = None
    inserted: np.ndarray | None = None
    pool_epoch: int = -1  # the decode state (pool) that `shared_pages` belong to

    @property
    def true_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_samples(self) -> int:
        return len(self.seeds)

    def finished_at_first_token(self, sample_index: int) -> bool:
        """True when sample `i` is complete after its first token (stop token or max_new_tokens=1)."""
        return (self.sampling.max_new_tokens == 1
                or int(self.first_tokens[sample_index]) in self.sampling.stop_token_ids)


class Engine:
    """JetStream-style engine for one model config on one mesh (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, *, mesh: Mesh | None = None,
                 layout: Layout | None = None, graphdef=None):
        self.model_cfg = model_cfg
        self.config = engine_cfg
        self.mesh = mesh if mesh is not None else Mesh(np.asarray(jax.devices()[:1]), ("data",))
        self.layout = layout if layout is not None else Layout(name="replicated")
        self.graphdef = graphdef if graphdef is not None else nnx.split(abstract_model(model_cfg))[0]
        self.paged = engine_cfg.cache == "paged"
        self.impl = resolve_impl(engine_cfg.attention_impl, self.mesh.devices.flat[0].platform)
        self.buckets = engine_cfg.buckets
        self.cache_dtype = jnp.dtype(engine_cfg.cache_dtype or model_cfg.dtype)
        # Activations' batch dim follows the layout's `batch` rule where it divides: decode slots
        # can spread over `data` replicas; a one-sequence prefill (and an indivisible slot count)
        # is replicated instead.
        no_batch = dataclasses.replace(self.layout, name=self.layout.name + "/no_batch",
                                       rules=tuple(r for r in self.layout.rules if r[0] != "batch"))
        batch_ways = kv_cache.shard_ways(self.layout.spec(("batch",), self.mesh), self.mesh, dim=0)
        self._slot_layout = self.layout if engine_cfg.max_slots % batch_ways == 0 else no_batch
        self._constrain = self._slot_layout.compute_constrain(self.mesh)
        self._prefill_constrain = no_batch.compute_constrain(self.mesh)
        self._replicated = NamedSharding(self.mesh, P())
        self.trace_counts: collections.Counter = collections.Counter()
        self.stats: collections.Counter = collections.Counter()
        self._prefill_calls_by_bucket: collections.Counter = collections.Counter()
        self._setup_cache()
        self._slot_pages: list[list[int] | None] = [None] * engine_cfg.max_slots
        self._pending_clear: set[int] = set()
        self.allocator: PageAllocator | None = None
        self._epoch = 0  # bumped by init_decode_state: pages of an older pool mean nothing now
        self._prefill_jit = jax.jit(self._prefill_fn)
        self._first_jit = jax.jit(self._first_fn)
        self._insert_jit = jax.jit(self._insert_fn, donate_argnums=0, out_shardings=self._state_shardings)
        self._decode_jit = jax.jit(self._decode_fn, donate_argnums=1,
                                   out_shardings=(self._state_shardings, self._replicated))
        self._clear_jit = jax.jit(self._clear_fn, donate_argnums=0, out_shardings=self._state_shardings)
        # Created in place on the mesh (never on the host), compiled once.
        self._init_jit = jax.jit(self._init_fn, out_shardings=self._state_shardings)

    # ----------------------------------------------------------------------------------------------
    # Shapes, shardings, the decode state.

    def _setup_cache(self):
        cfg, m = self.config, self.model_cfg
        if self.paged:
            max_pages = -(-cfg.max_seq_len // cfg.page_size)
            probe = (m.num_layers, m.num_kv_heads, 1, cfg.page_size, m.head_dim)
            # KV heads over the layout's tensor axes where they divide (the layout replicates them
            # otherwise, as it does for the k/v projections).
            spec = self.layout.spec(kv_cache.POOL_AXES, self.mesh, shape=probe, what="KV page pool")
            shards = kv_cache.shard_ways(spec, self.mesh)
            if cfg.num_pages is not None:
                num_pages = cfg.num_pages
            elif cfg.kv_memory_bytes is not None or cfg.kv_memory_fraction is not None:
                budget = cfg.kv_memory_bytes or int(
                    cfg.kv_memory_fraction * kv_cache.device_memory_bytes(self.mesh.devices.flat[0]))
                num_pages = kv_cache.pages_for_budget(m, cfg.page_size, self.cache_dtype, budget, shards)
                if num_pages < 1:
                    raise ValueError(f"EngineConfig: a KV budget of {budget} bytes per device holds no page of "
                                     f"{kv_cache.bytes_per_page(m, cfg.page_size, self.cache_dtype) // shards} "
                                     "bytes; raise the budget or lower page_size")
            else:
                num_pages = cfg.max_slots * max_pages
            self.shape = kv_cache.PagedCacheShape(
                num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, num_pages=num_pages, page_size=cfg.page_size,
                head_dim=m.head_dim, max_pages_per_seq=max_pages, dtype=self.cache_dtype.name)
            self._cache_sharding = NamedSharding(self.mesh, spec)
        else:
            self.shape = (m.num_layers, cfg.max_slots, cfg.max_seq_len, m.num_kv_heads, m.head_dim)
            self._cache_sharding = NamedSharding(
                self.mesh, self._slot_layout.spec(CACHE_AXES, self.mesh, shape=self.shape, what="dense KV cache"))
        if self.paged:
            as_tuple = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)  # noqa: E731
            batch_spec = self._slot_layout.spec(("batch",), self.mesh, shape=(cfg.max_slots,), what="decode slots")
            self._kernel_sharding = KernelSharding(self.mesh, batch_axes=as_tuple(batch_spec[0]),
                                                   kv_axes=as_tuple(self._cache_sharding.spec[1]))
        rep = self._replicated
        self._state_shardings = {"cache": {"k": self._cache_sharding, "v": self._cache_sharding},
                                 **{name: rep for name in self._slot_fields()}}

    def _slot_fields(self) -> dict[str, tuple[tuple[int, ...], object, object]]:
        """Per-slot decode-state arrays: name -> (shape, dtype, initial value)."""
        b = self.config.max_slots
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
            "stop_ids": ((b, self.config.max_stop_tokens), jnp.int32, -1),
        }
        if self.paged:
            fields["page_table"] = ((b, self.shape.max_pages_per_seq), jnp.int32, self.shape.num_pages)
        return fields

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.buckets[-1]

    @property
    def num_pages(self) -> int | None:
        return self.shape.num_pages if self.paged else None

    @property
    def num_free_pages(self) -> int | None:
        return self.allocator.num_free if self.allocator is not None else None

    def _init_fn(self):
        self.trace_counts["init"] += 1
        fill = float("nan") if self.config.poison_free_pages else 0.0
        if self.paged:
            state = {"cache": kv_cache.init_pool(self.shape, fill)}
        else:
            state = {"cache": init_dense_cache(self.shape, self.cache_dtype, fill)}
        for name, (shape, dtype, value) in self._slot_fields().items():
            state[name] = jnp.full(shape, value, dtype)
        return state

    def init_decode_state(self) -> dict:
        """A fresh decode state (allocates the KV pool on the mesh); resets the host page bookkeeping.

        The pool is freed when the caller drops the returned state (and every state derived from it).
        """
        state = self._init_jit()
        if self.paged:
            self.allocator = PageAllocator(self.shape.num_pages)
        self._slot_pages = [None] * self.config.max_slots
        self._pending_clear = set()
        self._epoch += 1
        return state

    # ----------------------------------------------------------------------------------------------
    # Admission: what fits.

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Raise a one-line ValueError if a request of this size can never run on this engine."""
        if prompt_length < 1:
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. a BOS token)")
        if prompt_length > self.max_prefill_length:
            raise ValueError(f"prompt of {prompt_length} tokens exceeds the longest prefill bucket "
                             f"({self.max_prefill_length}); raise EngineConfig.prefill_buckets/max_seq_len")
        if prompt_length + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"EngineConfig.max_seq_len={self.config.max_seq_len}; raise it or shorten the request")
        if self.paged:
            need = self.shape.pages_for(prompt_length + max_new_tokens - 1)
            if need > self.shape.num_pages:
                raise ValueError(f"request needs {need} KV pages but the pool has only {self.shape.num_pages}; "
                                 "enlarge the pool (num_pages / kv_memory_bytes) or shorten the request")

    def pages_needed(self, prefix: Prefix) -> int:
        """Fresh pages the next insert of `prefix` allocates (0 for the dense cache)."""
        if not self.paged:
            return 0
        total = self.shape.pages_for(prefix.true_length + prefix.sampling.max_new_tokens - 1)
        shared = prefix.shared_pages is not None and prefix.pool_epoch == self._epoch
        return total - (len(prefix.shared_pages) if shared else 0)

    def can_insert(self, prefix: Prefix) -> bool:
        return not self.paged or self.pages_needed(prefix) <= self.allocator.num_free

    # ----------------------------------------------------------------------------------------------
    # Prefill.

    def _prefill_fn(self, params, tokens_1T, true_length):
        self.trace_counts["prefill"] += 1
        model = nnx.merge(self.graphdef, params)
        t = tokens_1T.shape[1]
        idx_1T = jnp.arange(t, dtype=jnp.int32)[None, :]
        hidden, (k, v) = model(tokens_1T, idx_1T, attention=PrefillAttention(idx_1T < true_length),
                               cache=None, constrain=self._prefill_constrain)
        last_11D = jax.lax.dynamic_slice_in_dim(hidden, true_length - 1, 1, axis=1)
        logits_V = model.logits(last_11D, self._prefill_constrain)[0, 0]
        return k[:, 0].astype(self.cache_dtype), v[:, 0].astype(self.cache_dtype), logits_V

    def _first_fn(self, logits_V, seeds_G, temperature, top_k, top_p):
        self.trace_counts["first_token"] += 1
        g = seeds_G.shape[0]
        logits_GV = jnp.broadcast_to(logits_V[None, :], (g, logits_V.shape[0]))
        full = lambda x, dt: jnp.full((g,), x, dt)  # noqa: E731
        return sample_tokens(logits_GV, seeds_G, full(0, jnp.int32), full(temperature, jnp.float32),
                             full(top_k, jnp.int32), full(top_p, jnp.float32))

    def prefill(self, *, params, padded_tokens, true_length: int, sampling: SamplingConfig | None = None,
                seeds=(0,)) -> tuple[Prefix, ResultTokens]:
        """Run the prompt `padded_tokens[:true_length]` once (padded to a bucket) and sample the first
        token of each of `len(seeds)` samples. Returns the prefix and those first tokens `[G]`."""
        sampling = sampling or SamplingConfig()
        ids = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        if len(ids) != true_length:
            raise ValueError(f"prefill: true_length={true_length} but only {len(ids)} tokens were given")
        self.check_request(true_length, sampling.max_new_tokens)
        if len(sampling.stop_token_ids) > self.config.max_stop_tokens:
            raise ValueError(f"{len(sampling.stop_token_ids)} stop tokens exceed EngineConfig.max_stop_tokens="
                             f"{self.config.max_stop_tokens}; raise it")
        bucket = next(b for b in self.buckets if b >= true_length)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :true_length] = ids
        k, v, logits = self._prefill_jit(params, padded, np.int32(true_length))
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += bucket
        self._prefill_calls_by_bucket[bucket] += 1
        seeds = np.asarray(seeds, np.uint32).reshape(-1)
        first, logprobs = jax.device_get(self._first_jit(logits, seeds, np.float32(sampling.temperature),
                                                         np.int32(sampling.top_k), np.float32(sampling.top_p)))
        prefix = Prefix(k=k, v=v, prompt_ids=ids, sampling=sampling, seeds=seeds, first_tokens=first,
                        first_logprobs=logprobs, inserted=np.zeros(len(seeds), bool))
        g = len(seeds)
        done = np.array([prefix.finished_at_first_token(i) for i in range(g)])
        return prefix, ResultTokens(tokens=first, logprobs=logprobs, valid=np.ones(g, bool),
                                    lengths=np.ones(g, np.int32), done=done)

    def prefill_flops(self, params) -> float:
        """Total FLOPs of the prefills run so far, from XLA's cost analysis of each bucket's program."""
        total = 0.0
        for bucket, calls in self._prefill_calls_by_bucket.items():
            lowered = self._prefill_jit.lower(params, np.zeros((1, bucket), np.int32), np.int32(1))
            cost = lowered.compile().cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            total += calls * float(cost["flops"])
        return total

    # ----------------------------------------------------------------------------------------------
    # Insert / free.

    def _insert_fn(self, state, k_LTKH, v_LTKH, slot, table_row, start, true_length, fields, fresh_row):
        self.trace_counts["insert"] += 1
        state = dict(state)
        if self.paged:
            pool = state["cache"]
            if self.config.poison_free_pages:  # simulate garbage in reused pages
                pool = kv_cache.fill_pages(pool, fresh_row, float("nan"))
            if self.impl != "reference":
                # The kernels compute masked rows too (NaN * 0 = NaN): scrub a reused page's stale
                # rows so that nothing a previous owner left (even NaN) can reach this sequence.
                pool = kv_cache.fill_pages(pool, fresh_row, 0.0)
            state["cache"] = kv_cache.write_prompt(pool, k_LTKH, v_LTKH, table_row, start, true_length)
            state["page_table"] = state["page_table"].at[slot].set(table_row)
        else:
            state["cache"] = write_prompt_dense(state["cache"], k_LTKH, v_LTKH, slot,
                                                poison=self.config.poison_free_pages)
        for name, value in fields.items():
            state[name] = state[name].at[slot].set(value.astype(state[name].dtype))
        return state

    def insert(self, prefix: Prefix, decode_state: dict, slot: int, *, sample_index: int = 0) -> dict:
        """Place sample `sample_index` of `prefix` in `slot` (which must be free); returns the new state.

        Allocates the sequence's pages for prompt + max_new_tokens (sharing the prompt's full pages
        with earlier samples of the same prefix). Raises `PoolExhausted` if they are not free; check
        `can_insert` first to wait instead.
        """
        if not 0 <= slot < self.config.max_slots:
            raise ValueError(f"insert: slot {slot} is outside [0, {self.config.max_slots})")
        if self._slot_pages[slot] is not None:
            raise ValueError(f"insert: slot {slot} is busy; call free_resource({slot}) when its sequence ends")
        if prefix.inserted[sample_index]:
            raise ValueError(f"insert: sample {sample_index} of this prefix was already inserted")
        s = prefix.sampling
        length = prefix.true_length
        start, pages, taken = 0, [], []  # taken: every page reference this call acquires
        table_row = fresh_row = np.zeros((1,), np.int32)
        made_shared = False
        if prefix.pool_epoch != self._epoch:  # shared pages of an older pool are gone
            prefix.shared_pages = None
        if self.paged:
            sentinel = self.shape.num_pages
            total = self.shape.pages_for(length + s.max_new_tokens - 1)
            if prefix.shared_pages is not None:
                own = self.allocator.allocate(total - len(prefix.shared_pages))
                self.allocator.share(prefix.shared_pages)
                pages = prefix.shared_pages + own
                taken = list(pages)
                start = len(prefix.shared_pages) * self.shape.page_size
            else:
                own = pages = self.allocator.allocate(total)
                taken = list(pages)
                if prefix.num_samples > 1:
                    prefix.shared_pages = pages[: length // self.shape.page_size]
                    prefix.pool_epoch = self._epoch
                    self.allocator.share(prefix.shared_pages)  # the prefix's own reference
                    taken += prefix.shared_pages
                    made_shared = True
            table_row = np.full(self.shape.max_pages_per_seq, sentinel, np.int32)
            table_row[: len(pages)] = pages
            fresh_row = np.full(self.shape.max_pages_per_seq, sentinel, np.int32)
            fresh_row[: len(own)] = own
        stop_ids = np.full(self.config.max_stop_tokens, -1, np.int32)
        stop_ids[: len(s.stop_token_ids)] = s.stop_token_ids
        fields = {
            "tokens": np.int32(prefix.first_tokens[sample_index]), "lengths": np.int32(length),
            "active": np.bool_(not prefix.finished_at_first_token(sample_index)),
            "seeds": np.uint32(prefix.seeds[sample_index]), "steps": np.int32(1),
            "remaining": np.int32(s.max_new_tokens - 1), "temperature": np.float32(s.temperature),
            "top_k": np.int32(s.top_k), "top_p": np.float32(s.top_p), "stop_ids": stop_ids,
        }
        # Pending clears go first (after allocation, which may raise without touching the state):
        # a freed slot must stop writing before its pages are written by another sequence.
        try:
            decode_state = self._apply_clears(decode_state)
            decode_state = self._insert_jit(decode_state, prefix.k, prefix.v, np.int32(slot), table_row,
                                            np.int32(start), np.int32(length), fields, fresh_row)
        except BaseException:
            # Nothing references the pages yet: give them back, or a failed insert leaks them.
            if self.paged:
                self.allocator.release(taken)
                if made_shared:
                    prefix.shared_pages = None
            raise
        self._slot_pages[slot] = list(pages)
        self.stats["inserts"] += 1
        prefix.inserted[sample_index] = True
        if prefix.inserted.all():
            self.release_prefix(prefix)
        return decode_state

    def release_prefix(self, prefix: Prefix) -> None:
        """Drop the prefix's reference to its shared prompt pages (idempotent)."""
        if prefix.shared_pages is not None and prefix.pool_epoch == self._epoch:
            self.allocator.release(prefix.shared_pages)
        prefix.shared_pages = None
        prefix.inserted[:] = True  # a released prefix cannot be inserted again

    def free_resource(self, slot: int) -> None:
        """Free `slot` and release its pages (host side). The slot is deactivated on device at the
        next `insert`/`generate`, before any page can be handed to another sequence."""
        pages = self._slot_pages[slot]
        if pages is None:
            raise ValueError(f"free_resource: slot {slot} is not in use")
        if self.paged:
            self.allocator.release(pages)
        self._slot_pages[slot] = None
        self._pending_clear.add(slot)

    def _clear_fn(self, state, mask_B):
        self.trace_counts["clear"] += 1
        state = dict(state)
        state["active"] = state["active"] & ~mask_B
        if self.paged:
            state["page_table"] = jnp.where(mask_B[:, None], self.shape.num_pages, state["page_table"])
        return state

    def _apply_clears(self, state):
        if not self._pending_clear:
            return state
        mask = np.zeros(self.config.max_slots, bool)
        mask[list(self._pending_clear)] = True
        self._pending_clear = set()
        return self._clear_jit(state, mask)

    # ----------------------------------------------------------------------------------------------
    # Decode.

    def _decode_fn(self, params, state):
        self.trace_counts["generate"] += 1
        model = nnx.merge(self.graphdef, params)
        active, lengths = state["active"], state["lengths"]
        if self.paged:
            attention = PagedDecodeAttention(state["cache"], state["page_table"], lengths, active, impl=self.impl,
                                             interpret=self.config.kernel_interpret, sharding=self._kernel_sharding)
        else:
            attention = DenseDecodeAttention(state["cache"], lengths, active)
        hidden, cache_out = model(state["tokens"][:, None], lengths[:, None], attention=attention,
                                  cache=attention.model_cache(), constrain=self._constrain)
        cache = attention.updated_pool(cache_out) if self.paged else attention.updated_cache(cache_out)
        logits_BV = model.logits(hidden, self._constrain)[:, 0]
        tokens, logprobs = sample_tokens(logits_BV, state["seeds"], state["steps"], state["temperature"],
                                         state["top_k"], state["top_p"])
        step = active.astype(jnp.int32)
        remaining = state["remaining"] - step
        stopped = jnp.any(tokens[:, None] == state["stop_ids"], axis=1)
        done = active & (stopped | (remaining <= 0))
        new = dict(state, cache=cache, tokens=jnp.where(active, tokens, state["tokens"]),
                   lengths=lengths + step, steps=state["steps"] + step, remaining=remaining,
                   active=active & ~done)
        return new, ResultTokens(tokens=tokens, logprobs=logprobs, valid=active, lengths=new["steps"], done=done)

    def generate(self, params, decode_state: dict) -> tuple[dict, ResultTokens]:
        """One decode step for every active slot (one compiled program). Donates `decode_state`."""
        decode_state = self._apply_clears(decode_state)
        self.stats["decode_steps"] += 1
        return self._decode_jit(params, decode_state)
