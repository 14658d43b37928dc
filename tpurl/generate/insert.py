"""Batched insert: many sequences placed in their decode slots by one program.

Letters: B decode slots, W sequences inserted by one call (padded to a power of two), P prompts of
the prefill call the sequences come from, T prompt positions, M max pages per sequence, L layers,
K kv heads, H head_dim.

The engine validates the requests and its page book (`tpurl.generate.page_book`) allocates their
pages; this module turns those into index arrays (`page_arrays`), builds the per-slot field values
and writes everything on device in one program: the prompts' k/v into the cache, the page-table
rows, the slot fields. Padding rows (past the W real ones) carry the out-of-range slot
`B` and sentinel pages, so every one of their writes is dropped.

Paged cache: a group's first sequence writes its whole prompt (one scatter per prefill row, from
the prefill's `[L, P, T, K, H]` directly); each later sequence of the group shares the full pages
and writes only its own partial last page (`kv_cache.write_tails`). So a prompt is written once
whatever G is. Dense cache: every sequence gets its own copy of the prompt (the dense layout).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tpurl.generate import kv_cache
from tpurl.generate.attention import KernelSharding, on_replicas, spec_entry
from tpurl.generate.page_book import Placement


def check_inserts(requests, max_slots: int, busy: Callable[[int], bool]) -> None:
    """Raise a one-line ValueError unless every `(prefix, slot, sample_index)` of `requests` goes to
    a free slot (`busy(slot)` False, none twice), names a sample of its prefix not yet inserted, and
    all prefixes come from one prefill call."""
    slots, samples = set(), set()
    for prefix, slot, k in requests:
        if not 0 <= slot < max_slots:
            raise ValueError(f"insert: slot {slot} is outside [0, {max_slots})")
        if busy(slot) or slot in slots:
            raise ValueError(f"insert: slot {slot} is busy; call free_resource({slot}) when its sequence ends")
        if not 0 <= k < prefix.num_samples:
            raise ValueError(f"insert: sample_index {k} is outside [0, {prefix.num_samples}) for this prefix")
        if prefix.inserted[k] or (id(prefix), k) in samples:
            raise ValueError(f"insert: sample {k} of this prefix was already inserted")
        if prefix.k is not requests[0][0].k:
            raise ValueError("insert_batch: the prefixes come from different prefill calls; insert each "
                             "call's samples with its own insert_batch")
        slots.add(slot)
        samples.add((id(prefix), k))


def page_arrays(shape: kv_cache.PagedCacheShape, requests, placements: list[Placement], width: int,
                num_rows: int) -> dict[str, np.ndarray]:
    """The paged insert's index arrays for `requests` at their `placements` (`PageBook.allocate`).

    A prompt's first copy on a replica (`shared=None`) is written whole from its prefill row; a
    later sample there writes only past its shared pages (its own partial last prompt page).
    `num_rows`: the prefill call's rows. Per-replica arrays have a leading `[R]` axis (split over
    the replicas on device): a replica's row holds its own writes and sentinels elsewhere.
    """
    sentinel, m, page_size = shape.num_pages, shape.max_pages_per_seq, shape.page_size
    r_count = shape.replicas
    table_WM = np.full((width, m), sentinel, np.int32)
    fresh_RWM = np.full((r_count, width, m), sentinel, np.int32)
    first_table_RPM = np.full((r_count, num_rows, m), sentinel, np.int32)
    first_length_P = np.zeros(num_rows, np.int32)
    tail_page_RW = np.full((r_count, width), sentinel, np.int32)
    tail_start_W = np.zeros(width, np.int32)
    for i, ((prefix, _, _), place) in enumerate(zip(requests, placements)):
        r, pages = place.replica, place.pages
        table_WM[i, :len(pages)] = pages
        if place.shared is None:
            fresh_RWM[r, i, :len(pages)] = pages
            first_table_RPM[r, prefix.row, :len(pages)] = pages
            first_length_P[prefix.row] = prefix.true_length
        else:
            own = pages[place.shared:]
            fresh_RWM[r, i, :len(own)] = own
            # Positions before shared * page_size are in the shared pages, already written.
            tail_start_W[i] = place.shared * page_size
            if own:
                tail_page_RW[r, i] = own[0]
    return {"table_WM": table_WM, "fresh_RWM": fresh_RWM, "first_table_RPM": first_table_RPM,
            "first_length_P": first_length_P, "tail_page_RW": tail_page_RW, "tail_start_W": tail_start_W}


def slot_fields(requests, width: int, max_stop_tokens: int) -> dict[str, np.ndarray]:
    """The decode-state fields of each inserted sequence, `[width]` each (padding rows inert).

    `requests`: `(prefix, slot, sample_index)` triples. A sequence starts with its first token
    (sampled by the prefill) as the next input, `lengths` = prompt length cached positions, one
    token generated; it is inactive from the start when that first token already ends it.
    """
    fields = {"tokens": np.zeros(width, np.int32), "lengths": np.zeros(width, np.int32),
              "active": np.zeros(width, bool), "seeds": np.zeros(width, np.uint32),
              "steps": np.ones(width, np.int32), "remaining": np.zeros(width, np.int32),
              "temperature": np.ones(width, np.float32), "top_k": np.zeros(width, np.int32),
              "top_p": np.ones(width, np.float32), "stop_ids": np.full((width, max_stop_tokens), -1, np.int32)}
    for i, (prefix, _, k) in enumerate(requests):
        s = prefix.sampling
        fields["tokens"][i] = prefix.first_tokens[k]
        fields["lengths"][i] = prefix.true_length
        fields["active"][i] = not prefix.finished_at_first_token(k)
        fields["seeds"][i] = prefix.seeds[k]
        fields["remaining"][i] = s.max_new_tokens - 1
        fields["temperature"][i], fields["top_k"][i], fields["top_p"][i] = s.temperature, s.top_k, s.top_p
        fields["stop_ids"][i, :len(s.stop_token_ids)] = s.stop_token_ids
    return fields


def insert_sequences(state: dict, k_LPTKH: jax.Array, v_LPTKH: jax.Array, slot_W: jax.Array, row_W: jax.Array,
                     fields: dict[str, jax.Array], paged: dict[str, jax.Array] | None, *, poison: bool,
                     scrub: bool, sharding: KernelSharding | None = None) -> dict:
    """Write W sequences into a decode state (inside jit; the state is donated by the caller).

    `row_W`: each sequence's row of the prefill call. `paged` (None for the dense cache): the page
    arrays of `page_arrays` -- `table_WM` (page-table rows), `fresh_RWM` (each sequence's newly
    allocated pages), `first_table_RPM`/`first_length_P` (where each prefill row's whole prompt goes,
    sentinel rows for none) and `tail_page_RW`/`tail_start_W` (each later sample's own last prompt
    page), the `[R]` ones per replica pool. `poison` fills fresh pages (dense: the slot's line) with
    NaN first (isolation tests); `scrub` zeroes fresh pages first (the Pallas kernels read masked
    rows of a page). `sharding` with `page_axes`: the pool is split into per-replica pools and each
    replica writes its own under `shard_map` (page ids local).
    """
    state = dict(state)
    if paged is not None:
        def write(pool, k_LPTKH, v_LPTKH, row_W, length_W, fresh_RWM, first_table_RPM, first_length_P,
                  tail_page_RW, tail_start_W):
            # One replica's pool (or the only one): its `[R]` rows are `[1]` here.
            if poison:  # simulate garbage in reused pages
                pool = kv_cache.fill_pages(pool, fresh_RWM[0], float("nan"))
            if scrub:
                pool = kv_cache.fill_pages(pool, fresh_RWM[0], 0.0)
            pool = kv_cache.write_prompts(pool, k_LPTKH, v_LPTKH, first_table_RPM[0], first_length_P)
            return kv_cache.write_tails(pool, k_LPTKH, v_LPTKH, row_W, tail_page_RW[0], tail_start_W, length_W)

        if sharding is not None:
            # Per-replica pools: every replica writes only its own pool, from its kv heads of the prompt.
            pool_s, r_s = sharding.pool_spec(2), P(spec_entry(sharding.page_axes))
            kv_s = P(None, None, None, spec_entry(sharding.kv_axes))
            write = on_replicas(write, sharding, (pool_s, kv_s, kv_s, P(), P(), r_s, r_s, P(), r_s, P()), pool_s)
        state["cache"] = write(state["cache"], k_LPTKH, v_LPTKH, row_W, fields["lengths"], paged["fresh_RWM"],
                               paged["first_table_RPM"], paged["first_length_P"], paged["tail_page_RW"],
                               paged["tail_start_W"])
        state["page_table"] = state["page_table"].at[slot_W].set(paged["table_WM"], mode="drop")
    else:
        t_T = jnp.arange(k_LPTKH.shape[2], dtype=jnp.int32)
        cache = {}
        for name, x_LPTKH in (("k", k_LPTKH), ("v", v_LPTKH)):
            line = state["cache"][name]
            if poison:
                line = line.at[:, slot_W].set(jnp.nan, mode="drop")
            # Rows [0, T) of each slot's line; rows past the true length are bucket padding, which
            # decode masks by length.
            cache[name] = line.at[:, slot_W[:, None], t_T[None, :]].set(
                kv_cache.to_cache(x_LPTKH[:, row_W], line.dtype), mode="drop")
        state["cache"] = cache
    for name, value_W in fields.items():
        state[name] = state[name].at[slot_W].set(value_W.astype(state[name].dtype), mode="drop")
    return state
