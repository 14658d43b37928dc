"""Run logs a person can use: per-step metrics (JSONL, and the experiment trackers of
`LoggingConfig.trackers`: TensorBoard, W&B, MLflow, trackio; see trackers.py) and raw
trajectories (JSONL).

Layout of a run directory:

    manifest.json        what ran (see manifest.py)
    metrics.jsonl        one record per training step: {"step", "time", <name>: number, ...}
    eval.jsonl           one record per evaluation: {"step", "eval/...": number}; never mixed with
                         training reward
    sft.jsonl            the warm start's loss curve: {"sft_step", "sft/loss", ...}
    trajectories.jsonl   sampled rollouts: prompt, completion text and ids, every reward component,
                         advantage, policy version, group id
    tb/                  TensorBoard event files with the same scalars (tracker "tensorboard")
    wandb/, mlruns/      W&B offline runs and the MLflow file store, when those trackers are on
    trackers.json        the trackers' run ids, so that a resumed run continues their runs
    checkpoints/         orbax checkpoints (see tpurl/checkpoint.py)
    checkpoints.damaged/ checkpoints that failed to restore on resume, moved aside
    export/              the final policy as Hugging Face safetensors
    report/              plots and report.md made from these logs (`tpurl report`)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tpurl.config_types import check_types
from tpurl.files import JsonlWriter, read_jsonl, truncate_jsonl
from tpurl.logging.trackers import TRACKERS, MlflowConfig, TrackedRun, Trackers, WandbConfig

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
SFT_FILE = "sft.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
SUMMARY_FILE = "summary.json"  # written when a run finishes (`tpurl.rl.loop.RunResult`)

# Keys every trajectory record carries (checked by tests; readers can rely on them).
TRAJECTORY_KEYS = ("step", "policy_version", "group_id", "sample_index", "prompt", "prompt_ids", "completion",
                   "completion_ids", "finish_reason", "rewards", "reward", "advantage", "answer", "problem_uid", "turns",
                   "model_mask", "info")  # and "routes", with a router replay (tpurl.rl.batch.trajectory_records)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where and what to log. `trajectory_sample_rate` is the fraction of groups whose rollouts are
    written (1.0: all; 0: none), chosen deterministically from the step so resumed runs agree.
    `trackers`: where the scalars go besides the JSONL files, any of "tensorboard", "wandb",
    "mlflow", "trackio" (each but TensorBoard an optional extra: `pip install 'tpurl[wandb]'`);
    `project` is their W&B project, MLflow experiment and trackio project; `wandb` and `mlflow`
    their own settings (trackers.py)."""

    run_dir: str = "runs/default"
    trackers: tuple[str, ...] = ("tensorboard",)
    project: str = "tpurl"
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    trajectory_sample_rate: float = 0.25
    progress_bar: bool = True

    def __post_init__(self):
        check_types(self)
        object.__setattr__(self, "trackers", tuple(self.trackers))
        if not 0.0 <= self.trajectory_sample_rate <= 1.0:
            raise ValueError(f"LoggingConfig.trajectory_sample_rate={self.trajectory_sample_rate} must be in [0, 1]")
        if not self.run_dir:
            raise ValueError("LoggingConfig.run_dir must be a non-empty path")
        for name in self.trackers:
            if name not in TRACKERS:
                raise ValueError(f"LoggingConfig.trackers={self.trackers!r}: unknown tracker {name!r}; choose from "
                                 f"{tuple(TRACKERS)} (or () for none)")
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"LoggingConfig.trackers={self.trackers!r} names a tracker twice; name each once")
        if not self.project:
            raise ValueError("LoggingConfig.project must be a non-empty name (the W&B project, MLflow experiment "
                             "and trackio project)")


def _say(message: str) -> None:
    print(f"[tpurl] {message}", file=sys.stderr, flush=True)


def finite_numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The values of `metrics` the trackers take: finite numbers (not bools), as floats."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and np.isfinite(v)}


