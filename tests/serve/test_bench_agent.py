"""`scripts/bench_agent.py` run as a script at a toy size: the same workload in process, through the
endpoint with the agents on a thread, and with the agents in a worker process (the script's
module reaches the worker, so its work must sit under its `__main__` guard), and every field of
its JSON present and positive."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_bench_agent_runs_all_three_ways():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_agent.py"), "--prompts", "4",
                          "--slots", "2", "--turns", "1", "--reps", "1"], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("environment", "endpoint", "endpoint_processes"):
        run = result["runs"][name]
        assert run["tokens"] > 0 and run["wall_s"] > 0 and len(run["walls_s"]) == 1
    assert result["runs"]["endpoint"]["tokens"] == result["runs"]["endpoint_processes"]["tokens"]
    assert result["ratio"] > 0 and result["ratio_processes"] > 0
