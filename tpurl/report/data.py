"""A run directory's logs, loaded into plain Python records and numpy arrays for the report.

What is read: `metrics.jsonl` (one record per RL step; required), `eval.jsonl` (held-out
evaluations, step 0 being the warm-started policy; optional) and `summary.json` / `manifest.json`
(optional). A missing or damaged log is a one-line ValueError naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from tpurl.logging import EVAL_FILE, MANIFEST_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl


# The order the phases of one step run in (`tpurl.rl.step`); `memory_account` is the per-phase memory
# account summed over the step's phases, `other` the unaccounted remainder.
PHASE_ORDER = ("offload", "rollout", "reward", "onload", "logprobs", "advantages", "update", "sync",
               "memory_account", "other")

# Memory groups logged per phase as `memory/<phase>/<group>device_bytes`: label -> key suffix.
MEMORY_GROUPS = {"total": "device_bytes", "KV pool": "kv_pool_device_bytes",
                 "optimizer state": "opt_state_device_bytes"}


@dataclasses.dataclass(frozen=True)
class RunLogs:
    """One run's logs: `steps` are the metrics records of RL steps, in step order."""

    run_dir: str
    steps: list[dict]
    evals: list[dict]
    summary: dict | None
    manifest: dict | None

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.run_dir))


def _read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None when there is no such file."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            obj = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it or delete it and run again") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds {type(obj).__name__}, not a JSON object; restore it or delete it")
    return obj


def load_run(run_dir: str) -> RunLogs:
    """Load the logs of the run in `run_dir` (see the module docstring)."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir} is not a directory; pass a run directory (LoggingConfig.run_dir of a run)")
    metrics = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(metrics):
        raise ValueError(f"{run_dir} has no {METRICS_FILE}: not a run directory, or a run that has not finished a "
                         "step; pass the directory `tpurl train` wrote (LoggingConfig.run_dir)")
    steps = sorted((r for r in read_jsonl(metrics) if "time/step_s" in r and "step" in r), key=lambda r: r["step"])
    if not steps:
        raise ValueError(f"{metrics} holds no RL step; report a run once it has finished one step")
    evals_path = os.path.join(run_dir, EVAL_FILE)
    evals = read_jsonl(evals_path) if os.path.exists(evals_path) else []
    return RunLogs(run_dir=run_dir, steps=steps, evals=sorted(evals, key=lambda r: r.get("step", 0)),
                   summary=_read_json(os.path.join(run_dir, SUMMARY_FILE)),
                   manifest=_read_json(os.path.join(run_dir, MANIFEST_FILE)))


def phase_order(names) -> list[str]:
    """`names` in the order the phases run; phases this module does not know go last, sorted."""
    known = [p for p in PHASE_ORDER if p in names]
    return known + sorted(set(names) - set(PHASE_ORDER))


def phases(steps: list[dict]) -> list[str]:
    """The phases timed in `steps` (from `time/<phase>_s`), in the order they run."""
    names = {k[len("time/"):-len("_s")] for r in steps for k in r if k.startswith("time/") and k.endswith("_s")}
    return phase_order(names - {"step"})


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` over the records that hold a number for it."""
    kept = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    steps = np.array([s for s, _ in kept], dtype=np.int64)
    return steps, np.array([v for _, v in kept], dtype=np.float64)


def expert_shares(steps: list[dict]) -> dict[int, np.ndarray]:
    """A mixture-of-experts run's routing load: sparse layer -> `[steps, experts]` share of the routed
    choices each expert took (`train/moe/l<i>/e<j>`, logged for up to 32 experts; empty otherwise)."""
    layers: dict[int, dict[int, str]] = {}
    for k in {k for r in steps for k in r if k.startswith("train/moe/l")}:
        parts = k.split("/")
        if len(parts) == 4 and parts[3][:1] == "e" and parts[3][1:].isdigit():
            layers.setdefault(int(parts[2][1:]), {})[int(parts[3][1:])] = k
    out = {}
    for layer, experts in sorted(layers.items()):
        out[layer] = np.array([[float(r.get(experts[j], np.nan)) for j in sorted(experts)] for r in steps])
    return out


def reward_components(steps: list[dict]) -> list[str]:
    """The reward components logged as `reward/<component>/mean`, `total` last."""
    names = {k.split("/")[1] for r in steps for k in r if k.startswith("reward/") and k.endswith("/mean")}
    return sorted(names - {"total"}) + (["total"] if "total" in names else [])


def eval_keys(evals: list[dict]) -> list[str]:
    """The held-out metrics to plot: greedy accuracy and pass@k, as logged."""
    keys = {k for r in evals for k in r}
    passes = sorted((k for k in keys if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    return (["eval/greedy_accuracy"] if "eval/greedy_accuracy" in keys else []) + passes


def memory_peaks(steps: list[dict]) -> dict[str, dict[str, float]]:
    """phase -> memory group label -> the largest device bytes logged for it over `steps`."""
    peaks: dict[str, dict[str, float]] = {}
    for r in steps:
        for k, v in r.items():
            parts = k.split("/")
            if len(parts) != 3 or parts[0] != "memory" or not isinstance(v, (int, float)):
                continue
            for label, suffix in MEMORY_GROUPS.items():
                if parts[2] == suffix:
                    group = peaks.setdefault(parts[1], {})
                    group[label] = max(group.get(label, 0.0), float(v))
    return {p: peaks[p] for p in memory_phase_order(peaks)}


def memory_phase_order(names) -> list[str]:
    """Memory moments (`offload_start`, `offload`, `rollout`, `onload_released`, ...) in step order: by
    the phase they belong to."""
    def rank(name: str) -> tuple[int, int, str]:
        base, _, moment = name.partition("_")
        # Within a phase: its start, the moments inside it, then its end (the bare phase name).
        within = {"start": 0, "": 2}.get(moment, 1)
        return (PHASE_ORDER.index(base) if base in PHASE_ORDER else len(PHASE_ORDER), within, name)
    return sorted(names, key=rank)
