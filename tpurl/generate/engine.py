"""The rollout engine: JetStream's Engine protocol over a paged (or dense) KV cache.

Letters: B decode slots, L layers, T prompt positions (a prefill bucket), K kv heads, H head_dim,
V vocab, G samples of one prompt, M max pages per sequence.

Protocol (as JetStream's `Engine`, plus logprobs, group sharing and batched calls):

    state = engine.init_decode_state()                       # allocates the KV pool
    prefix, first = engine.prefill(params=p, padded_tokens=ids, true_length=n, sampling=s, seeds=(...))
    state = engine.insert(prefix, state, slot, sample_index=i)
    state, result = engine.generate(p, state)                 # one token for every active slot
    engine.free_resource(slot)                                # host-side; applied at the next call

    # The same, many at once: one program (and one host read) per admission wave.
    pairs = engine.prefill_batch(params=p, prompts=[ids, ...], sampling=s, seeds=[(...), ...])
    state = engine.insert_batch(state, [(prefix, slot, sample_index), ...])

    # Multi-turn (`tpurl.generate.extend`): a sequence waits for its environment out of its slot.
    seq = engine.detach(slot)                                 # keeps its pages, frees the slot
    state, result = engine.extend_batch(p, state, [Resume(slot=free_slot, seq=seq, tokens=ids, ...)], s)

* The decode state is a pytree of device arrays, donated to every `insert`/`generate` call: the
  caller must use the returned state and drop the old one. It holds the KV pool; the engine object
  does not, so **dropping the last reference to the decode state releases the pool** (e.g. before a
  training update; call `init_decode_state()` again for the next rollout). `KVPool` owns one decode
  state and does both; `driver.generate` runs on a caller's pool or allocates and frees its own.
  One decode state per engine is live at a time: `init_decode_state()` resets the host page
  bookkeeping, and a prefix's shared pages are only valid in the state they were written to.
* `generate` is one compiled program whatever the lengths. Prefill compiles once per (length
  bucket `EngineConfig.prefill_buckets`, prompts per call rounded up to a power of two <=
  `EngineConfig.max_prefill_batch`, samples per prompt: the most of any prompt in the call, not
  rounded); insert once per (sequences per call rounded up to a power of two <= max_slots, the
  prefill shape its prefixes come from). `trace_counts` counts traces (one per compilation).
* The first token of each sequence is sampled from the prefill's last logits (one per seed) in the
  prefill's own program, so a group of G samples runs one prefill and its G sequences share the
  prompt's full pages.
* Pages are allocated at insert for the whole request (prompt + max_new_tokens), so a running
  sequence never waits for memory; a request that does not fit now waits (see `can_insert`). The
  host bookkeeping of pages is the engine's `page_book` (`tpurl.generate.page_book`).
* Slots split over R > 1 data replicas (the layout's `batch` rule): the pool is R independent pools
  (`EngineConfig.num_pages` each, one allocator each); slot s uses the pool of `replica_of(s)`
  only, and every pool access runs under `shard_map`, so no replica holds, reads or writes
  another's pages. A prompt whose samples land on several replicas is written once per replica.
* Freed slots are deactivated inside the next `insert`/`generate` program, before anything it writes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.generate import kv_cache
from tpurl.generate.attention import resolve_impl
from tpurl.generate.compaction import Narrowing, gather_slots, scatter_slots, widen_result
from tpurl.generate.decode import decode_step
from tpurl.generate.decode_state import cache_layout, clear_slots, init_state, slot_specs
from tpurl.generate.extend import Resume, check_resume, extend_step, resume_rows
from tpurl.generate.insert import check_inserts, insert_sequences, page_arrays, slot_fields
from tpurl.generate.page_book import Detached, PageBook
from tpurl.generate.prefill import plan_prefill_calls, pow2_bucket, prefill_and_sample, prefixes
from tpurl.generate.program_costs import ProgramCosts
from tpurl.generate.protocol import EngineConfig, Prefix, ResultTokens
from tpurl.generate.sampling import SamplingConfig
from tpurl.memory import ProgramMemory
from tpurl.models.config import ModelConfig
from tpurl.models.transformer import abstract_model
from tpurl.sharding.host import to_host
from tpurl.sharding.layout import Layout
from tpurl.threads import check_owner


def check_bitwise(model_cfg: ModelConfig, cache_dtype, impl: str, mesh: Mesh) -> None:
    """One-line ValueError where bitwise mode (`ModelConfig.consistency`) cannot hold in this engine:
    a KV cache in another dtype than the compute dtype (the trainer's keys are never rounded to it),
    a kernel attention (its reductions are its own), or more than one device (a sharded product
    sums its parts in another order than the trainer's layout)."""
    if cache_dtype != model_cfg.compute_dtype:
        raise ValueError(f"ModelConfig.consistency='bitwise' with EngineConfig.cache_dtype={cache_dtype.name!r}: the "
                         f"cache must hold keys in the compute dtype {model_cfg.dtype!r}; leave cache_dtype None")
    if impl != "reference":
        raise ValueError(f"ModelConfig.consistency='bitwise' needs EngineConfig.attention_impl='reference' (the "
                         f"engine resolved {impl!r})")
    if mesh.size > 1:
        raise ValueError(f"ModelConfig.consistency='bitwise' runs on one device per pool for now (the rollout mesh has "
                         f"{mesh.size}); use a one-device rollout mesh or consistency='fast'")


class Engine:
    """JetStream-style engine for one model config on one mesh (see the module docstring).

    `stats` counts work: `prefill_prompts` (prompts prefilled), `prefill_batches` (prefill programs
    run), `prefill_tokens` (bucket positions of the prompts prefilled), `inserts` (sequences
    inserted), `insert_batches` (insert programs run), `decode_steps`; the driver adds
    `admission_waits` (waves that found free slots but not enough free pages) and `weight_switches`
    (in-flight weight updates a running `generate` call switched to).
    """

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, *, mesh: Mesh | None = None,
                 layout: Layout | None = None, graphdef=None):
        engine_cfg.check_complete()
        self.model_cfg = model_cfg
        self.config = engine_cfg
        self.mesh = mesh if mesh is not None else Mesh(np.asarray(jax.devices()[:1]), ("data",))
        self.layout = layout if layout is not None else Layout(name="replicated")
        self.graphdef = graphdef if graphdef is not None else nnx.split(abstract_model(model_cfg))[0]
        self.paged = engine_cfg.cache == "paged"
        # A router-replay model's programs report the experts of the tokens they consume.
        self.records_routes = model_cfg.moe is not None and model_cfg.moe.router_replay
        # Bitwise mode attends in windows, which only the reference decode attention does: "auto" picks it.
        auto_reference = model_cfg.bitwise and engine_cfg.attention_impl == "auto"
        self.impl = resolve_impl("reference" if auto_reference else engine_cfg.attention_impl,
                                 self.mesh.devices.flat[0].platform)
        self.buckets = engine_cfg.buckets
        self.cache_dtype = jnp.dtype(engine_cfg.cache_dtype or model_cfg.dtype)
        if model_cfg.bitwise:
            check_bitwise(model_cfg, self.cache_dtype, self.impl, self.mesh)
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
        # The clear mask of a call with no freed slot (most decode steps): on device once, so that
        # such a step sends nothing. Every mask is a replicated device array: one compiled program.
        self._no_clears = jax.device_put(np.zeros(engine_cfg.max_slots, bool), self._replicated)
        # Decode widths (`tpurl.generate.compaction`): narrowed only where the slots live whole on
        # every device and the KV in a shared page pool.
        narrow = engine_cfg.cache == "paged" and batch_ways == 1
        self._narrowing = Narrowing(engine_cfg.max_slots, engine_cfg.decode_buckets if narrow else 1, self._replicated)
        self.trace_counts: collections.Counter = collections.Counter()
        self.stats: collections.Counter = collections.Counter()
        cache = cache_layout(model_cfg, engine_cfg, self.cache_dtype, self.mesh, self.layout, self._slot_layout)
        self._cache, self.shape, self.replicas = cache, cache.shape, cache.replicas
        self._kernel_sharding = cache.kernel_sharding
        self._slot_fields = slot_specs(engine_cfg.max_slots, engine_cfg.max_stop_tokens,
                                       self.shape if self.paged else None)
        self._state_shardings = {"cache": {"k": cache.sharding, "v": cache.sharding},
                                 **{name: self._replicated for name in self._slot_fields}}
        # Host page bookkeeping (slot pages, allocators, clears, epoch, shared prefixes).
        self.page_book = PageBook(engine_cfg.max_slots, self.replicas, self.shape if self.paged else None)
        # Sampling without top-k / top-p compiles without any vocabulary sort (`truncate`, static);
        # a decode state that holds a truncating request uses the program that has it.
        self._truncating = False
        self._costs = ProgramCosts(self.graphdef, constrain=self._prefill_constrain, cache_dtype=self.cache_dtype)
        self._prefill_jit = jax.jit(self._prefill_fn, static_argnames=("truncate", "top_n"))
        self._insert_jit = jax.jit(self._insert_fn, donate_argnums=0, out_shardings=self._state_shardings)
        self._decode_jit = jax.jit(self._decode_fn, donate_argnums=1, static_argnames=("truncate", "top_n"),
                                   out_shardings=(self._state_shardings, self._replicated))
        self._extend_jit = jax.jit(self._extend_fn, donate_argnums=1, static_argnames=("truncate", "top_n"),
                                   out_shardings=(self._state_shardings, self._replicated))
        # Created in place on the mesh (never on the host), compiled once.
        self._init_jit = jax.jit(self._init_fn, out_shardings=self._state_shardings)

    # ----------------------------------------------------------------------------------------------
    # Sizes, pages, the decode state.

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.buckets[-1]

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """`(sparse layers, experts per token)` of each consumed token's recorded routes (router
        replay, `Completion.routes`); None when the engine records none."""
        if not self.records_routes:
            return None
        moe = self.model_cfg.moe
        return sum(moe.sparse(i) for i in range(self.model_cfg.num_layers)), moe.experts_per_token

    @property
    def num_pages(self) -> int | None:
        """Pages of one replica's pool (the whole pool with one replica); None for the dense cache."""
        return self.shape.num_pages if self.paged else None

    @property
    def allocator(self):
        """The page allocator of the single pool (engines with one replica; `page_book.allocators`)."""
        return self.page_book.allocator

    def replica_of(self, slot: int) -> int:
        """The data replica (and pool) of decode slot `slot`: slots are split in contiguous blocks."""
        return self.page_book.replica_of(slot)

    def free_pages(self, replica: int) -> int:
        """Free pages in replica `replica`'s pool (paged engines, after `init_decode_state`)."""
        return self.page_book.free_pages(replica)

    def _init_fn(self):
        self.trace_counts["init"] += 1
        fill = float("nan") if self.config.poison_free_pages else 0.0
        return init_state(self._cache, self.cache_dtype, self._slot_fields, fill)

    def init_decode_state(self) -> dict:
        """A fresh decode state (allocates the KV pool on the mesh); resets the host page bookkeeping.

        The pool is freed when the caller drops the returned state (and every state derived from it).
        """
        check_owner(self, "Engine.init_decode_state")  # the thread of an open rollout window, if any
        state = self._init_jit()
        self.page_book.reset()
        self._truncating = False
        return state

    # ----------------------------------------------------------------------------------------------
    # Admission: what fits.

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Raise a one-line ValueError if a request of this size can never run on this engine."""
        if prompt_length < 1:
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. a BOS token)")
        if prompt_length + max_new_tokens > self.model_cfg.max_position_embeddings:
            raise ValueError(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"max_position_embeddings={self.model_cfg.max_position_embeddings}; shorten the "
                             "prompt or generate fewer tokens")
        if prompt_length > self.max_prefill_length:
            raise ValueError(f"prompt of {prompt_length} tokens exceeds the longest prefill bucket "
                             f"({self.max_prefill_length}); raise EngineConfig.prefill_buckets/max_seq_len")
        if prompt_length + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"EngineConfig.max_seq_len={self.config.max_seq_len}; raise it or shorten the request")
        self.page_book.check_fits(prompt_length, max_new_tokens)

    def request_pages(self, prompt_length: int, max_new_tokens: int, samples: int = 1) -> int:
        """Fresh pages that `samples` sequences of one not yet inserted prompt take (`PageBook`)."""
        return self.page_book.request_pages(prompt_length, max_new_tokens, samples)

    def pages_needed(self, prefix: Prefix, count: int = 1, replica: int = 0) -> int:
        """Fresh pages the next `count` samples of `prefix` take on replica `replica` (`PageBook`)."""
        return self.page_book.pages_needed(prefix, count, replica)

    def can_insert(self, prefix: Prefix, count: int = 1, *, replica: int | None = None) -> bool:
        """Whether the next `count` samples of `prefix` fit in replica `replica`'s pool now (None:
        some replica's; `PageBook`)."""
        return self.page_book.can_insert(prefix, count, replica=replica)

    # ----------------------------------------------------------------------------------------------
    # Prefill.

    def _prefill_fn(self, params, tokens_PT, lengths_P, seeds_PG, temperature_P, top_k_P, top_p_P, truncate, top_n):
        self.trace_counts["prefill"] += 1
        return prefill_and_sample(self.graphdef, params, tokens_PT, lengths_P, seeds_PG, temperature_P, top_k_P,
                                  top_p_P, constrain=self._prefill_constrain, cache_dtype=self.cache_dtype,
                                  truncate=truncate, top_n=top_n, routes=self.records_routes,
                                  bitwise=self.model_cfg.bitwise)

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise a one-line ValueError if this engine cannot sample with `sampling` (its stop tokens)."""
        if len(sampling.stop_token_ids) > self.config.max_stop_tokens:
            raise ValueError(f"{len(sampling.stop_token_ids)} stop tokens exceed EngineConfig.max_stop_tokens="
                             f"{self.config.max_stop_tokens}; raise it")
        self.model_cfg.check_token_ids(sampling.stop_token_ids, "SamplingConfig.stop_token_ids")
        if sampling.top_logprobs is not None and sampling.top_logprobs > self.config.top_logprobs:
            raise ValueError(f"SamplingConfig.top_logprobs={sampling.top_logprobs} exceeds EngineConfig.top_logprobs="
                             f"{self.config.top_logprobs}, the most this engine computes; raise it")

    def reports_top(self, sampling: SamplingConfig) -> int:
        """How many top logprobs each token sampled with `sampling` reports (`SamplingConfig.top_logprobs`;
        0: none). A program computes the engine's `EngineConfig.top_logprobs` of them when one of its
        sequences reports any, else none."""
        return self.config.top_logprobs if sampling.top_logprobs is None else sampling.top_logprobs

    def _top_n(self, report: bool) -> int:
        """The static `top_n` of a program: the engine's top logprobs if some row reports them."""
        return self.config.top_logprobs if report else 0

    def prefill(self, *, params, padded_tokens, true_length: int, sampling: SamplingConfig | None = None,
                seeds=(0,)) -> tuple[Prefix, ResultTokens]:
        """Run the prompt `padded_tokens[:true_length]` once (padded to a bucket) and sample the first
        token of each of `len(seeds)` samples. Returns the prefix and those first tokens `[G]`.

        The one-prompt case of `prefill_batch` (same program family, same results)."""
        ids = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        if len(ids) != true_length:
            raise ValueError(f"prefill: true_length={true_length} but only {len(ids)} tokens were given")
        return self.prefill_batch(params=params, prompts=[ids], sampling=sampling, seeds=[seeds])[0]

    def prefill_batch(self, *, params, prompts, sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
                      seeds) -> list[tuple[Prefix, ResultTokens]]:
        """Prefill many prompts (token id sequences, unpadded) and sample the first token of each of
        their samples (`seeds[i]`: one seed per sample of prompt i) with `sampling` (one config for
        all, or one per prompt). Returns `(prefix, first tokens)` per prompt, in order.

        Prompts of one length bucket run together, `max_prefill_batch` at a time, each call one
        program with the first tokens sampled inside; all calls are launched before the single host
        read of every first token.
        """
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        seeds = [np.asarray(s, np.uint32).reshape(-1) for s in seeds]
        samplings = _per_request(sampling, len(prompts))
        if len(seeds) != len(prompts) or len(samplings) != len(prompts):
            raise ValueError(f"prefill_batch: {len(prompts)} prompts but {len(seeds)} seed lists and "
                             f"{len(samplings)} sampling configs; pass one per prompt (sampling: or one for all)")
        for s in set(samplings):
            self.check_sampling(s)
        for i, (ids, sd) in enumerate(zip(prompts, seeds)):
            try:
                self.check_request(len(ids), samplings[i].max_new_tokens)
            except ValueError as e:
                raise ValueError(f"prefill_batch: prompt {i}: {e}") from None
            self.model_cfg.check_token_ids(ids, f"prefill_batch: prompt {i}")
            if len(sd) < 1:
                raise ValueError(f"prefill_batch: prompt {i} has no seeds; pass one seed per sample")
        calls = []  # (prompt indices, k, v, (tokens_PG, logprobs_PG, top, routes)), launched before any host read
        for call in plan_prefill_calls(prompts, seeds, samplings, self.buckets, self.config.max_prefill_batch):
            truncate = any(samplings[i].truncates for i in call.indices)  # else a program without the sort
            top_n = self._top_n(any(self.reports_top(samplings[i]) for i in call.indices))
            k, v, *results = self._prefill_jit(params, call.tokens_PT, call.lengths_P, call.seeds_PG,
                                               call.temperature_P, call.top_k_P, call.top_p_P, truncate=truncate,
                                               top_n=top_n)
            calls.append((call.indices, k, v, results))
            p, bucket = call.tokens_PT.shape
            self.stats["prefill_batches"] += 1
            self.stats["prefill_prompts"] += len(call.indices)
            self.stats["prefill_tokens"] += bucket * len(call.indices)
            self._costs.prefill_ran(p, bucket)
        host = to_host([results for *_, results in calls])
        return prefixes(prompts, seeds, samplings, [call[:3] for call in calls], host)

    def prefill_flops(self, params) -> float:
        """Total FLOPs of the prefill forwards run so far (`ProgramCosts.prefill_flops`)."""
        return self._costs.prefill_flops(params)

    # ----------------------------------------------------------------------------------------------
    # Insert / free.

    def _clear_slots(self, state, clear_B):
        """Deactivate the slots freed since the last call (and point their tables at nothing)."""
        return clear_slots(state, clear_B, self.num_pages)

    def _insert_fn(self, state, clear_B, k_LPTKH, v_LPTKH, slot_W, row_W, fields, paged):
        self.trace_counts["insert"] += 1
        # Freed slots stop first: their pages may be handed to the sequences inserted here.
        state = self._clear_slots(state, clear_B)
        # The kernels compute masked rows too (NaN * 0 = NaN): scrub a reused page's stale rows so
        # that nothing a previous owner left (even NaN) can reach this sequence.
        return insert_sequences(state, k_LPTKH, v_LPTKH, slot_W, row_W, fields, paged if self.paged else None,
                                poison=self.config.poison_free_pages, scrub=self.paged and self.impl != "reference",
                                sharding=self._kernel_sharding if self.paged else None)

    def insert(self, prefix: Prefix, decode_state: dict, slot: int, *, sample_index: int = 0) -> dict:
        """Place sample `sample_index` of `prefix` in `slot` (which must be free); returns the new state.

        Allocates the sequence's pages for prompt + max_new_tokens (sharing the prompt's full pages
        with earlier samples of the same prefix). Raises `PoolExhausted` if they are not free; check
        `can_insert` first to wait instead. The one-sequence case of `insert_batch`.
        """
        return self.insert_batch(decode_state, [(prefix, slot, sample_index)])

    def insert_batch(self, decode_state: dict, requests) -> dict:
        """Insert many sequences in one program: `requests` is a sequence of `(prefix, slot,
        sample_index)`, all prefixes from one `prefill_batch` call. Returns the new decode state
        (`decode_state` is donated).

        Pages are allocated in request order as `insert` would, one after the other, each from the
        pool of its slot's replica (a group's first sample on a replica takes fresh pages and shares
        its full prompt pages with the group's later samples on that replica).
        If they do not all fit, `PoolExhausted` is raised and nothing is inserted; if the call fails,
        every page it took is given back.
        """
        requests = [(prefix, int(slot), int(k)) for prefix, slot, k in requests]
        if not requests:
            return decode_state
        check_inserts(requests, self.config.max_slots, self.page_book.busy)
        self._truncating |= any(prefix.sampling.truncates for prefix, _, _ in requests)
        n = len(requests)
        w = pow2_bucket(n, self.config.max_slots)
        k_src = requests[0][0].k
        slot_W = np.full(w, self.config.max_slots, np.int32)  # out of range: padding rows write nowhere
        row_W = np.zeros(w, np.int32)
        for i, (prefix, slot, _) in enumerate(requests):
            slot_W[i], row_W[i] = slot, prefix.row
        fields = slot_fields(requests, w, self.config.max_stop_tokens)
        # Pending clears go into the same program, before its writes (a freed slot must stop
        # writing before its pages are written by another sequence).
        clear_B = self._clear_mask()
        allocation = self.page_book.allocate(requests)
        try:
            paged = page_arrays(self.shape, requests, allocation.placements, w, k_src.shape[1]) if self.paged else {}
            decode_state = self._insert_jit(decode_state, clear_B, k_src, requests[0][0].v, slot_W, row_W,
                                            fields, paged)
        except BaseException:
            self.page_book.undo(allocation)  # nothing references the pages yet: a failed insert leaks none
            raise
        self.page_book.commit(requests, allocation)
        self.stats["inserts"] += n
        self.stats["insert_batches"] += 1
        return decode_state

    def release_prefix(self, prefix: Prefix) -> None:
        """Drop the prefix's reference to its shared prompt pages (idempotent); it cannot be
        inserted again."""
        self.page_book.release_prefix(prefix)

    def free_resource(self, slot: int) -> None:
        """Free `slot` and release its pages (host side). The slot is deactivated on device at the
        next `insert`/`generate`, before any page can be handed to another sequence."""
        self.page_book.free(slot)

    def _clear_mask(self) -> jax.Array:
        """The `[B]` mask of the slots freed since the last program, on device."""
        if not self.page_book.pending_clears:
            return self._no_clears
        return jax.device_put(self.page_book.clear_mask(), self._replicated)

    # ----------------------------------------------------------------------------------------------
    # Decode.

    def _decode_fn(self, params, state, clear_B, rows_N, truncate, top_n):
        self.trace_counts["generate"] += 1
        state = self._clear_slots(state, clear_B)
        if rows_N is None:
            return self._decode_step(params, state, truncate, top_n)
        fields = self._slot_fields
        narrow, result = self._decode_step(params, gather_slots(state, rows_N, fields), truncate, top_n)
        return scatter_slots(state, narrow, rows_N, fields), widen_result(result, rows_N, self.config.max_slots)

    def _decode_step(self, params, state, truncate, top_n):
        """One decode step of every slot in `state` (all of them, or a gathered few)."""
        return decode_step(self.graphdef, params, state, paged=self.paged, impl=self.impl,
                           interpret=self.config.kernel_interpret, sharding=self._kernel_sharding,
                           constrain=self._constrain, truncate=truncate, top_n=top_n,
                           routes=self.records_routes)

    def generate(self, params, decode_state: dict, *, top: bool = True) -> tuple[dict, ResultTokens]:
        """One decode step for every active slot (one compiled program per width, see
        `tpurl.generate.compaction`); with `top` False it computes no top logprobs (no running
        sequence reports them). Donates `decode_state`."""
        compiles, clears = self.trace_counts["generate"], self._clear_mask()
        rows = self._narrowing.rows(self.page_book.used_slots())
        statics = {"truncate": self._truncating, "top_n": self._top_n(top)}
        out = self._decode_jit(params, decode_state, clears, rows, **statics)
        width = self.config.max_slots if rows is None else int(rows.shape[0])
        if self.trace_counts["generate"] != compiles:  # a new program: how to ask XLA about it
            self._costs.decode_compiled(width, (params, decode_state, clears, rows), statics)
        self.page_book.mark_cleared()
        self.stats["decode_steps"] += 1
        self.stats["decode_slot_steps"] += width
        return out

    def decode_memory(self) -> ProgramMemory | None:
        """XLA's memory analysis (per device) of the widest decode program compiled; None before
        any decode step (`ProgramCosts.decode_memory`)."""
        return self._costs.decode_memory(self._decode_jit)

    # ----------------------------------------------------------------------------------------------
    # Multi-turn: detach a sequence from its slot, resume it later in a free slot
    # (`tpurl.generate.extend` says what a resume appends and where).

    def detach(self, slot: int) -> Detached:
        """Take the sequence in `slot` out of it, keeping its pages (and so its cached positions):
        a sequence that waits for its environment needs no decode slot. The slot is free for
        another sequence from the next program on; `extend_batch` resumes the sequence in a free
        slot of the same replica, `release_detached` gives its pages back."""
        return self.page_book.detach(slot)

    def release_detached(self, seq: Detached) -> None:
        """Give a detached sequence's pages back to its pool (its episode is over)."""
        self.page_book.release_detached(seq)

    def size_detached(self, seq: Detached, prompt_length: int, max_new_tokens: int) -> bool:
        """Give detached `seq` the pages of a sequence of `prompt_length` + `max_new_tokens` (its
        cached positions a prefix of the prompt: a later request that extends it); False, with
        nothing changed, if its pool lacks the free pages."""
        pages = self.shape.sequence_pages(prompt_length, max_new_tokens)
        if pages - len(seq.pages) > self.free_pages(seq.replica):
            return False
        self.page_book.resize(seq, pages)
        return True

    def _extend_fn(self, params, state, clear_B, tokens_NT, rows, rows_N, truncate, top_n):
        self.trace_counts["extend"] += 1
        state = self._clear_slots(state, clear_B)

        def extend(state):
            return extend_step(self.graphdef, params, state, tokens_NT, rows, constrain=self._constrain,
                               sharding=self._kernel_sharding, truncate=truncate, top_n=top_n,
                               routes=self.records_routes)

        if rows_N is None:
            return extend(state)
        narrow, result = extend(gather_slots(state, rows_N, self._slot_fields))
        return (scatter_slots(state, narrow, rows_N, self._slot_fields),
                widen_result(result, rows_N, self.config.max_slots))

    def extend_batch(self, params, decode_state: dict, requests: list[Resume],
                     sampling: SamplingConfig | Sequence[SamplingConfig]) -> tuple[dict, ResultTokens]:
        """Resume detached sequences in free slots: append tokens to each one's pages at its
        position (the model's last sampled token, then the environment's) and sample its next
        token, all in one program, with `sampling` (one config for all, or one per request). The
        slots decode from then on unless the sampled token ends them. Donates `decode_state`."""
        if not self.paged:
            raise ValueError("extend_batch: resuming a sequence needs the paged cache (cache='paged')")
        if self.model_cfg.bitwise:
            raise ValueError("extend_batch: ModelConfig.consistency='bitwise' does not cover multi-turn extends yet; "
                             "use consistency='fast'")
        samplings = _per_request(sampling, len(requests))
        if len(samplings) != len(requests):
            raise ValueError(f"extend_batch: {len(requests)} requests but {len(samplings)} sampling configs; pass one, "
                             "or one per request")
        for s in set(samplings):
            self.check_sampling(s)
        width = pow2_bucket(max(len(r.tokens) for r in requests), self.config.max_seq_len)
        tokens_BT, rows = resume_rows(requests, samplings, self.config.max_slots, width, self.shape,
                                      self.config.max_stop_tokens)
        for r in requests:
            check_resume(r, self.page_book, self.shape.page_size, self.model_cfg)
        self._truncating |= any(s.truncates for s in samplings)
        # Only the resumed slots' rows (the others would run the model over `width` tokens each to
        # no effect).
        rows_N = self._narrowing.extend_rows([r.slot for r in requests])
        if rows_N is not None:
            tokens_BT, rows = tokens_BT[rows_N], {name: value[rows_N] for name, value in rows.items()}
            rows_N = jax.device_put(rows_N, self._replicated)
        out = self._extend_jit(params, decode_state, self._clear_mask(), tokens_BT, rows, rows_N,
                               truncate=self._truncating, top_n=self._top_n(any(map(self.reports_top, samplings))))
        self.page_book.mark_cleared()
        for r in requests:
            self.page_book.resume(r.slot, r.seq)
        self.stats["extends"] += len(requests)
        self.stats["extend_batches"] += 1
        return out


def _per_request(sampling: SamplingConfig | Sequence[SamplingConfig] | None, n: int) -> list[SamplingConfig]:
    """One sampling config per request of `n`: `sampling` for all (None: the default) or, given a
    sequence, its configs as they are (the caller checks their count)."""
    if sampling is None or isinstance(sampling, SamplingConfig):
        return [sampling or SamplingConfig()] * n
    return list(sampling)
