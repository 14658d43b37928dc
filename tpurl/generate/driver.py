"""Rollouts on the engine: continuous batching over slots and group sampling with shared prompts.

`generate(engine, params, prompts, n_samples=G, sampling=..., seed=...)` returns `[prompt][sample]`
completions. Each prompt is prefilled once and its G samples share the prompt's full KV pages
(`share_prompt=False` prefills every sample separately: the baseline the sharing is checked
against; both give the same tokens for the same seed). Whenever a sequence finishes, its slot and
pages are freed and the next waiting sample is inserted before the next decode step. A sample whose
pages are not free yet waits for running sequences to finish; a request that could never fit is
rejected before any work.

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
             decode_state: dict | None = None) -> list[list[Completion]]:
    """Sample `n_samples` completions of every prompt (token ids); see the module docstring.

    The KV pool: pass `decode_state` (fresh from `engine.init_decode_state()`, e.g. allocated by a
    memory handover right after offloading the optimizer state) or let the call allocate one. Either
    way it is donated to the engine and the call drops the last reference on return, so the pool's
    memory is released when this function returns.
    """
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

    state = engine.init_decode_state() if decode_state is None else decode_state
    del decode_state  # the engine donates it; the caller's handle dies with the first step
    free_slots = list(range(engine.max_concurrent_decodes - 1, -1, -1))
    running: dict[int, _Running] = {}
    prefix: Prefix | None = None
    prefix_prompt, to_insert = -1, collections.deque()

    while work or to_insert or running:
        # Admit: fill free slots from the current prefix, prefilling the next prompt when needed.
        while free_slots:
            if not to_insert:
                if prefix is not None:
                    engine.release_prefix(prefix)
                    prefix = None
                if not work:
                    break
                prefix_prompt, samples = work.popleft()
                seeds = [request_seed(seed, prefix_prompt, j) for j in samples]
                prompt = prompts[prefix_prompt]
                prefix, first = engine.prefill(params=params, padded_tokens=prompt, true_length=len(prompt),
                                               sampling=sampling, seeds=seeds)
                to_insert = collections.deque(enumerate(samples))
            k, j = to_insert[0]
            tok, lp = int(prefix.first_tokens[k]), float(prefix.first_logprobs[k])
            if prefix.finished_at_first_token(k) or _stop_string_hit(tokenizer, [tok], sampling.stop_strings):
                to_insert.popleft()
                finish(prefix_prompt, j, [tok], [lp])
                continue
            if not engine.can_insert(prefix):
                engine.stats["admission_waits"] += 1
                break  # wait for running sequences to free pages
            to_insert.popleft()
            slot = free_slots.pop()
            state = engine.insert(prefix, state, slot, sample_index=k)
            running[slot] = _Running(prefix_prompt, j, [tok], [lp])
        if not running:
            if to_insert and not engine.can_insert(prefix):
                raise RuntimeError("generate: the KV pool cannot hold the next request even when idle "
                                   "(check_request should have rejected it)")
            continue
        state, result = engine.generate(params, state)
        result = jax.device_get(result)
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
                free_slots.append(slot)
    if prefix is not None:
        engine.release_prefix(prefix)
    del state  # the KV pool is released with the last reference to the decode state
    return results
