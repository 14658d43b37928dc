"""DAPO dynamic sampling in the RL loop: degenerate groups are dropped and the batch refilled from
more prompts (bounded rounds, counted), or padded with loss-free groups when the rounds run out."""

import numpy as np
import pytest

from algo_helpers import BatchSpy, fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import TaskLengths, resolve_run
from tpurl.rl.step import rl_step
from tpurl.tasks import AdditionTask
from tpurl.tasks.base import Reward
from tpurl.train.config import AlgorithmConfig, algorithm_preset

G = 4


class CoinTask(AdditionTask):
    """Addition prompts with a reward of 1 when the completion starts with 1 or 2 (about one in
    eight of an untrained model's samples), so many groups are flat, not all. Records every score."""

    reward_components = ("lucky",)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scored: list[tuple[str, float]] = []
        self.constant = False

    def score(self, problem, completion, finish_reason):
        lucky = 0.0 if self.constant else float(completion[:1] in ("1", "2"))
        self.scored.append((problem.uid, lucky))
        return Reward(components={"lucky": lucky}, total=lucky)


def _flat_groups(scored):
    r = np.asarray([x for _, x in scored]).reshape(-1, G)
    return r.max(axis=1) == r.min(axis=1)


@pytest.mark.slow
def test_dapo_step_trains_only_on_informative_groups(tmp_path):
    cfg = tiny_rl_config(tmp_path, algorithm_preset("dapo", group_size=G, max_resample_rounds=6))
    task = CoinTask(prepare(cfg)[1].cfg)
    rt = RLRuntime(resolve_run(cfg, TaskLengths.of(task), 8), task)
    spy = BatchSpy(rt)
    state, metrics, records, _ = rl_step(rt, fresh_state(rt))

    p = cfg.prompts_per_step
    flat = _flat_groups(task.scored)
    rounds = len(flat) // p
    assert metrics["dynamic/rounds"] == rounds and metrics["dynamic/groups_sampled"] == rounds * p
    assert metrics["dynamic/groups_dropped"] == flat.sum() >= 1  # this seed samples flat groups
    assert metrics["dynamic/groups_padded"] == 0
    assert rounds > 1 and state.cursor == rounds * p  # every sampled problem is consumed
    # The update batch: P whole groups, none flat, each the earliest informative group sampled.
    (batch,) = spy.batches
    rewards = np.asarray([r["reward"] for r in records]).reshape(p, G)
    assert not (rewards.max(axis=1) == rewards.min(axis=1)).any()
    assert [r["group_id"] for r in records[::G]] == list(np.flatnonzero(~flat)[:p])
    assert np.all(np.abs(batch["advantages"].reshape(p, G)).max(axis=1) > 0)
    # Tokens generated count every round's completions, the dropped groups' too.
    assert batch["loss_mask"].sum() == sum(len(r["completion_ids"]) for r in records)
    assert metrics["rollout/tokens_generated"] > batch["loss_mask"].sum()

    # Out of rounds (none allowed) with only flat groups: the batch keeps its shape, padded with
    # groups that carry no loss. Same shapes, so the runtime's compiled programs are reused.
    rt.cfg = cfg.replace(algorithm=cfg.algorithm.replace(max_resample_rounds=0))
    task.constant = True
    _, metrics, _, _ = rl_step(rt, state)
    assert metrics["dynamic/rounds"] == 1 and metrics["dynamic/groups_padded"] == p
    assert metrics["dynamic/groups_dropped"] == p
    assert spy.batches[1]["loss_mask"].sum() == 0 and metrics["train/tokens"] == 0
    assert np.isfinite(metrics["train/loss"]) and metrics["train/skipped"] == 0


def test_dynamic_sampling_bound_is_validated():
    with pytest.raises(ValueError, match="max_resample_rounds=-1 must be >= 0"):
        AlgorithmConfig(max_resample_rounds=-1)
