"""A multi-process run (2 processes x 4 CPU devices, `tpurl launch`, gloo collectives) against the
same run in one process over 8 devices, and a 2-process resume against the uninterrupted 2-process
run. Runs `tpurl` in subprocesses, as a user would.

What must agree exactly: the sampled trajectories (tokens, rewards, advantages), every logged
integer and every metric computed on the host from them, and the evaluations. Float metrics that
are reductions over devices (entropy, ratio and mismatch means) sum their per-device parts across processes
through gloo and within a process through XLA, in another order than one process does over 8
devices: they agree to float32 rounding (1e-6), not always bit for bit; so does the exported policy.
A 2-process run resumed from the 2-process run's checkpoint repeats its step (metrics,
trajectories, evaluation, exported weights) bit for bit."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from multiprocess_helpers import ROOT, cpu_env
from tpurl.logging import read_jsonl

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

GIN = os.path.join(ROOT, "configs", "test_tiny.gin")
# Clocks, compile caches and memory differ between runs.
VOLATILE = ("time", "throughput/", "memory/", "compile/", "timeline/", "rollout_side/")
# Two steps, a checkpoint after each and the final policy exported; pass@k sampling in the
# evaluation is left out (compile time).
ARGS = ["train", "--quiet", "--gin_file", GIN, "--gin_param", "tpurl.RLConfig.steps=2",
        "--gin_param", "tpurl.CheckpointConfig.every_steps=1", "--gin_param", "tpurl.CheckpointConfig.export_hf=True",
        "--gin_param", "tpurl.EvalConfig.pass_k=1"]


def _env(devices: int, cache_dir=None) -> dict[str, str]:
    env = cpu_env(devices)
    if cache_dir is not None:  # the resumed run reuses the first 2-process run's compiled programs
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tpurl", *cmd], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]


def _two_processes(run_dir, cache_dir, *extra) -> subprocess.Popen:
    return _start(["launch", "-n", "2", "--devices-per-process", "4", "--", *ARGS,
                   "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'", *extra], _env(4, cache_dir))


# Disaggregated: 4 train + 4 rollout devices; in the 2-process run each process gives 2 of its 4 to
# each pool (`PlacementConfig.device_split="per_process"`), and the weight sync is the permute. Two
# minibatches of two micro-batches each: the update gathers its rows across processes.
DISAGGREGATED = ["--gin_param", "tpurl.algorithm_preset.minibatches=2",
                 "--gin_param", "tpurl.algorithm_preset.micro_batches=2",
                 "--gin_param", "tpurl.PlacementConfig.mode='disaggregated'",
                 "--gin_param", "tpurl.PlacementConfig.train_devices=4",
                 "--gin_param", "tpurl.PlacementConfig.rollout_devices=4",
                 "--gin_param", "train/tpurl.MeshConfig.shape=(1, 2, 2)",
                 "--gin_param", "rollout/tpurl.MeshConfig.shape=(2, 1, 2)"]


def _logs(run_dir, name: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_jsonl(str(run_dir / name))]


def _assert_equal_up_to_reduction_order(got: list[dict], want: list[dict]) -> None:
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want):
        inexact = {k for k in w if g[k] != w[k]}
        assert all(isinstance(w[k], float) and isinstance(g[k], float) for k in inexact), inexact
        np.testing.assert_allclose([g[k] for k in sorted(inexact)], [w[k] for k in sorted(inexact)],
                                   rtol=1e-6, atol=1e-6, err_msg=str(sorted(inexact)))


def _exported(run_dir) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_two_processes_match_one_and_resume_exactly(tmp_path, placement):
    extra = DISAGGREGATED if placement == "disaggregated" else []
    multi, single, resumed = tmp_path / "multi", tmp_path / "single", tmp_path / "resumed"
    cache = tmp_path / "jax-cache"
    # Side by side: the 2-process run spends part of its time waiting on its collectives.
    reference = _start([*ARGS, "--gin_param", f"tpurl.LoggingConfig.run_dir='{single}'", *extra], _env(8))
    _finish(_two_processes(multi, cache, *extra))
    _finish(reference)

    # Process 0 alone claimed the directory and wrote the run's files (no sibling run directory).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jax-cache", "multi", "single"]
    assert sorted(os.listdir(multi)) == sorted(os.listdir(single))
    assert [r["step"] for r in read_jsonl(str(multi / "metrics.jsonl"))] == [1, 2]
    # Identical rollouts: the engine took the same scheduling decisions on both processes as in one.
    assert _logs(multi, "trajectories.jsonl") == _logs(single, "trajectories.jsonl")
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(_logs(multi, "metrics.jsonl"), _logs(single, "metrics.jsonl"))
    # The export gathered every process's shards (a missing shard would be zeros or garbage).
    got, want = _exported(multi), _exported(single)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)

    # Resume from the 2-process run's checkpoint of step 1 in a 2-process run: step 2 repeats exactly.
    shutil.copytree(multi, resumed, ignore=shutil.ignore_patterns("2", "summary.json", "report", "export"))
    _finish(_two_processes(resumed, cache, "--resume", *extra))
    assert (resumed / "manifest.resume-1.json").exists()  # it continued from step 1
    assert [r["step"] for r in read_jsonl(str(resumed / "metrics.jsonl"))] == [1, 2]
    assert _logs(resumed, "metrics.jsonl") == _logs(multi, "metrics.jsonl")
    assert _logs(resumed, "trajectories.jsonl") == _logs(multi, "trajectories.jsonl")
    assert _logs(resumed, "eval.jsonl") == _logs(multi, "eval.jsonl")
    got, want = _exported(resumed), _exported(multi)
    assert all(np.array_equal(got[name], want[name]) for name in want)
