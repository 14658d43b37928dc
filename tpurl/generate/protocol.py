"""The engine protocol's data types: the engine's configuration (`EngineConfig`), what a decode
step returns (`ResultTokens`) and a prefilled prompt (`Prefix`). See `tpurl.generate.engine`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.config_types import check_types
from tpurl.generate.attention import IMPLS
from tpurl.generate.sampling import SamplingConfig

CACHE_KINDS = ("paged", "dense")
# The most top logprobs a step may report per token (OpenAI allows up to 20).
MAX_TOP_LOGPROBS = 20
DEFAULT_PREFILL_BUCKETS = (32, 128, 512, 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Shape and memory of a rollout engine.

    cache: "paged" (page pool shared by all slots) or "dense" (one max_seq_len line per slot).
    max_slots: concurrent sequences (the decode batch). max_seq_len: prompt + completion limit.
    Both must be set before an `Engine` is built; left None, they are derived from the workload by
    whoever builds the engine (the RL loop: the step's batch and the task's lengths).
    page_size: tokens per page. Pool size (paged): `num_pages`, or `kv_memory_bytes` (per device),
    or `kv_memory_fraction` of a device's free memory; at most one; with none, enough pages for
    every slot at max_seq_len (the dense cache's memory).
    **Per replica**: when the layout spreads the slots over R data replicas (its `batch` rule maps
    to mesh axes of total size R > 1 dividing max_slots), the pool is R independent pools, one per
    replica, its pages axis split over those axes; `num_pages` is the size of *one* replica's pool
    (R * num_pages in all), which is what every device holds (times its share of the kv heads). So
    a memory budget (per device) buys the same `num_pages` whatever R, and a request must fit in one
    replica's pool. With R = 1 there is one pool of `num_pages`.
    prefill_buckets: padded prompt lengths prefill compiles for; buckets above max_seq_len are
    capped to it (None: `DEFAULT_PREFILL_BUCKETS`, or the task's longest prompt in the RL loop). max_prefill_batch: the most prompts one prefill program runs (calls are padded to
    powers of two up to it, so there are few compilations). attention_impl: see
    `tpurl.generate.attention` ("auto" picks the backend's kernel).
    cache_dtype: KV dtype (default: the model's compute dtype). max_stop_tokens: stop ids per
    request checked on device. poison_free_pages: fill pages with NaN before (re)use (tests).
    kernel_interpret: run a Pallas attention kernel in interpret mode (checking kernels on CPU).
    decode_buckets: how many decode batch widths a paged engine whose slots are not split over
    devices compiles at most (the whole numbers among max_slots times 1, 3/4, 1/2, 3/8, 1/4, 3/16
    and 1/8, the 3/4 steps from 16 slots up: the default 7 takes them all); each step runs only the
    slots in use, at the narrowest width that holds them (`tpurl.generate.compaction`). 1: every
    step runs max_slots.
    Each width is one more decode program to compile (per sampling mode), when first used.
    top_logprobs: how many of the most likely tokens a sampling step reports with each sampled
    token (`ResultTokens.top`, `Completion.top`; OpenAI's `top_logprobs`), the most a request may
    ask for (`SamplingConfig.top_logprobs`); a program computes them only when one of its
    sequences' requests asks (one more variant of each program to compile, when first used); 0
    (the default, what rollouts use) computes none.
    """

    cache: str = "paged"
    max_slots: int | None = None
    max_seq_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    prefill_buckets: tuple[int, ...] | None = None
    max_prefill_batch: int = 16
    attention_impl: str = "auto"
    cache_dtype: str | None = None
    max_stop_tokens: int = 8
    poison_free_pages: bool = False
    kernel_interpret: bool = False
    decode_buckets: int = 7
    top_logprobs: int = 0

    def __post_init__(self):
        check_types(self)
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"EngineConfig.cache={self.cache!r}; use one of {CACHE_KINDS}")
        for name in ("max_slots", "max_seq_len", "page_size", "max_stop_tokens", "max_prefill_batch", "decode_buckets"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        sizing = [n for n in ("num_pages", "kv_memory_bytes", "kv_memory_fraction") if getattr(self, n) is not None]
        if len(sizing) > 1:
            raise ValueError(f"EngineConfig: set at most one of num_pages / kv_memory_bytes / kv_memory_fraction, "
                             f"got {sizing}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.prefill_buckets is not None and (not self.prefill_buckets or any(b < 1 for b in self.prefill_buckets)):
            raise ValueError(f"EngineConfig.prefill_buckets must be non-empty positive lengths, got {self.prefill_buckets}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"EngineConfig.attention_impl={self.attention_impl!r}; use one of {IMPLS}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"EngineConfig.top_logprobs={self.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.cache_dtype is not None:
            try:
                jnp.dtype(self.cache_dtype)
            except TypeError:
                raise ValueError(f"EngineConfig.cache_dtype={self.cache_dtype!r} is not a dtype name") from None
        if self.prefill_buckets is not None:
            object.__setattr__(self, "prefill_buckets", tuple(sorted(set(int(b) for b in self.prefill_buckets))))

    def check_complete(self) -> None:
        """Raise if a size the engine needs was left to be derived (max_slots, max_seq_len)."""
        missing = [n for n in ("max_slots", "max_seq_len") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"EngineConfig: {', '.join(missing)} not set; set them (an RL run derives them from "
                             "its batch and task)")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The prefill lengths actually compiled: the configured ones, capped at max_seq_len."""
        return tuple(sorted({min(b, self.max_seq_len) for b in self.prefill_buckets or DEFAULT_PREFILL_BUCKETS}))


class ResultTokens(NamedTuple):
    """What one `generate` step (or a prefill, for its G first tokens) produced, per row.

    tokens: sampled ids; logprobs: `log_softmax(logits / T)[token]` (fp32); valid: the row produced
    a token; lengths: tokens generated so far for that sequence (this one included); done: the
    sequence finished on device (stop token or max_new_tokens) and takes no further steps; top: the
    most likely tokens of each row's distribution (`sampling.TopLogprobs`) when the program computed
    them (a row's request reports some: `Engine.reports_top`), else None; routes: a router-replay
    model's experts per sparse layer `[rows, T, Ls, K]` of the T tokens each row consumed (a decode
    step: T = 1, the token the previous step sampled; a resume: the tokens it appended), else None.
    """

    tokens: jax.Array
    logprobs: jax.Array
    valid: jax.Array
    lengths: jax.Array
    done: jax.Array
    top: Any = None
    routes: Any = None


@dataclasses.dataclass(eq=False)
class Prefix:
    """A prefilled prompt: its k/v and the first token of each of its G samples.

    `k`, `v` are the whole prefill call's `[L, P, T, K, H]` (shared by the P prefixes of one
    `prefill_batch`, never copied per prompt); this prompt is row `row`. With G > 1, the first
    `insert` on a replica writes the prompt into fresh pages of that replica's pool and the prefix
    keeps a reference to the full ones (`shared_pages[replica]`); later inserts on that replica
    share them. The reference is dropped when all G samples are inserted, or by
    `Engine.release_prefix`.
    """

    k: jax.Array
    v: jax.Array
    row: int
    prompt_ids: np.ndarray
    sampling: SamplingConfig
    seeds: np.ndarray
    first_tokens: np.ndarray
    first_logprobs: np.ndarray
    first_top: Any = None  # host `TopLogprobs` [G, K] of the first tokens, when the prefill computed them
    routes: np.ndarray | None = None  # host [n, Ls, K]: the prompt's experts per sparse layer (router replay)
    shared_pages: dict[int, list[int]] | None = None  # replica -> its copy's full prompt pages
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
