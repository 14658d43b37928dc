"""Rollouts on the engine: continuous batching over slots and group sampling with shared prompts.

`generate(engine, params, prompts, n_samples=G, sampling=..., seed=...)` returns `[prompt][sample]`
completions. Each prompt is prefilled once and its G samples share the prompt's full KV pages
(`share_prompt=False` prefills every sample separately: the baseline the sharing is checked
against; both give the same tokens for the same seed). Whenever a sequence finishes, its slot and
pages are freed and waiting samples are inserted before the next decode step. A sample whose pages
are not free yet waits for running sequences to finish; a request that could never fit is rejected
before any work.

Admission runs in waves, in first-come order: a wave places the waiting samples of prompts already
prefilled, then takes as many new work items as the free slots and pages allow, prefills their
prompts in one `prefill_batch` call (first tokens included) and inserts all the samples that fit
with one `insert_batch` call per prefill call. With one page pool per data replica (see
`EngineConfig`), a sample goes to a free slot of a replica whose own pool has its pages, preferring
a replica that already holds its prompt's pages (samples of one prompt share pages only within a
replica); when no replica has room, it waits for that.

Sample j of prompt i draws with `request_seed(seed, i, j)`, so results do not depend on slot
assignment, batch composition, sharing or the number of slots.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import numpy as np

from tpurl.generate.engine import Engine, Prefix
from tpurl.generate.pool import KVPool
from tpurl.generate.sampling import SamplingConfig, request_seed


@dataclasses.dataclass
class Completion:
    """One sampled continuation. `token_ids` include the stop token when stopped by one;
    `logprobs[t]` is `log_softmax(logits / T)[token_ids[t]]` (float32, see sampling.py)."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # "stop" (stop token or stop string) | "length" (max_new_tokens)
    prompt_index: int
    sample_index: int


@dataclasses.dataclass
class _Prefilled:
    """A prefilled work item: its prefix and the (prefix sample, sample index) pairs still to place."""

    prefix: Prefix
    prompt_index: int
    pending: collections.deque


@dataclasses.dataclass
class _Running:
    prompt_index: int
    sample_index: int
    tokens: list[int]
    logprobs: list[float]


