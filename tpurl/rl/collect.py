"""Collecting a step's rollouts, with DAPO's dynamic sampling when the algorithm asks for it.

Without dynamic sampling a step samples `G` completions for each of the next `P` training
problems and scores them (one `rollout` and one `reward` phase). With it (`AlgorithmConfig.
dynamic_sampling`, the `dapo` preset), a group whose rewards are all equal carries no learning
signal, so it is dropped (`keep_groups`) and more problems are sampled, `P` at a time, until `P`
informative groups are pooled (`Rollouts.take` / `Rollouts.concat`) or
`AlgorithmConfig.max_resample_rounds` extra rounds are spent. Every round has the same shapes
(no recompilation), uses the rollout window's KV pool and has its own sampling seed derived from
`(seed, step, round)`; the data cursor advances past every problem sampled, so a resumed run
repeats the same rounds.

If the rounds run out first, the batch is completed with dropped groups of the last round whose
`loss_mask` is zeroed: they keep the batch's fixed shape but add nothing to the loss, its
normalizers or the token metrics (counted as `dynamic/groups_padded`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpurl.rl.batch import Rollouts
from tpurl.rl.timeline import Timeline
from tpurl.tasks import train_batch
from tpurl.train.advantages import keep_groups


@dataclasses.dataclass
class Collected:
    """A step's rollouts (`P` groups, each with its data index as `group_ids`), the advanced
    cursor, the tokens generated in all rounds (dropped groups included) and the dynamic-sampling
    counters."""

    rollouts: Rollouts
    cursor: int
    tokens_generated: int
    metrics: dict[str, float]


def _sample_round(rt, cursor: int, seed: int, tl: Timeline) -> tuple[Rollouts, int]:
    problems, next_cursor = train_batch(rt.task, cursor, rt.cfg.prompts_per_step)
    ro = rt.rollout.sample(problems, n=rt.cfg.group_size, seed=seed, temperature=rt.cfg.algorithm.temperature,
                           group_ids=range(cursor, next_cursor), tl=tl)
    return ro, next_cursor


def round_seed(seed: int, round_index: int) -> int:
    """Sampling seed of a step's round: the step's own seed for round 0 (so a step samples the same
    first round with or without dynamic sampling), a derived one for the extra rounds."""
    if round_index == 0:
        return seed
    return int(np.random.default_rng([seed, round_index]).integers(0, 2**31 - 1))


def collect_rollouts(rt, *, seed: int, cursor: int, tl: Timeline) -> Collected:
    """Sample and score a step's `P` groups starting at data index `cursor`, with the step's
    sampling `seed` (see the module docstring), on `rt.rollout` (inside its rollout window).
    Metrics with dynamic sampling: `dynamic/rounds`, `dynamic/groups_sampled`,
    `dynamic/groups_dropped`, `dynamic/groups_padded`."""
    ro, cursor = _sample_round(rt, cursor, seed, tl)
    if not rt.cfg.algorithm.dynamic_sampling:
        return Collected(ro, cursor, ro.num_tokens, {})
    num_prompts = rt.cfg.prompts_per_step
    kept: list[Rollouts] = []
    rounds = dropped = tokens = num_kept = 0
    while True:
        rounds += 1
        tokens += ro.num_tokens
        keep = np.asarray(keep_groups(ro.rewards))
        dropped += int((~keep).sum())
        kept.append(ro.take(keep))
        num_kept += int(keep.sum())
        if num_kept >= num_prompts or rounds > rt.cfg.algorithm.max_resample_rounds:
            break
        ro, cursor = _sample_round(rt, cursor, round_seed(seed, rounds), tl)
    padded = max(0, num_prompts - num_kept)
    if padded:
        # The last round had fewer than `padded` keepers, so it has at least `padded` dropped groups.
        kept.append(ro.take(np.flatnonzero(~keep)[:padded]).without_loss())
    batch = Rollouts.concat(kept).take(np.arange(num_prompts))
    metrics = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(rounds * num_prompts),
               "dynamic/groups_dropped": float(dropped), "dynamic/groups_padded": float(padded)}
    return Collected(batch, cursor, tokens, metrics)
