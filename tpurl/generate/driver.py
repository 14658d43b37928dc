"""Rollouts on the engine: continuous batching over slots and group sampling with shared prompts.

`generate(engine, params, prompts, n_samples=G, sampling=..., seed=...)` returns `[prompt][sample]`
completions. Each prompt is prefilled once and its G samples share the prompt's full KV pages
(`share_prompt=False` prefills every sample separately: the baseline the sharing is checked
against; both give the same tokens for the same seed). A request that could never fit is rejected
before any work.

`generate` runs a scheduler (`tpurl.generate.scheduler`) over work items (a prompt and the samples
prefilled together), in first-come order, one round at a time until no work is left:

* `wave`: one admission wave (`tpurl.generate.admission`): the waiting samples of prompts already
  prefilled go into free slots and pages, then as many new work items as those allow are
  prefilled in one `prefill_batch` call (first tokens included) and placed, until nothing more
  fits; a sample that its first token ends finishes there without a slot. The planned samples are
  inserted with one `insert_batch` call per prefill program they come from.
* `decode`: one decode step of every running sequence (`KVPool.step`; its results are read to
  the host one step later when pipelined, see below); `retire` appends the new tokens and
  finishes the sequences that ended, freeing their slots and pages before the next wave.

**Pipelined decode** (without an environment): `decode` dispatches step k+1 before it reads step
k's results, so the host's work on them (retire, the next round's wave, the next dispatch) runs
while the device computes step k+1; device programs run in dispatch order (each takes the decode
state the previous one returned). A sequence that step k ends is already idle on the device in step
k+1 when a stop token or the token budget ended it; one that a stop string ended (seen on the host
only) decodes one more token there, which is dropped: each step's results are taken only for the
sequences it ran (the same `Running`, not a later occupant of its slot), and the extra key/value
lands in that sequence's own pages before any later program can hand them to another. No step is
dispatched when the step in flight is the last of every running sequence (each reaches its token
budget there). With environments (`on_turn_end`) a stopped turn's slot is detached at once, so
every step is read before the next.

With one page pool per data replica (see `EngineConfig`), a sample goes to a replica whose own pool
has its pages (see `tpurl.generate.admission`); `engine.stats["admission_waits"]` counts the waves
that found free slots but not enough free pages.

Sample j of prompt i draws with `request_seed(seed, i, j)`, so results do not depend on slot
assignment, batch composition, sharing or the number of slots.

**Multi-turn** (`on_turn_end`, `tpurl.generate.episodes`): when a sequence's turn ends by a stop
token or stop string, the scheduler detaches it from its slot (its pages, and so its cached
positions, stay with it) and runs `on_turn_end(prompt_index, sample_index, token_ids)` on a bounded
thread pool (`tool_workers`). The slot takes another sequence at once, so a tool's latency costs no
decode slot, only the sequence's pages. The callback returns the environment's observation token
ids, or None to end the episode. `resume` (before each wave, so episodes in progress go first) puts
the answered sequences into free slots of their replicas and appends `[last sampled token] +
observation` to their pages at their positions (`Engine.extend_batch`, one program for all of
them); the model's next turn starts from the token sampled there. With nothing left to decode,
`decode` waits for the first environment to answer. The completion holds every token after the
prompt, `model_mask` marking the ones the model sampled. `max_new_tokens` bounds all of them (model
and environment); an observation that does not fit ends the episode (`finish_reason="length"`, the
observation dropped).

**In-flight weight updates** (`params` a `WeightSlot`, see `tpurl.generate.weights`): before each
round of resume, wave and decode the scheduler polls the slot; when newer weights were published
(by a sync on another thread), every later prefill, decode step and extend uses them, and every
token they sample carries their version (`Completion.versions`). Running sequences keep their KV
pages: the keys and values computed by the old weights stay, so a token sampled after the switch
is the new weights' prediction given the old weights' KV of the positions before it (exactly: a
forward of the new weights in which each layer attends to the old weights' keys and values at
those positions). What the switch changes is recorded per token, which is what an off-policy
correction needs: the behaviour logprobs are the ones the engine reports, per token. The old
weights are released at the switch; a pipelined step still running on them keeps their memory
until it finishes (PjRt frees a deleted buffer once the programs using it are done), and its
tokens carry the version it was dispatched with.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np

from tpurl.generate.engine import Engine
from tpurl.generate.episodes import Episodes, tool_pool
from tpurl.generate.pool import KVPool
from tpurl.generate.records import Completion, TurnEnd
from tpurl.generate.sampling import SamplingConfig, request_seed
from tpurl.generate.scheduler import _Scheduler
from tpurl.generate.weights import Weights, WeightSlot


def _checked_prompts(engine: Engine, pool: KVPool | None, prompts, *, n_samples: int, sampling: SamplingConfig,
                     tokenizer) -> list[np.ndarray]:
    """The prompts as int32 arrays, once the call is known to be able to run (checked before any work,
    the KV pool's allocation included)."""
    if pool is not None and pool.engine is not engine:
        raise ValueError("generate: the KV pool belongs to another engine")
    if n_samples < 1:
        raise ValueError(f"generate: n_samples must be >= 1, got {n_samples}")
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("generate: SamplingConfig.stop_strings needs a tokenizer (pass tokenizer=...)")
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    check_requests(engine, prompts, sampling)
    return prompts


def check_requests(engine: Engine, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                   names: Sequence[str] | None = None) -> None:
    """Raise a one-line ValueError if `engine` can never sample these prompts with `sampling` (its
    stop tokens and top logprobs, each prompt's length); the message names the prompt (`names[i]`,
    else `prompt i`)."""
    engine.check_sampling(sampling)
    for i, p in enumerate(prompts):
        try:
            engine.check_request(len(p), sampling.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"{names[i] if names is not None else f'prompt {i}'}: {e}") from None


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], *, n_samples: int,
             sampling: SamplingConfig, seed: int, tokenizer=None, share_prompt: bool = True,
             pool: KVPool | None = None, on_turn_end: TurnEnd | None = None,
             tool_workers: int = 8, version: int | None = None,
             before_step: Callable[[], None] | None = None, pipeline: bool = True) -> list[list[Completion]]:
    """Sample `n_samples` completions of every prompt (token ids); see the module docstring.

    `params`: the weights, or a `WeightSlot` to read them (and their version) from: the call holds
    the slot's weights and switches to newer ones published there between decode steps (in-flight
    weight updates). `version`: the policy version of plain `params` (default 0), stamped on every
    sampled token (`Completion.versions`). The KV pool: pass `pool` (its owner keeps it, e.g. for
    several calls, and frees it) or let the call allocate one for itself, freed before it returns.
    `on_turn_end`: run multi-turn episodes, the callback on at most `tool_workers` threads.
    `before_step()`: runs on the calling thread before each round (the poll of the slot, extends,
    prefills and a decode step); it may publish newer weights into the slot (an in-flight sync
    from the sampling thread itself), which this round switches to. `pipeline=False` reads every
    decode step before dispatching the next (the reference the pipelined decode is tested against).
    """
    if isinstance(params, WeightSlot):
        if version is not None:
            raise ValueError("generate: the version of a WeightSlot's weights comes from the slot; drop version=")
        slot = params
    else:
        slot = WeightSlot(Weights(params, 0 if version is None else version))
    prompts = _checked_prompts(engine, pool, prompts, n_samples=n_samples, sampling=sampling, tokenizer=tokenizer)
    if on_turn_end is not None and not engine.paged:
        raise ValueError("generate: multi-turn episodes (on_turn_end) resume sequences in their KV pages, which "
                         "needs the paged cache (EngineConfig.cache='paged')")
    run = functools.partial(_run, engine, slot, prompts, n_samples=n_samples, sampling=sampling, seed=seed,
                            tokenizer=tokenizer, share_prompt=share_prompt, on_turn_end=on_turn_end,
                            tool_workers=tool_workers, before_step=before_step, pipeline=pipeline)
    if pool is not None:
        return run(pool)
    with KVPool(engine) as own:
        return run(own)


