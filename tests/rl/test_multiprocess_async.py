"""Asynchronous RL across processes (2 processes x 4 CPU devices, `tpurl launch`, gloo) against the
same run in one process over 8 devices: `max_staleness=1` on disaggregated pools, the rollout on
the main thread (`AsyncConfig.overlap="dispatch"`: one thread issues every cross-process
collective; two threads doing so at once deadlock). A file of its own, so that the test runner
can run it beside the other multi-process runs."""

import os

from test_multiprocess_run import (ARGS, DISAGGREGATED, ROOT, _assert_equal_up_to_reduction_order, _env, _finish,
                                   _logs, _start, _two_processes)
from tpurl.logging import read_jsonl


# Asynchronous (`max_staleness=1`) on the disaggregated pools, the rollout on the main thread
# (`overlap="dispatch"`: one thread issues every cross-process collective). Three steps and no
# checkpoint or evaluation between them: batch 2 is sampled beside update 1, and batch 3, with
# version 1 (loaded across the processes before update 2), beside update 2.
ASYNC = [*DISAGGREGATED, "--gin_param", "tpurl.RLConfig.steps=3",
         "--gin_file", os.path.join(ROOT, "configs", "async.gin"),
         "--gin_param", "tpurl.AsyncConfig.overlap='dispatch'", "--gin_param", "tpurl.CheckpointConfig.every_steps=0",
         "--gin_param", "tpurl.CheckpointConfig.export_hf=False"]


def test_async_two_processes_match_one(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    reference = _start([*ARGS, "--gin_param", f"tpurl.LoggingConfig.run_dir='{single}'", *ASYNC], _env(8))
    _finish(_two_processes(multi, None, *ASYNC))
    _finish(reference)
    metrics = _logs(multi, "metrics.jsonl")
    assert [(m["staleness/version_max"], m["staleness/max"]) for m in metrics] == [(0, 0), (0, 1), (1, 1)]
    timed = read_jsonl(str(multi / "metrics.jsonl"))
    assert all(m["time/sample_ahead_s"] > 0 for m in timed[:2])
    assert _logs(multi, "trajectories.jsonl") == _logs(single, "trajectories.jsonl")
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(metrics, _logs(single, "metrics.jsonl"))