def _stop_string_hit(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    if not stop_strings:
        return False
    # A stop string can only have been completed by the newest token, so decoding a tail that is
    # long enough to contain any stop string (each kept token is >= 1 character) suffices.
    tail = tokens[-(4 * max(len(s) for s in stop_strings) + 8):]
    text = tokenizer.decode(tail)
    return any(s in text for s in stop_strings)


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], *, n_samples: int,
             sampling: SamplingConfig, seed: int, tokenizer=None, share_prompt: bool = True,
             pool: KVPool | None = None) -> list[list[Completion]]:
    """Sample `n_samples` completions of every prompt (token ids); see the module docstring.

    The KV pool: pass `pool` (its owner keeps it, e.g. for several calls, and frees it) or let the
    call allocate one for itself, freed before it returns.
    """
    if pool is None:
        with KVPool(engine) as own:
            return generate(engine, params, prompts, n_samples=n_samples, sampling=sampling, seed=seed,
                            tokenizer=tokenizer, share_prompt=share_prompt, pool=own)
    if pool.engine is not engine:
        raise ValueError("generate: the KV pool belongs to another engine")
    if n_samples < 1:
        raise ValueError(f"generate: n_samples must be >= 1, got {n_samples}")
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("generate: SamplingConfig.stop_strings needs a tokenizer (pass tokenizer=...)")
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    for i, p in enumerate(prompts):  # reject what can never run before doing any work
        try:
            engine.check_request(len(p), sampling.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None

    # Work items: (prompt index, sample indices prefilled together).
    groups = [list(range(n_samples))] if share_prompt else [[j] for j in range(n_samples)]
    work = collections.deque((i, g) for i in range(len(prompts)) for g in groups)
    results: list[list[Completion | None]] = [[None] * n_samples for _ in prompts]
    stop_ids = set(sampling.stop_token_ids)

    def finish(i, j, tokens, logprobs):
        last = tokens[-1]
        reason = "stop" if last in stop_ids or _stop_string_hit(tokenizer, tokens, sampling.stop_strings) else "length"
        results[i][j] = Completion(prompt_ids=prompts[i], token_ids=np.asarray(tokens, np.int32),
                                   logprobs=np.asarray(logprobs, np.float32), finish_reason=reason,
                                   prompt_index=i, sample_index=j)

    # Free slots per data replica (each replica has its own page pool), lowest slot used first.
    replicas = engine.replicas
    free_slots = [[s for s in range(engine.max_concurrent_decodes - 1, -1, -1) if engine.replica_of(s) == r]
                  for r in range(replicas)]
    running: dict[int, _Running] = {}
    prefilled: collections.deque[_Prefilled] = collections.deque()  # first-come order
    max_batch = engine.config.max_prefill_batch

    def first_token_ends(item: _Prefilled, k: int) -> bool:
        tok = int(item.prefix.first_tokens[k])
        return item.prefix.finished_at_first_token(k) or _stop_string_hit(tokenizer, [tok], sampling.stop_strings)

    while work or prefilled or running:
        # One admission wave: plan (item, prefix sample, sample index) placements in order, within
        # the free slots and pages, prefilling new work items while there is room; then insert.
        plan: list[tuple[_Prefilled, int, int, int]] = []  # (item, prefix sample, sample index, replica)
        planned: collections.Counter = collections.Counter()  # samples planned per (item, replica)
        slots_left = [len(f) for f in free_slots]
        pages_left = [engine.free_pages(r) if engine.paged else float("inf") for r in range(replicas)]
        blocked = progressed = False

        def place(item: _Prefilled) -> tuple[int, int] | None:
            """(replica, fresh pages) for the item's next sample: a replica with a free slot whose
            pool has the pages, preferring one that already holds (or gets) the prompt's pages."""
            best = None
            for r in range(len(slots_left)):
                if not slots_left[r]:
                    continue
                n = planned[(id(item), r)]
                need = engine.pages_needed(item.prefix, n + 1, r) - engine.pages_needed(item.prefix, n, r)
                if need <= pages_left[r]:
                    key = (need, -pages_left[r], r)
                    if best is None or key < best[0]:
                        best = (key, r, need)
            return None if best is None else best[1:]

        while True:
            for item in prefilled:
                while item.pending and sum(slots_left):
                    k, j = item.pending[0]
                    if first_token_ends(item, k):
                        item.pending.popleft()
                        finish(item.prompt_index, j, [int(item.prefix.first_tokens[k])],
                               [float(item.prefix.first_logprobs[k])])
                        progressed = True
                        continue
                    where = place(item)
                    if where is None:
                        blocked = True  # wait for running sequences to free pages (or slots)
                        break
                    r, need = where
                    item.pending.popleft()
                    plan.append((item, k, j, r))
                    planned[(id(item), r)] += 1
                    slots_left[r] -= 1
                    pages_left[r] -= need
                if item.pending:
                    break  # later prompts wait behind this one
            if blocked or not sum(slots_left) or not work or any(item.pending for item in prefilled):
                break
            # Take the next work items while their samples would find slots and pages (an estimate
            # over all replicas: samples that end at their first token need neither, a group may
            # need its prompt on several replicas, and the next round takes more).
            take, est_slots, est_pages = [], sum(slots_left), sum(pages_left)
            most_free = max(p for p, n in zip(pages_left, slots_left) if n)
            while work and len(take) < max_batch and est_slots > 0:
                i, samples = work[0]
                n = min(len(samples), est_slots)
                first = engine.request_pages(len(prompts[i]), sampling.max_new_tokens)
                if first > est_pages or first > most_free:
                    break
                take.append(work.popleft())
                est_slots -= n
                est_pages -= engine.request_pages(len(prompts[i]), sampling.max_new_tokens, n)
            if not take:
                blocked = True
                break
            pairs = engine.prefill_batch(params=params, prompts=[prompts[i] for i, _ in take], sampling=sampling,
                                         seeds=[[request_seed(seed, i, j) for j in samples] for i, samples in take])
            for (i, samples), (prefix, _) in zip(take, pairs):
                prefilled.append(_Prefilled(prefix, i, collections.deque(enumerate(samples))))
            progressed = True
        # One insert per prefill call the planned samples come from (usually one).
        by_call: dict[int, list[tuple[_Prefilled, int, int, int]]] = {}
        for entry in plan:
            by_call.setdefault(id(entry[0].prefix.k), []).append(entry)
        for entries in by_call.values():
            slots = [free_slots[r].pop() for _, _, _, r in entries]
            requests = [(item.prefix, slot, k) for (item, k, _, _), slot in zip(entries, slots)]
            pool.insert_batch(requests)
            for (item, k, j, _), slot in zip(entries, slots):
                running[slot] = _Running(item.prompt_index, j, [int(item.prefix.first_tokens[k])],
                                         [float(item.prefix.first_logprobs[k])])
            progressed = True
        while prefilled and not prefilled[0].pending:
            engine.release_prefix(prefilled.popleft().prefix)
        if blocked and sum(slots_left):
            engine.stats["admission_waits"] += 1
        if not running:
            if not progressed:
                raise RuntimeError("generate: the KV pool cannot hold the next request even when idle "
                                   "(check_request should have rejected it)")
            continue
        result = jax.device_get(pool.step(params))
        for slot in list(running):
            if not result.valid[slot]:
                continue
            r = running[slot]
            r.tokens.append(int(result.tokens[slot]))
            r.logprobs.append(float(result.logprobs[slot]))
            if result.done[slot] or _stop_string_hit(tokenizer, r.tokens, sampling.stop_strings):
                finish(r.prompt_index, r.sample_index, r.tokens, r.logprobs)
                del running[slot]
                engine.free_resource(slot)
                free_slots[engine.replica_of(slot)].append(slot)
    return results
