"""The RL loop end to end at tiny sizes on 8 fake devices: colocated and disaggregated runs, the
log and manifest schemas, the timeline adding up, and bad configs failing before any work."""

import json
import os
import time

import jax
import numpy as np
import pytest

from tpurl.checkpoint import CheckpointConfig
from tpurl.generate import EngineConfig
from tpurl.logging import MANIFEST_KEYS, TRAJECTORY_KEYS, LoggingConfig, read_jsonl
from tpurl.models import preset
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.rl.loop import prepare, run
from tpurl.rl.timeline import Timeline
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.tasks import AdditionConfig, TaskConfig
from tpurl.train.config import OptimizerConfig, algorithm_preset

MESH3 = ("data", "fsdp", "tensor")


def tiny_config(run_dir, **overrides) -> RLConfig:
    base = dict(
        seed=0, steps=2, batch_size=16,
        model=preset("tiny", hidden_size=32, intermediate_size=64, head_dim=8, num_heads=4, num_kv_heads=2),
        task=TaskConfig(addition=AdditionConfig(digits=1, num_eval=8, reverse_answer=True)),
        algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.01),
        optimizer=OptimizerConfig(lr=1e-3),
        placement=PlacementConfig(train_mesh=MeshConfig(axes=MESH3, shape=(1, 4, 2)),
                                  rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 4))),
        sft=SFTConfig(steps=2, batch_size=16, stop_at_accuracy=1.0, check_every=1, probe_problems=4),
        eval=EvalConfig(every_steps=1, pass_k=2),
        checkpoint=CheckpointConfig(every_steps=2, export_hf=True),
        logging=LoggingConfig(run_dir=str(run_dir), trajectory_sample_rate=1.0, progress_bar=False),
    )
    base.update(overrides)
    return RLConfig(**base)


STEP_KEYS = ("time/rollout_s", "time/reward_s", "time/advantages_s", "time/logprobs_s", "time/update_s",
             "time/sync_s", "time/step_s", "rollout/tokens_generated", "throughput/tokens_per_s",
             "throughput/steps_per_hour", "reward/total/mean", "reward/total/min", "reward/total/max",
             "reward/correct/mean", "reward/format/mean", "reward/digits/max", "response_length/mean",
             "train/kl", "train/entropy", "train/clip_frac_low", "train/clip_frac_high", "train/grad_norm",
             "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/kl_k3", "mismatch/ratio_p99", "memory/rollout/device_bytes",
             "memory/update/device_bytes", "policy_version")


@pytest.fixture
def cpu_clock(monkeypatch):
    """The step timelines read the process's CPU time (all threads, so device work on the CPU
    backend counts), which a loaded machine's scheduler does not stretch between phases."""
    monkeypatch.setattr(Timeline, "clock", staticmethod(time.process_time))