def _run(engine: Engine, slot: WeightSlot, prompts: list[np.ndarray], pool: KVPool, *, n_samples: int,
         sampling: SamplingConfig, seed: int, tokenizer, share_prompt: bool, on_turn_end: TurnEnd | None,
         tool_workers: int, before_step: Callable[[], None] | None, pipeline: bool) -> list[list[Completion]]:
    """`generate`'s rounds over checked prompts with the KV pool `pool`."""
    results: list[list[Completion | None]] = [[None] * n_samples for _ in prompts]

    def collect(completion: Completion) -> None:
        results[completion.prompt_index][completion.sample_index] = completion

    with tool_pool(tool_workers if on_turn_end else 0) as tools:
        episodes = None if on_turn_end is None else Episodes(on_turn_end, tools, engine, prompts, sampling=sampling,
                                                            seed=seed)
        held, scheduler = slot.hold(), None
        try:
            scheduler = _Scheduler(engine, held, pool, tokenizer=tokenizer, episodes=episodes, pipeline=pipeline)
            for i, prompt in enumerate(prompts):
                scheduler.add(prompt, sampling=sampling, seeds=[request_seed(seed, i, j) for j in range(n_samples)],
                              share_prompt=share_prompt, on_finish=collect)
            while scheduler.busy:
                if before_step is not None:
                    before_step()
                scheduler.refresh(slot)
                scheduler.resume()
                scheduler.wave()
                scheduler.decode()
        finally:  # the weights held now: the scheduler may have switched from the first ones
            slot.release(held if scheduler is None else scheduler.weights)
    return results
