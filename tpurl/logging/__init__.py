"""Run observability: metrics / eval / trajectory JSONL, the experiment trackers (TensorBoard,
W&B, MLflow, trackio), the run manifest, atomic writers and the terminal progress bar."""

from tpurl.files import (JsonlWriter, atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl,
                                   to_jsonable)
from tpurl.logging.manifest import MANIFEST_FILE, MANIFEST_KEYS, build_manifest, param_checksum, write_manifest
from tpurl.logging.metrics import (EVAL_FILE, METRICS_FILE, SUMMARY_FILE, TRAJECTORIES_FILE, TRAJECTORY_KEYS,
                                   LoggingConfig, MetricsLogger, TrajectoryLogger)
from tpurl.logging.trackers import TRACKERS, TRACKERS_FILE, MlflowConfig, WandbConfig

__all__ = ["MANIFEST_FILE", "MANIFEST_KEYS", "build_manifest", "param_checksum", "write_manifest", "EVAL_FILE",
           "METRICS_FILE", "SUMMARY_FILE", "TRAJECTORIES_FILE", "TRAJECTORY_KEYS", "LoggingConfig", "MetricsLogger",
           "TrajectoryLogger", "TRACKERS", "TRACKERS_FILE", "MlflowConfig", "WandbConfig", "JsonlWriter",
           "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "read_jsonl", "to_jsonable"]
