"""Collecting a step's rollouts, with DAPO's dynamic sampling when the algorithm asks for it.

Without dynamic sampling a step samples `G` completions for each of the next `P` training
problems and scores them (one `rollout` and one `reward` phase). With it (`AlgorithmConfig.
dynamic_sampling`, the `dapo` preset), a group whose rewards are all equal carries no learning
signal, so it is dropped (`keep_groups`) and more problems are sampled, `P` at a time, until `P`
informative groups are pooled (`fill_groups`) or `DynamicSamplingConfig.max_extra_rounds` extra
rounds are spent. Every round has the same shapes (no recompilation) and its own sampling seed
derived from `(seed, step, round)`; the data cursor advances past every problem sampled, so a
resumed run repeats the same rounds.

If the rounds run out first, the batch is completed with dropped groups of the last round whose
`loss_mask` is zeroed: they keep the batch's fixed shape but add nothing to the loss, its
normalizers or the token metrics (counted as `dynamic/groups_padded`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tpurl.config_types import check_types
from tpurl.generate import generate
from tpurl.rl.batch import Rollouts, pack_rollouts
from tpurl.rl.timeline import Timeline
from tpurl.tasks import train_batch
from tpurl.train.advantages import fill_groups, keep_groups

@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """Bound on DAPO's resampling: at most `max_extra_rounds` rounds of `P` more prompts per step
    after the first (0: drop degenerate groups but never resample; the batch is padded)."""

    max_extra_rounds: int = 3

    def __post_init__(self):
        check_types(self)
        if self.max_extra_rounds < 0:
            raise ValueError(f"DynamicSamplingConfig.max_extra_rounds={self.max_extra_rounds} must be >= 0")


@dataclasses.dataclass
class Collected:
    """A step's rollouts: the packed batch (`P` groups), their completions, each group's data index
    (its trajectory `group_id`), the advanced cursor, the tokens generated in all rounds (dropped
    groups included) and the dynamic-sampling counters."""

    rollouts: Rollouts
    completions: list[list[Any]]
    group_ids: np.ndarray
    cursor: int
    tokens_generated: int
    metrics: dict[str, float]


def _objects(items, shape) -> np.ndarray:
    # Built element by element: numpy would otherwise try to unpack dataclasses / nested lists.
    arr = np.empty(len(items), object)
    for i, x in enumerate(items):
        arr[i] = x
    return arr.reshape(shape)


def _to_groups(ro: Rollouts, completions, ids: np.ndarray) -> dict[str, np.ndarray]:
    """A `Rollouts` as a dict of arrays with a leading prompt axis (what `fill_groups` pools)."""
    p, g = ro.rewards.shape
    per_row = {"tokens": ro.tokens, "valid": ro.valid, "loss_mask": ro.loss_mask,
               "rollout_logprobs": ro.rollout_logprobs, "completion_lengths": ro.completion_lengths}
    groups = {k: v.reshape((p, g) + v.shape[1:]) for k, v in per_row.items()}
    groups.update(rewards=ro.rewards, ids=ids, problems=_objects(ro.problems, (p,)),
                  finish_reasons=_objects(ro.finish_reasons, (p, g)), texts=_objects(ro.texts, (p, g)),
                  completions=_objects([c for group in completions for c in group], (p, g)))
    groups.update({f"component/{k}": v for k, v in ro.components.items()})
    return groups


def _from_groups(groups: dict[str, np.ndarray]) -> tuple[Rollouts, list[list[Any]], np.ndarray]:
    p, g = groups["rewards"].shape

    def rows(k):
        v = groups[k]
        return v.reshape((p * g,) + v.shape[2:])

    ro = Rollouts(tokens=rows("tokens"), valid=rows("valid"), loss_mask=rows("loss_mask"),
                  rollout_logprobs=rows("rollout_logprobs"), rewards=groups["rewards"],
                  components={k.split("/", 1)[1]: v for k, v in groups.items() if k.startswith("component/")},
                  completion_lengths=rows("completion_lengths"), finish_reasons=list(rows("finish_reasons")),
                  texts=list(rows("texts")), problems=list(groups["problems"]))
    completions = [list(group) for group in groups["completions"]]
    return ro, completions, np.asarray(groups["ids"], np.int64)


def _sample_round(rt, rollout_params, cursor: int, seed: int, tl: Timeline, decode_state=None):
    cfg, task = rt.cfg, rt.task
    problems, next_cursor = train_batch(task, cursor, cfg.prompts_per_step)
    with tl.phase("rollout"):
        prompts = [task.encode_prompt(p) for p in problems]
        completions = generate(rt.engine, rollout_params, prompts, n_samples=cfg.group_size, sampling=rt.sampling,
                               seed=seed, tokenizer=task.tokenizer, decode_state=decode_state)
        del decode_state  # donated to the engine; the pool goes with generate's last reference
    with tl.phase("reward"):
        ro = pack_rollouts(task, problems, completions, rt.seq_len)
    return ro, completions, np.arange(cursor, next_cursor), next_cursor


def round_seed(seed: int, round_index: int) -> int:
    """Sampling seed of a step's round: the step's own seed for round 0 (so a step samples the same
    first round with or without dynamic sampling), a derived one for the extra rounds."""
    if round_index == 0:
        return seed
    return int(np.random.default_rng([seed, round_index]).integers(0, 2**31 - 1))


def collect_rollouts(rt, rollout_params, *, seed: int, cursor: int, tl: Timeline, decode_state=None) -> Collected:
    """Sample and score a step's `P` groups starting at data index `cursor`, with the step's
    sampling `seed` (see the module docstring). `decode_state`: a fresh decode state (e.g. the
    colocated handover's KV pool) for the first round; later rounds allocate their own. Metrics with dynamic sampling: `dynamic/rounds`,
    `dynamic/groups_sampled`, `dynamic/groups_dropped`, `dynamic/groups_padded`."""
    cfg = rt.cfg
    ro, completions, ids, cursor = _sample_round(rt, rollout_params, cursor, seed, tl, decode_state)
    del decode_state  # donated: an extra round must not find the first round's pool still referenced here
    if not cfg.algorithm.dynamic_sampling:
        return Collected(ro, completions, ids, cursor, ro.num_tokens, {})

    num_prompts = cfg.prompts_per_step
    pool, full, rounds, dropped, tokens = None, False, 0, 0, 0
    while True:
        rounds += 1
        tokens += ro.num_tokens
        keep = np.asarray(keep_groups(ro.rewards))
        dropped += int((~keep).sum())
        groups = _to_groups(ro, completions, ids)
        pool, full = fill_groups(pool, groups, keep, num_prompts)
        if full or rounds > cfg.dynamic_sampling.max_extra_rounds:
            break
        ro, completions, ids, cursor = _sample_round(rt, rollout_params, cursor, round_seed(seed, rounds), tl)
    padded = 0 if full else num_prompts - len(pool["rewards"])
    if padded:
        # The last round had fewer than `padded` keepers, so it has at least `padded` dropped groups.
        filler = {k: v[~keep][:padded].copy() for k, v in groups.items()}
        filler["loss_mask"][...] = 0.0
        pool, full = fill_groups(pool, filler, np.ones(padded, bool), num_prompts)
        assert full
    ro, completions, ids = _from_groups(pool)
    metrics = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(rounds * num_prompts),
               "dynamic/groups_dropped": float(dropped), "dynamic/groups_padded": float(padded)}
    return Collected(ro, completions, ids, cursor, tokens, metrics)
