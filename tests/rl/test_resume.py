"""SIGKILL in the middle of a run, then `--resume`: the steps after the restored checkpoint have
exactly the metrics of an uninterrupted run with the same seed (CPU). Runs `tpurl train` in
subprocesses, as a user would: a resume under a changed config is refused, and of two `--resume`
started together (a restart wrapper relaunching too early) one runs and the other is refused."""

import pytest
import json
import os
import signal
import subprocess
import sys
import time

from multiprocess_helpers import cpu_env
from tpurl.logging import read_jsonl

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")
# Wall-clock and memory readings legitimately differ between processes; everything else must not.
VOLATILE = ("time", "throughput/", "memory/", "compile/")
LAYOUT_NOTE = "WARNING:tpurl.sharding.layout"  # the tiny model's layout notes, logged as the runtime is built


def _cmd(run_dir, *extra):
    return [sys.executable, "-m", "tpurl", "train", "--quiet", "--gin_file", GIN,
            "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'",
            "--gin_param", "tpurl.RLConfig.steps=5", "--gin_param", "tpurl.CheckpointConfig.every_steps=2",
            "--gin_param", "tpurl.EvalConfig.every_steps=3", "--gin_param", "tpurl.EvalConfig.pass_k=1", *extra]


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    reference = subprocess.Popen(_cmd(ref_dir), env=cpu_env(8), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    victim = subprocess.Popen(_cmd(run_dir), env=cpu_env(8), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = run_dir / "checkpoints" / "2"
    deadline = time.time() + 600
    while not ckpt.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert victim.poll() is None, f"the run ended before it could be killed: {victim.stderr.read().decode()[-2000:]}"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (run_dir / "summary.json").exists()  # it really died mid-run
    killed_steps = [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl"))]
    assert killed_steps and max(killed_steps) < 5

    logs = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "trajectories.jsonl")}
    changed = subprocess.run(_cmd(run_dir, "--resume", "--gin_param", "tpurl.RLConfig.seed=7"), env=cpu_env(8),
                             capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2 and changed.stdout == "", changed.stderr[-3000:]
    refusal = changed.stderr.strip().splitlines()[-1]
    assert refusal.startswith("tpurl train: the config differs from the one checkpoint step ") and \
        refusal.endswith("seed 0 -> 7; resume with that config, or name the changes you intend with "
                         "--resume-changed seed"), changed.stderr
    assert {name: (run_dir / name).read_bytes() for name in logs} == logs  # nothing of the run changed

    racers = [subprocess.Popen(_cmd(run_dir, "--resume"), env=cpu_env(8), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    ended = [(p.communicate(timeout=600)[1], p.returncode) for p in racers]  # communicate: never a full pipe
    (won, won_err), (lost, lost_err) = sorted((code, err) for err, code in ended)
    assert won == 0, won_err[-3000:]
    said = [line for line in lost_err.splitlines() if not line.startswith(LAYOUT_NOTE)]
    assert lost == 2 and len(said) == 1, lost_err
    assert said[0].startswith(f"tpurl train: {run_dir} is in use by another run (pid "), lost_err
    assert not (run_dir / "traceback.txt").exists()
    assert reference.wait(timeout=600) == 0, reference.stderr.read().decode()[-3000:]

    (resume_manifest,) = run_dir.glob("manifest.resume-*.json")  # the first run's manifest.json stays
    restored = json.load(open(resume_manifest))["extra"]["resumed_from"]
    assert restored in (2, 4) and resume_manifest.name == f"manifest.resume-{restored}.json"
    assert json.load(open(run_dir / "manifest.json"))["extra"]["resumed_from"] is None
    got, want = (read_jsonl(str(d / "metrics.jsonl")) for d in (run_dir, ref_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # the killed run's lost steps were dropped
    after = [r for r in _stable(got) if r["step"] > restored]
    assert after and after == [r for r in _stable(want) if r["step"] > restored]
    got_eval, want_eval = (read_jsonl(str(d / "eval.jsonl")) for d in (run_dir, ref_dir))
    assert _stable(got_eval) == _stable(want_eval)
    got_traj, want_traj = (read_jsonl(str(d / "trajectories.jsonl")) for d in (run_dir, ref_dir))
    assert got_traj == want_traj  # every sampled trajectory, byte for byte
