"""A short RL run of a multi-turn environment (the calculator) end to end: multi-turn rollouts, the
loss mask, trajectories with turns, tool calls and per-token model masks."""

import pytest
import json
import os

import numpy as np

from algo_helpers import tiny_rl_config
from tpurl.logging import read_jsonl
from tpurl.rl.loop import run
from tpurl.tasks import CalculatorConfig, CalculatorEnv, TaskConfig
from tpurl.train.config import algorithm_preset

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes


def test_rl_on_the_calculator_runs_multi_turn_end_to_end(tmp_path):
    cfg = tiny_rl_config(tmp_path / "run", algorithm_preset("grpo", group_size=4), steps=2,
                         task=TaskConfig(name="calculator", calculator=CalculatorConfig(digits=1, num_eval=8)))
    result = run(cfg, verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    metrics = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert len(metrics) == 2 and all(np.isfinite(m["train/loss"]) for m in metrics)
    assert {"reward/tool_calls/mean", "reward/tool_error/mean", "rollout/turns/mean"} <= set(metrics[0])
    multi = [t for t in traj if t["turns"] > 1]
    assert multi  # a random policy closes brackets: malformed calls, answered "?|"
    for t in traj:
        assert set(t["rewards"]) == {"correct", "format", "tool_calls", "tool_error"}
        assert len(t["model_mask"]) == len(t["completion_ids"]) and t["model_mask"][0] == 1
        assert t["info"]["turns"] >= t["turns"] - 1 and t["info"]["tool_calls"] == t["rewards"]["tool_calls"]
        env_ids = [i for i, m in zip(t["completion_ids"], t["model_mask"]) if not m]
        bar = CalculatorEnv().tokenizer.encode("|")[0]
        # One result per call ("?|" or the product), but for a last one that no longer fit the budget.
        dropped = t["info"]["tool_calls"] - env_ids.count(bar)
        assert dropped == 0 or (dropped == 1 and t["finish_reason"] == "length")
    assert json.load(open(os.path.join(result.run_dir, "manifest.json")))["task"]["name"] == "calculator"
