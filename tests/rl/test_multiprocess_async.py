"""Asynchronous RL across processes (2 processes x 4 CPU devices, gloo) against the same run in one
process over 8 devices: `max_staleness=1` on disaggregated pools, the rollout on the main thread
(`AsyncConfig.overlap="dispatch"`: one thread issues every cross-process collective; two threads
doing so at once deadlock), with in-flight weight updates (`in_flight="continue"`), their landings
pinned alike in both runs (tests/rl/inflight_landing.py): update 0's weights are loaded between
batches 2 and 3 (by `load_next`, the path "drain" takes for every load), update 1's before batch
3's third decode round, a sync across the processes in the middle of decoding, where both
processes must agree that the update has finished. A file of its own, so that the test runner can
run it beside the other multi-process runs."""

import pytest
import json
import os
import subprocess
import sys

from multiprocess_helpers import run_workers
from test_multiprocess_run import ARGS, DISAGGREGATED, ROOT, _assert_equal_up_to_reduction_order, _env, _finish, _logs
from tpurl.logging import read_jsonl

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

# Three steps and no checkpoint or evaluation between them: batch 2 is sampled beside update 1,
# and batch 3 beside update 2.
ASYNC = [*DISAGGREGATED, "--gin_param", "tpurl.RLConfig.steps=3",
         "--gin_file", os.path.join(ROOT, "configs", "async.gin"),
         "--gin_param", "tpurl.AsyncConfig.overlap='dispatch'", "--gin_param", "tpurl.AsyncConfig.in_flight='continue'",
         "--gin_param", "tpurl.CheckpointConfig.every_steps=0", "--gin_param", "tpurl.CheckpointConfig.export_hf=False"]
LANDINGS = [os.path.join(ROOT, "tests", "rl", "inflight_landing.py"), json.dumps({1: None, 2: 3})]


def _run(multi, single):
    """The pinned run in one process (8 devices) beside two (4 devices each)."""
    def command(run_dir):
        return [*LANDINGS, *ARGS, "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'", *ASYNC]

    reference = subprocess.Popen([sys.executable, *command(single)], env=_env(8), cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_workers(command(multi), num_processes=2, devices_per_process=4, timeout=600)
    except BaseException:  # never leave the one-process run behind
        reference.kill()
        reference.communicate()
        raise
    _finish(reference)


def test_async_in_flight_two_processes_match_one(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    _run(multi, single)
    metrics = _logs(multi, "metrics.jsonl")
    assert [(m["staleness/version_min"], m["staleness/version_max"]) for m in metrics] == [(0, 0), (0, 0), (1, 2)]
    assert [m["staleness/max"] for m in metrics] == [0, 1, 1]
    timed = read_jsonl(str(multi / "metrics.jsonl"))
    assert all(m["time/sample_ahead_s"] > 0 for m in timed[:2])
    assert _logs(multi, "trajectories.jsonl") == _logs(single, "trajectories.jsonl")
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(metrics, _logs(single, "metrics.jsonl"))
