"""Asynchronous RL across processes (2 processes x 4 CPU devices, gloo) against the same run in one
process over 8 devices: `max_staleness=1` on disaggregated pools, the rollout on the main thread
(`AsyncConfig.overlap="dispatch"`: one thread issues every cross-process collective; two threads
doing so at once deadlock), with `in_flight="drain"` and "continue".

The drain run's task is the calculator, a multi-turn environment whose episodes call a tool
between model turns: only process 0 runs the environments and the graders; which episodes
answered at a decode step, their observations and the rewards go to the other process over the
rollout devices (while the update runs on the train devices), so both resume the same sequences
with the same tokens. A file of its own, so that the test runner can run it beside the other
multi-process runs; the runs share a compilation cache."""

import json
import os
import subprocess
import sys

import pytest

from multiprocess_helpers import run_workers
from test_multiprocess_run import ARGS, DISAGGREGATED, ROOT, _assert_equal_up_to_reduction_order, _env, _finish, _logs
from tpurl.logging import read_jsonl

# Three steps and no checkpoint or evaluation between them: batch 2 is sampled beside update 1,
# and batch 3, with version 1 (loaded across the processes before update 2), beside update 2.
ASYNC = [*DISAGGREGATED, "--gin_param", "tpurl.RLConfig.steps=3",
         "--gin_file", os.path.join(ROOT, "configs", "async.gin"),
         "--gin_param", "tpurl.AsyncConfig.overlap='dispatch'", "--gin_param", "tpurl.CheckpointConfig.every_steps=0",
         "--gin_param", "tpurl.CheckpointConfig.export_hf=False"]
# In-flight, the landings pinned alike in both runs (tests/rl/inflight_landing.py): update 0's
# weights are loaded between batches 2 and 3 (by `load_next`, across the processes), update 1's
# before batch 3's third decode round, a sync across the processes in the middle of decoding,
# where both processes must agree that the update has finished.
LANDINGS = [os.path.join(ROOT, "tests", "rl", "inflight_landing.py"), json.dumps({1: None, 2: 3})]
CONTINUE = [*ASYNC, "--gin_param", "tpurl.AsyncConfig.in_flight='continue'"]
CALCULATOR = [*ASYNC, "--gin_param", "tpurl.TaskConfig.name='calculator'",
              "--gin_param", "tpurl.TaskConfig.calculator=@tpurl.CalculatorConfig()",
              "--gin_param", "tpurl.CalculatorConfig.digits=1", "--gin_param", "tpurl.CalculatorConfig.num_eval=8"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


def _run(multi, single, program: list[str], extra: list[str], cache):
    """`python PROGRAM train ...` in one process (8 devices) beside two (4 devices each)."""
    def command(run_dir):
        return [*program, *ARGS, "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'", *extra]

    reference = subprocess.Popen([sys.executable, *command(single)], env=_env(8, cache), cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_workers(command(multi), num_processes=2, devices_per_process=4, timeout=600,
                    env=_env(4, cache))
    except BaseException:  # never leave the one-process run behind
        reference.kill()
        reference.communicate()
        raise
    _finish(reference)


@pytest.mark.parametrize("in_flight, versions", [
    ("drain", [(0, 0), (0, 0), (1, 1)]),
    ("continue", [(0, 0), (0, 0), (1, 2)]),
])
def test_async_two_processes_match_one(tmp_path, cache, in_flight, versions):
    multi, single = tmp_path / "multi", tmp_path / "single"
    if in_flight == "drain":
        _run(multi, single, ["-m", "tpurl"], CALCULATOR, cache)
        called = [t for t in _logs(multi, "trajectories.jsonl") if t["turns"] > 1]
        assert called and all(not all(t["model_mask"]) for t in called)  # tool turns, masked out of the loss
    else:
        _run(multi, single, LANDINGS, CONTINUE, cache)
    metrics = _logs(multi, "metrics.jsonl")
    assert [(m["staleness/version_min"], m["staleness/version_max"]) for m in metrics] == versions
    assert [m["staleness/max"] for m in metrics] == [0, 1, 1]
    timed = read_jsonl(str(multi / "metrics.jsonl"))
    assert all(m["time/sample_ahead_s"] > 0 for m in timed[:2])
    assert _logs(multi, "trajectories.jsonl") == _logs(single, "trajectories.jsonl")
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(metrics, _logs(single, "metrics.jsonl"))