def _check_run(result, cfg, colocated: bool):
    d = result.run_dir
    metrics = read_jsonl(os.path.join(d, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, cfg.steps + 1))
    for m in metrics:
        missing = [k for k in STEP_KEYS if k not in m]
        assert not missing, missing
        assert not any(k.startswith("eval/") for k in m)  # evaluation is kept apart
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k not in ("time/step_s", "time/other_s"))
        # Every second of the step is in a phase or in `other`, on the timeline's one clock ...
        assert phases + m["time/other_s"] == pytest.approx(m["time/step_s"], rel=1e-12)
        # ... phases do not overlap, and at most 5% of the step's work runs outside them (CPU
        # time: `cpu_clock`).
        assert 0.0 <= m["time/other_s"] <= 0.05 * m["time/step_s"]
        assert ("time/offload_s" in m) == colocated
        assert m["rollout/tokens_generated"] >= cfg.batch_size  # at least one token per sequence
        assert 0.0 <= m["reward/correct/mean"] <= 1.0
        assert m["reward/total/min"] <= m["reward/total/mean"] <= m["reward/total/max"]
        # Trainer and rollout engine score the same tokens with the same weights (fp32 here).
        assert m["mismatch/abs_diff_max"] < 1e-3
    evals = read_jsonl(os.path.join(d, "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all("eval/greedy_accuracy" in e and "eval/pass@2" in e for e in evals)
    assert not any(k.startswith("reward/") for e in evals for k in e)
    traj = read_jsonl(os.path.join(d, "trajectories.jsonl"))
    assert len(traj) == cfg.steps * cfg.batch_size  # sample rate 1
    for t in traj:
        assert set(TRAJECTORY_KEYS) <= set(t)
        assert set(t["rewards"]) == {"correct", "format", "digits"}
        assert t["policy_version"] == t["step"] - 1
    assert len({t["group_id"] for t in traj}) == cfg.steps * cfg.prompts_per_step
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    assert set(MANIFEST_KEYS) <= set(manifest)
    assert manifest["param_count"] == result_param_count(cfg)
    assert manifest["task"]["version"] == "addition-v1" and len(manifest["devices"]) == 8
    assert manifest["versions"]["jax"] == jax.__version__
    assert os.path.exists(os.path.join(result.export_dir, "config.json"))
    assert result.final_eval["eval/greedy_accuracy"] == evals[-1]["eval/greedy_accuracy"]


def result_param_count(cfg):
    return cfg.model.replace(vocab_size=16).num_params()  # 15 char ids padded to 8k


@pytest.mark.slow
def test_colocated_run(tmp_path, cpu_clock, monkeypatch):
    import tpurl.rl.loop as loop

    frozen = []  # the RL steps' heap freezes: before the first, then after each step that compiled
    monkeypatch.setattr(loop, "freeze_heap", lambda: frozen.append(True))
    cfg = tiny_config(tmp_path / "colocated")
    result = run(cfg, verbose=False)
    _check_run(result, cfg, colocated=True)
    compiled = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if r.get("compile/seconds", 0) > 0]
    assert len(frozen) == 1 + len(compiled) >= 2
    sft = read_jsonl(os.path.join(result.run_dir, "sft.jsonl"))
    assert [r["sft_step"] for r in sft] == [2] and np.isfinite(sft[0]["sft/loss"])
    assert 0.0 <= sft[0]["sft/probe_accuracy"] <= 1.0 and sft[0]["sft/steps_run"] == 2  # target not reached
    assert any(f.endswith(".safetensors") for f in os.listdir(result.export_dir))
    summary = json.load(open(os.path.join(result.run_dir, "summary.json")))
    assert summary["steps"] == 2 and "rollout" in summary["timeline"]
    # The checkpoint holds params, optimizer state, the reference policy and the data cursor.
    assert sorted(int(s) for s in os.listdir(os.path.join(result.run_dir, "checkpoints"))
                  if s.isdigit()) == [0, 2]


@pytest.mark.slow
def test_disaggregated_run(tmp_path, cpu_clock):
    placement = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4,
                                train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 2)),
                                rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 2)))
    cfg = tiny_config(tmp_path / "disagg", placement=placement, sft=SFTConfig(steps=0),
                      checkpoint=CheckpointConfig(every_steps=0, export_hf=True))
    result = run(cfg, verbose=False)
    _check_run(result, cfg, colocated=False)
    manifest = json.load(open(os.path.join(result.run_dir, "manifest.json")))
    assert manifest["extra"]["train_mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("change, match", [
    (dict(algorithm="reinforce"), "unknown algorithm 'reinforce'"),
    (dict(batch_size=18), "not a multiple of the group size 4"),
    (dict(placement=PlacementConfig(train_mesh=MeshConfig(axes=MESH3, shape=(1, 3, 2)))), "does not fit 8"),
    (dict(placement=PlacementConfig(mode="disaggregated", train_devices=6, rollout_devices=4)), "do not fit 8"),
    (dict(engine=EngineConfig(max_seq_len=4)), "EngineConfig.max_seq_len=4 is shorter"),
    (dict(algorithm=algorithm_preset("grpo", group_size=2), batch_size=6), "batch shards"),
    (dict(train_layout="zero3"), "unknown layout preset"),
    (dict(model="gpt5"), "unknown model preset"),
])
def test_bad_configs_fail_before_work(tmp_path, change, match):
    run_dir = tmp_path / "never"
    with pytest.raises(ValueError, match=match) as e:
        cfg = tiny_config(run_dir, **change)
        prepare(cfg)
    assert "\n" not in str(e.value)
    assert not run_dir.exists()


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    from tpurl.commands.train import main

    gin_file = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")
    run_dir = tmp_path / "cli"
    rc = main(["--gin_file", gin_file, "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'",
               "--gin_param", "tpurl.algorithm_preset.name='nope'"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("tpurl train: config error:") and "unknown algorithm" in err
    assert len(err.splitlines()) == 1 and not run_dir.exists()