class MetricsLogger:
    """Writes scalar records to `metrics.jsonl` / `eval.jsonl` / `sft.jsonl` and to the trackers
    of `cfg.trackers` (`Trackers`: one that fails is one `warn` line and is turned off). A new
    run (`resume_from_step=None`) needs a directory without logs (another run's are never
    overwritten: see `run_dir.open_run_dir`); a resumed one keeps the records up to the restored
    step, and an evaluation already logged for a step (the final one of a finished run) is not
    logged twice. `run_config` (the run's config as a dict) goes to the trackers as "config"
    when they open. Only process 0 of a run builds one (`tpurl.rl.loop`)."""

    def __init__(self, run_dir: str, cfg: LoggingConfig | None = None, *, run_config: Mapping[str, Any] | None = None,
                 resume_from_step: int | None = None, warn: Callable[[str], None] = _say):
        cfg = cfg if cfg is not None else LoggingConfig()
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._eval_steps: set[int] = set()
        for name in (METRICS_FILE, EVAL_FILE, TRAJECTORIES_FILE, SFT_FILE):
            path = os.path.join(run_dir, name)
            if resume_from_step is None:
                if os.path.exists(path):
                    raise ValueError(f"{path} holds another run's log; a new run needs a directory of its own "
                                     "(LoggingConfig.run_dir)")
            elif name != SFT_FILE:
                # Records past the restored checkpoint belong to the killed run's lost future.
                truncate_jsonl(path, max_step=resume_from_step)
        if resume_from_step is not None and os.path.exists(os.path.join(run_dir, EVAL_FILE)):
            self._eval_steps = {r["step"] for r in read_jsonl(os.path.join(run_dir, EVAL_FILE))}
        self._metrics = JsonlWriter(os.path.join(run_dir, METRICS_FILE))
        self._eval = JsonlWriter(os.path.join(run_dir, EVAL_FILE))
        self._sft = JsonlWriter(os.path.join(run_dir, SFT_FILE))
        run = TrackedRun(run_dir=run_dir, project=cfg.project, resume=resume_from_step is not None, wandb=cfg.wandb,
                         mlflow=cfg.mlflow)
        self.trackers = Trackers(cfg.trackers, run, {"config": dict(run_config or {})}, warn)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._metrics.write({"step": step, "time": time.time(), **metrics})
        self.trackers.call("log", step, finite_numbers(metrics))

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        if step in self._eval_steps:  # evaluations are deterministic in the step: the record is there
            return
        self._eval_steps.add(step)
        self._eval.write({"step": step, "time": time.time(), **metrics})
        self.trackers.call("log", step, finite_numbers(metrics))

    def log_sft(self, sft_step: int, metrics: Mapping[str, Any]) -> None:
        self._sft.write({"sft_step": sft_step, "time": time.time(), **metrics})
        self.trackers.call("log", sft_step, finite_numbers(metrics), axis="sft_step")

    def log_config(self, name: str, values: Mapping[str, Any]) -> None:
        """Add `values` (the manifest) to the trackers' record of the run's config, as `name`."""
        self.trackers.call("log_config", {name: values})

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The finished run's summary (`summary.json`) for the trackers."""
        self.trackers.call("log_summary", summary)

    def close(self) -> None:
        self._metrics.close()
        self._eval.close()
        self._sft.close()
        self.trackers.close()


def _keep_group(step: int, group_id: int, rate: float) -> bool:
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    # Deterministic in (step, group): resumed and uninterrupted runs log the same trajectories.
    return np.random.default_rng([step, group_id, 7]).random() < rate


class TrajectoryLogger:
    """Writes a sampled subset of rollouts (whole groups) to `trajectories.jsonl`."""

    def __init__(self, run_dir: str, sample_rate: float):
        self.sample_rate = sample_rate
        self._writer = JsonlWriter(os.path.join(run_dir, TRAJECTORIES_FILE))

    def log(self, step: int, policy_version: int, records: Sequence[Mapping[str, Any]]) -> int:
        """`records` carry every `TRAJECTORY_KEYS` field except `step` (and `policy_version` where the
        step's is theirs: a record's own, the version that sampled it, wins). Returns how many were
        written."""
        n = 0
        for r in records:
            if _keep_group(step, int(r["group_id"]), self.sample_rate):
                self._writer.write({"step": step, "policy_version": policy_version, **r})
                n += 1
        return n

    def close(self) -> None:
        self._writer.close()
