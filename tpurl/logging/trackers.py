"""Experiment trackers: the scalars of metrics.jsonl / eval.jsonl / sft.jsonl, also sent to
TensorBoard, Weights & Biases, MLflow or trackio (`LoggingConfig.trackers`).

Each backend is one class behind the `Tracker` protocol, registered in `TRACKERS` under the name
`LoggingConfig.trackers` uses. Its library is imported when the tracker opens, so only the chosen
ones need installing (`pip install 'tpurl[wandb]'`, `[mlflow]`, `[trackio]`; `[trackers]` for all).
`Trackers` opens them and fans every call out; a tracker that raises (not installed, cannot write)
is named in one warning line and turned off, and the run goes on with the others.

What a tracker receives: the run's config when it opens, the manifest once it is written
(`log_config`), each record's finite numbers (`log`; NaN and inf are left out, as metrics.jsonl
writes them as null) and the run's summary when it finishes (`log_summary`); trackio, which takes
a config only when its run starts, gets the config alone (`TrackioTracker`). A tracker closed
without a summary (the run stopped on an error) marks its run failed where the backend has a status.

Resume: the trackers' run ids are kept in `trackers.json` in the run directory, so a resumed run
continues the same W&B run (its id, resume="allow"), MLflow run (its run_id) and trackio run (its
name). The steps after the restored checkpoint are logged again: metrics.jsonl drops the killed
run's values for them, the trackers keep both.

Where each writes (none needs a network unless told to: W&B goes online only with an API key set up):
- tensorboard: event files in run_dir/tb/.
- wandb: run_dir/wandb/ (WANDB_DIR when set); online or offline as `WandbConfig.mode` says
  (offline runs upload later with `wandb sync run_dir/wandb/offline-run-*`).
- mlflow: `MlflowConfig.tracking_uri`; by default a file store in run_dir/mlruns (MLflow 3 keeps
  the file store behind MLFLOW_ALLOW_FILE_STORE, which tpurl sets for it), experiment
  `LoggingConfig.project`.
- trackio: its local database (TRACKIO_DIR, else ~/.cache/huggingface/trackio), project
  `LoggingConfig.project`; see it with `trackio show --project tpurl`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import netrc
import os
import re
import secrets
import sys
import time
from typing import Any, Callable, Literal, Mapping, Protocol
from urllib.parse import urlparse

from tpurl.config_types import check_types
from tpurl.files import atomic_write_json, to_jsonable

TRACKERS_FILE = "trackers.json"  # {tracker: what a resumed run needs to continue that tracker's run}
WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """The "wandb" tracker. `mode`: "online", "offline" or "disabled"; None: WANDB_MODE when set,
    else online when an API key is set up (WANDB_API_KEY or `wandb login`) and offline otherwise.
    `entity`: the W&B team or user (None: the account's default). `tags`: the run's tags."""

    mode: Literal["online", "offline", "disabled"] | None = None
    entity: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        check_types(self)
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"WandbConfig.mode={self.mode!r} must be one of {WANDB_MODES} or None (WANDB_MODE, "
                             "else online with an API key and offline without)")
        object.__setattr__(self, "tags", tuple(self.tags))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    """The "mlflow" tracker. `tracking_uri`: where runs are stored (a server URL, `sqlite:///...`,
    `file:...`); None: MLFLOW_TRACKING_URI when set, else a file store in run_dir/mlruns."""

    tracking_uri: str | None = None

    def __post_init__(self):
        check_types(self)
        if self.tracking_uri == "":
            raise ValueError("MlflowConfig.tracking_uri='' names no store; set a URI or None (MLFLOW_TRACKING_URI, "
                             "else run_dir/mlruns)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackedRun:
    """What a tracker is opened with: the run directory (where it keeps its files and ids), the
    project (W&B project, MLflow experiment, trackio project), whether the run continues an
    earlier one, and the backends' settings (`LoggingConfig`'s)."""

    run_dir: str
    project: str
    resume: bool
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()

    @property
    def name(self) -> str:
        """The run's name in the trackers: its directory's."""
        return os.path.basename(os.path.abspath(self.run_dir))

    def saved(self, tracker: str) -> dict[str, Any] | None:
        """What `tracker` kept for the run this one continues (None for a new run)."""
        path = os.path.join(self.run_dir, TRACKERS_FILE)
        if not self.resume or not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f).get(tracker)

    def remember(self, tracker: str, info: dict[str, Any]) -> None:
        """Keep `info` (ids) for a resumed run to continue `tracker`'s run with."""
        path = os.path.join(self.run_dir, TRACKERS_FILE)
        kept = {}
        if os.path.exists(path):
            with open(path) as f:
                kept = json.load(f)
        atomic_write_json(path, {**kept, tracker: info})


