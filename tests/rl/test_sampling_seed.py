"""A step samples with a seed of its own: the same step draws the same tokens, and consecutive
steps draw different ones for the same prompts and weights (a seed that ignored the step would
replay one sample of every problem for the whole run)."""

import dataclasses

import pytest

from algo_helpers import fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step, step_seed
from tpurl.train.config import algorithm_preset


def test_step_seed_depends_on_every_input():
    assert len({step_seed(0, step) for step in range(64)}) == 64
    assert step_seed(0, 3) == step_seed(0, 3)
    assert step_seed(0, 3) != step_seed(1, 3) and step_seed(0, 3) != step_seed(0, 3, salt=1)


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    cfg = tiny_rl_config(tmp_path_factory.mktemp("seed"), algorithm_preset("grpo", group_size=4))
    return RLRuntime(*prepare(cfg))


def _sampled(rt, step: int) -> dict[tuple[str, int], tuple[int, ...]]:
    """Completion ids by (problem, sample) of RL step `step`, from fresh weights at data cursor 0."""
    _, _, records, _ = rl_step(rt, dataclasses.replace(fresh_state(rt), step=step))
    return {(r["problem_uid"], r["sample_index"]): tuple(r["completion_ids"]) for r in records}


@pytest.mark.slow
def test_consecutive_steps_sample_differently(rt):
    first, replay, second = _sampled(rt, 0), _sampled(rt, 0), _sampled(rt, 1)
    assert first == replay  # the step alone decides the draw, so a difference below is the seed's
    assert first.keys() == second.keys() and len(first) == rt.cfg.batch_size  # the same problems
    differ = sum(first[k] != second[k] for k in first)
    assert differ >= len(first) // 2, f"only {differ} of {len(first)} samples changed between steps"