class Tracker(Protocol):
    """One backend's open run. `axis` names what `step` counts: "step" (RL steps, evaluations) or
    "sft_step" (the warm start's steps)."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float], *, axis: str = "step") -> None: ...

    def log_summary(self, summary: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars and the config as text in run_dir/tb/ (tensorboardX)."""

    install = "pip install tensorboardX"

    def __init__(self, run: TrackedRun, config: Mapping[str, Any]):
        from tensorboardX import SummaryWriter  # imported lazily: it pulls in protobuf

        self._writer = SummaryWriter(os.path.join(run.run_dir, "tb"))
        self.log_config(config)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for name, value in config.items():
            text = json.dumps(to_jsonable(value), indent=1, sort_keys=True)
            self._writer.add_text(name, "    " + text.replace("\n", "\n    "))  # a Markdown code block
        self._writer.flush()

    def log(self, step: int, metrics: Mapping[str, float], *, axis: str = "step") -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.log_config({"summary": summary})

    def close(self) -> None:
        self._writer.close()


def wandb_mode(cfg: WandbConfig) -> str | None:
    """The mode to open a W&B run in (None: W&B's own, from WANDB_MODE); see `WandbConfig`."""
    if cfg.mode is not None:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if _wandb_key_set_up() else "offline"


def _wandb_key_set_up() -> bool:
    """Whether W&B would find credentials: the environment, or `wandb login`'s netrc entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """A W&B run (`wandb.init`) per tpurl run; RL and warm-start metrics each on their own x-axis
    (`step`, `sft_step`: W&B's `define_metric`), so neither has to follow the other's order."""

    install = "pip install 'tpurl[wandb]'"

    def __init__(self, run: TrackedRun, config: Mapping[str, Any]):
        import wandb

        saved = run.saved("wandb")
        run_id = saved["id"] if saved else secrets.token_hex(4)
        self._run = wandb.init(project=run.project, entity=run.wandb.entity, name=run.name, id=run_id,
                               resume="allow", mode=wandb_mode(run.wandb), tags=list(run.wandb.tags) or None,
                               dir=None if os.environ.get("WANDB_DIR") else os.path.abspath(run.run_dir),
                               config=to_jsonable(dict(config)))
        run.remember("wandb", {"id": run_id})
        self._defined: set[str] = set()  # the axes, and each metric (on the axis it first came with)
        self._summarized = False

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(to_jsonable(dict(config)), allow_val_change=True)

    def log(self, step: int, metrics: Mapping[str, float], *, axis: str = "step") -> None:
        if axis not in self._defined:
            self._run.define_metric(axis)
            self._defined.add(axis)
        for k in metrics:
            if k not in self._defined:
                self._run.define_metric(k, step_metric=axis)
                self._defined.add(k)
        self._run.log({axis: step, **metrics})

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._run.summary.update(to_jsonable(dict(summary)))
        self._summarized = True

    def close(self) -> None:
        self._run.finish(exit_code=0 if self._summarized else 1)


_MLFLOW_BAD_CHARS = re.compile(r"[^\w/.\- :]")  # what MLflow's names may not hold


def mlflow_key(name: str) -> str:
    """`name` as an MLflow metric or param name: characters MLflow rejects (`@` of `eval/pass@2`)
    become `_`, and empty, `.` and `..` path segments (which MLflow rejects too) go."""
    parts = [p for p in _MLFLOW_BAD_CHARS.sub("_", name).split("/") if p not in ("", ".", "..")]
    return "/".join(parts)[:250] or "_"


def mlflow_params(config: Mapping[str, Any], max_len: int = 6000) -> dict[str, str]:
    """`config` flattened to MLflow params: nested keys joined with `.`, lists and other values
    as JSON, each value cut to `max_len` characters (MLflow's limit)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            out[mlflow_key(prefix)] = text[:max_len]

    walk("", to_jsonable(config))
    return out


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class MlflowTracker:
    """An MLflow run (through `MlflowClient`, no global active run) in experiment `project`: metrics
    per step, the config and manifest as flattened params and as JSON artifacts, the summary as an
    artifact."""

    install = "pip install 'tpurl[mlflow]'"

    def __init__(self, run: TrackedRun, config: Mapping[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = (run.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or "file:" + os.path.join(os.path.abspath(run.run_dir), "mlruns"))
        if urlparse(uri).scheme in ("", "file"):
            # MLflow 3 refuses a file store unless asked; naming one (or the default) is asking.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        saved = run.saved("mlflow")
        if saved:
            self._run_id = saved["run_id"]
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            experiment = self._client.get_experiment_by_name(run.project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(run.project)
            self._run_id = self._client.create_run(experiment_id, run_name=run.name, tags={
                "tpurl.run_dir": os.path.abspath(run.run_dir)}).info.run_id
        run.remember("mlflow", {"run_id": self._run_id, "tracking_uri": uri})
        self._summarized = False
        self.log_config(config)

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        # A param cannot change value: a resumed run keeps the first run's (its manifest's are in
        # the run directory and in the artifact below).
        logged = self._client.get_run(self._run_id).data.params
        params = [Param(k, v) for k, v in mlflow_params(config, MAX_PARAM_VAL_LENGTH).items() if k not in logged]
        for batch in _batches(params, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self._run_id, params=batch)
        for name, value in config.items():
            self._client.log_dict(self._run_id, to_jsonable(value), f"{name}.json")

    def log(self, step: int, metrics: Mapping[str, float], *, axis: str = "step") -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for part in _batches(batch, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=part)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._client.log_dict(self._run_id, to_jsonable(dict(summary)), "summary.json")
        self._summarized = True

    def close(self) -> None:
        self._client.set_terminated(self._run_id, status="FINISHED" if self._summarized else "FAILED")


class TrackioTracker:
    """A trackio run in project `project`, named after the run directory plus a random suffix
    (trackio resumes a run by name, so names must not repeat). trackio stores a run's config once,
    from `trackio.init`: it gets the run's config and the run directory's path, while the
    manifest and the summary stay in that directory. trackio's own messages go to stderr."""

    install = "pip install 'tpurl[trackio]'"

    def __init__(self, run: TrackedRun, config: Mapping[str, Any]):
        import trackio

        saved = run.saved("trackio")
        name = saved["name"] if saved else f"{run.name}-{secrets.token_hex(3)}"
        with contextlib.redirect_stdout(sys.stderr):
            self._run = trackio.init(project=run.project, name=name, resume="allow" if saved else "never",
                                     config={**to_jsonable(dict(config)), "run_dir": os.path.abspath(run.run_dir)},
                                     embed=False, auto_log_cpu=False, auto_log_gpu=False)
        run.remember("trackio", {"name": name})
        self._trackio = trackio

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Nothing: trackio has no way to add to a run's config after `trackio.init`."""

    def log(self, step: int, metrics: Mapping[str, float], *, axis: str = "step") -> None:
        self._run.log(dict(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Nothing: see `log_config`."""

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self._trackio.finish()  # the current run, this one: finished and forgotten (not again at exit)


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
                             "trackio": TrackioTracker}


class Trackers:
    """The run's open trackers. One that raises, opening or later, is named in one `warn` line and
    turned off (closed if it opened, quietly); the others go on."""

    def __init__(self, names: tuple[str, ...], run: TrackedRun, config: Mapping[str, Any],
                 warn: Callable[[str], None]):
        self._warn = warn
        self._open: dict[str, Tracker] = {}
        for name in names:
            try:
                self._open[name] = TRACKERS[name](run, config)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self._turn_off(name, "could not start", e)

    def call(self, method: str, *args, **kwargs) -> None:
        """`tracker.method(*args, **kwargs)` on every open tracker."""
        for name, tracker in list(self._open.items()):
            try:
                getattr(tracker, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                del self._open[name]
                if method != "close":
                    with contextlib.suppress(Exception):
                        tracker.close()
                self._turn_off(name, f"failed in {method}", e)

    def close(self) -> None:
        self.call("close")
        self._open.clear()

    def _turn_off(self, name: str, what: str, error: Exception) -> None:
        lines = str(error).strip().splitlines()
        message = lines[0][:300] if lines else ""
        install = getattr(TRACKERS.get(name), "install", None)
        hint = f" ({install})" if install and isinstance(error, ImportError) else ""
        self._warn(f"tracker {name!r} {what} and is off for the rest of this run: {type(error).__name__}: "
                   f"{message}{hint}; the run goes on without it")
