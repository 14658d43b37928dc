"""Experiment trackers (`LoggingConfig.trackers`, tpurl/logging/trackers.py).

Fast: the config's one-line errors, W&B's mode, MLflow's names and params, and `MetricsLogger`
fanning out to fake trackers: what each receives, and a tracker that raises (opening, logging,
closing) or whose library is missing is one warning line and is turned off.

Slow (whole runs of `configs/test_tiny.gin`, in this process, through the CLI dispatcher): one run
of 2 steps with all four trackers, then `--resume` to a third step; each tracker's own store is
read back with the library's own reader (W&B's offline `.wandb` log through W&B's record
protobuf, MLflow's `MlflowClient`, trackio's local database) and holds the metrics.jsonl series,
continued by the resumed run in the same tracker run. Then a run whose trackers fail completes,
with one warning line for each. Nothing reaches the network: W&B offline, MLflow's file store in
the run directory, trackio's database in a temporary folder.
"""

import contextlib
import dataclasses
import glob
import io
import json
import os
import struct
import sys

import pytest

from tpurl.commands import main as cli
from tpurl.logging import LoggingConfig, MetricsLogger, WandbConfig, read_jsonl
from tpurl.logging.trackers import TRACKERS, TRACKERS_FILE, TrackedRun, mlflow_key, mlflow_params, wandb_mode

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")
PROJECT = "tpurl-test"
SERIES = "reward/total/mean"  # a metric every step logs, compared with metrics.jsonl's


# --- the config ------------------------------------------------------------------------------

@pytest.mark.parametrize("trackers, message", [
    (("tb",), "LoggingConfig.trackers=('tb',): unknown tracker 'tb'; choose from ('tensorboard', 'wandb', "
              "'mlflow', 'trackio') (or () for none)"),
    (("wandb", "wandb"), "LoggingConfig.trackers=('wandb', 'wandb') names a tracker twice; name each once"),
    ("wandb", "LoggingConfig.trackers='wandb' must be a tuple"),
])
def test_bad_trackers_are_one_line(trackers, message):
    with pytest.raises(ValueError) as e:
        LoggingConfig(trackers=trackers)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_trackers_from_a_list_and_the_defaults():
    assert LoggingConfig(trackers=["mlflow", "trackio"]).trackers == ("mlflow", "trackio")
    assert LoggingConfig().trackers == ("tensorboard",)
    with pytest.raises(ValueError, match=r"^WandbConfig.mode='cloud' must be one of \('online', 'offline'"):
        WandbConfig(mode="cloud")
    with pytest.raises(ValueError, match="^LoggingConfig.project must be a non-empty name"):
        LoggingConfig(project="")


def test_wandb_mode(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode(WandbConfig()) == "offline"  # no key anywhere: nothing would upload
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_mode(WandbConfig()) == "online"  # `wandb login` wrote this
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(WandbConfig()) is None  # W&B reads its own variable
    assert wandb_mode(WandbConfig(mode="offline")) == "offline"  # the config wins


def test_mlflow_names_and_params():
    assert mlflow_key("eval/pass@2") == "eval/pass_2"
    assert mlflow_key("/a//b/./c") == "a/b/c"
    params = mlflow_params({"config": {"seed": 0, "mesh": {"shape": [1, 4]}, "name": "x", "none": None, "empty": {}},
                            "manifest": {"gin_config": "g" * 7000}}, max_len=6000)
    assert params == {"config.seed": "0", "config.mesh.shape": "[1, 4]", "config.name": "x", "config.none": "null",
                      "config.empty": "{}", "manifest.gin_config": "g" * 6000}


# --- fan-out and failures, with fake trackers ------------------------------------------------

class Recording:
    """A tracker that keeps what it is given (class-level, one list per test)."""

    calls: list = []

    def __init__(self, run, config):
        self.calls.append(("open", run.project, run.resume, config))

    def log_config(self, config):
        self.calls.append(("config", config))

    def log(self, step, metrics, *, axis="step"):
        self.calls.append(("log", axis, step, metrics))

    def log_summary(self, summary):
        self.calls.append(("summary", summary))

    def close(self):
        self.calls.append(("close",))


class FailsOpening(Recording):
    def __init__(self, run, config):
        raise OSError("cannot write here\nsecond line of the message")


class FailsLogging(Recording):
    def log(self, step, metrics, *, axis="step"):
        super().log(step, metrics, axis=axis)
        raise RuntimeError("server said no")


class FailsClosing(Recording):
    def close(self):
        raise RuntimeError("flush failed")


@pytest.fixture
def fakes(monkeypatch):
    Recording.calls = []
    for name, cls in (("recording", Recording), ("fails_opening", FailsOpening), ("fails_logging", FailsLogging),
                      ("fails_closing", FailsClosing)):
        monkeypatch.setitem(TRACKERS, name, cls)
    return Recording.calls


def test_every_tracker_gets_the_same_numbers(tmp_path, fakes):
    warnings = []
    log = MetricsLogger(str(tmp_path), LoggingConfig(trackers=("recording",), project="p"), run_config={"seed": 3},
                        warn=warnings.append)
    log.log_sft(1, {"sft/loss": 2.0})
    log.log_eval(0, {"eval/greedy_accuracy": 0.5, "eval/pass@2": float("nan")})
    log.log_config("manifest", {"seed": 3})
    log.log_step(1, {"train/loss": 1.5, "flag": True, "text": "x", "inf": float("inf"), "count": 4})
    log.log_summary({"steps": 1})
    log.close()
    assert fakes == [("open", "p", False, {"config": {"seed": 3}}),
                     ("log", "sft_step", 1, {"sft/loss": 2.0}),
                     ("log", "step", 0, {"eval/greedy_accuracy": 0.5}),  # NaN left out, as JSONL's null
                     ("config", {"manifest": {"seed": 3}}),
                     ("log", "step", 1, {"train/loss": 1.5, "count": 4.0}),
                     ("summary", {"steps": 1}), ("close",)]
    assert warnings == []
    assert read_jsonl(str(tmp_path / "metrics.jsonl"))[0]["inf"] is None  # the JSONL record is whole


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(tmp_path, fakes):
    warnings = []
    cfg = LoggingConfig(trackers=("fails_opening", "fails_logging", "recording", "fails_closing"))
    log = MetricsLogger(str(tmp_path), cfg, warn=warnings.append)
    for step in (1, 2, 3):
        log.log_step(step, {"x": float(step)})
    log.close()
    assert warnings == [
        "tracker 'fails_opening' could not start and is off for the rest of this run: OSError: cannot write here; "
        "the run goes on without it",
        "tracker 'fails_logging' failed in log and is off for the rest of this run: RuntimeError: server said no; "
        "the run goes on without it",
        "tracker 'fails_closing' failed in close and is off for the rest of this run: RuntimeError: flush failed; "
        "the run goes on without it"]
    logged = [c for c in fakes if c[0] == "log"]
    # fails_logging saw step 1 only (then closed); recording and fails_closing saw every step.
    assert [c[2] for c in logged] == [1, 1, 1, 2, 2, 3, 3]
    assert fakes.count(("close",)) == 2  # fails_logging's, when turned off, and recording's


def test_a_missing_library_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    warnings = []
    MetricsLogger(str(tmp_path), LoggingConfig(trackers=("wandb",)), warn=warnings.append).close()
    assert len(warnings) == 1 and warnings[0].startswith("tracker 'wandb' could not start")
    assert "ModuleNotFoundError" in warnings[0] and "(pip install 'tpurl[wandb]')" in warnings[0]


def test_ids_are_kept_for_a_resumed_run(tmp_path):
    new = TrackedRun(run_dir=str(tmp_path), project="p", resume=False)
    new.remember("wandb", {"id": "abc"})
    new.remember("mlflow", {"run_id": "r1"})
    assert new.saved("wandb") is None  # a new run continues nothing
    resumed = dataclasses.replace(new, resume=True)
    assert resumed.saved("wandb") == {"id": "abc"} and resumed.saved("mlflow") == {"run_id": "r1"}
    assert resumed.saved("trackio") is None and resumed.name == tmp_path.name
    assert json.load(open(tmp_path / TRACKERS_FILE)) == {"wandb": {"id": "abc"}, "mlflow": {"run_id": "r1"}}


def test_mlflow_run_stopped_early_is_failed_and_resumed_is_continued(tmp_path, monkeypatch):
    """With the real MLflow, through `MetricsLogger` alone: a run closed without its summary is
    FAILED; resuming it continues the same MLflow run, whose params keep their first values."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below")  # unset again after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    cfg, warnings = LoggingConfig(trackers=("mlflow",), project="p"), []
    log = MetricsLogger(str(tmp_path), cfg, run_config={"seed": 1}, warn=warnings.append)
    log.log_step(1, {"x": 1.0})
    log.close()  # stopped before its summary
    run_id = json.load(open(tmp_path / TRACKERS_FILE))["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert client.get_run(run_id).info.status == "FAILED"
    log = MetricsLogger(str(tmp_path), cfg, run_config={"seed": 2}, resume_from_step=1, warn=warnings.append)
    log.log_step(2, {"x": 2.0})
    log.log_summary({"steps": 2})
    log.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["config.seed"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(1, 1.0), (2, 2.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1 and warnings == []


# --- whole runs with the real libraries ------------------------------------------------------

def _train(run_dir, *params, flags=()) -> list[str]:
    """Run `tpurl train` on the tiny config in this process; returns its `[tpurl]` lines (the
    warnings: the run is quiet)."""
    argv = ["train", "--quiet", "--gin_file", GIN, *flags]
    for p in (f"tpurl.LoggingConfig.run_dir='{run_dir}'", f"tpurl.LoggingConfig.project='{PROJECT}'", *params):
        argv += ["--gin_param", p]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    assert rc == 0 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    return [line for line in err.getvalue().splitlines() if line.startswith("[tpurl]")]


@pytest.fixture(scope="module")
def local_stores(tmp_path_factory):
    """Every tracker's store in a temporary folder, nothing online."""
    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        for name in ("WANDB_DIR", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(tmp / name.lower()))
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below")  # restored to unset afterwards: the tracker sets it
        mp.delenv("MLFLOW_ALLOW_FILE_STORE")
        mp.setenv("TRACKIO_DIR", str(tmp / "trackio"))
        import trackio  # its folder is read once, at import: point an already imported trackio there too
        import trackio.sqlite_storage
        import trackio.utils

        for module in (trackio, trackio.utils, trackio.sqlite_storage):
            mp.setattr(module, "TRACKIO_DIR", tmp / "trackio")
        yield tmp


@pytest.fixture(scope="module")
def tracked(local_stores):
    """A 2-step run with every tracker, resumed from its step-2 checkpoint to a third step."""
    run_dir = local_stores / "run"
    all_four = "tpurl.LoggingConfig.trackers=('tensorboard', 'wandb', 'mlflow', 'trackio')"
    first = _train(run_dir, all_four, "tpurl.RLConfig.steps=2", "tpurl.CheckpointConfig.every_steps=2")
    ids = json.load(open(run_dir / TRACKERS_FILE))
    resumed = _train(run_dir, all_four, "tpurl.RLConfig.steps=3", "tpurl.CheckpointConfig.every_steps=2",
                     flags=("--resume-changed", "steps"))
    return {"dir": run_dir, "ids": ids, "said": first + resumed}


def _metrics_series(run_dir) -> dict[int, float]:
    return {r["step"]: r[SERIES] for r in read_jsonl(str(run_dir / "metrics.jsonl"))}


@pytest.mark.slow
def test_runs_continue_their_tracker_runs(tracked):
    assert tracked["said"] == ["[tpurl] resuming from checkpoint step 2 with changed config: steps 2 -> 3"]  # no tracker failed
    assert json.load(open(tracked["dir"] / TRACKERS_FILE)) == tracked["ids"]  # the resumed run kept them
    assert sorted(_metrics_series(tracked["dir"])) == [1, 2, 3]


def wandb_records(path: str):
    """The records of a `.wandb` file, parsed with W&B's own protobuf. The file is a LevelDB-style
    log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a
    7-byte header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = body if kind in (1, 2) else parts + body
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_history(tracked):
    run_id = tracked["ids"]["wandb"]["id"]
    files = sorted(glob.glob(str(tracked["dir"] / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb")))
    assert len(files) == 2  # the first run and its resumption, one W&B run id
    history, config, summary, exits = {}, {}, {}, []
    for path in files:
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                if SERIES in row:
                    history[row["step"]] = row[SERIES]
            elif kind in ("run", "config"):
                items = r.run.config.update if kind == "run" else r.config.update
                config.update({u.key: json.loads(u.value_json) for u in items})
            elif kind == "summary":
                summary.update({u.key: json.loads(u.value_json) for u in r.summary.update if u.key})
            elif kind == "exit":
                exits.append(r.exit.exit_code)
    assert history == pytest.approx(_metrics_series(tracked["dir"]), rel=1e-12)
    assert config["config"]["seed"] == 0 and config["config"]["logging"]["project"] == PROJECT
    manifest = json.load(open(tracked["dir"] / "manifest.json"))
    assert config["manifest"]["param_count"] == manifest["param_count"]
    assert summary["steps"] == 3 and summary["resumed_from"] == 2
    assert exits == [0, 0]


@pytest.mark.slow
def test_mlflow_file_store_holds_metrics_and_params(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tracked['dir'] / 'mlruns'}")
    run_id = tracked["ids"]["mlflow"]["run_id"]
    (only,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    assert only.info.run_id == run_id and only.info.status == "FINISHED"
    got = {m.step: m.value for m in client.get_metric_history(run_id, SERIES)}
    assert got == pytest.approx(_metrics_series(tracked["dir"]), rel=1e-12)
    evals = read_jsonl(str(tracked["dir"] / "eval.jsonl"))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_2")] == [
        (r["step"], r["eval/pass@2"]) for r in evals]  # `@` is not allowed in MLflow's names
    params = client.get_run(run_id).data.params
    manifest = json.load(open(tracked["dir"] / "manifest.json"))
    assert params["config.seed"] == "0" and params["config.steps"] == "2"  # a param keeps its first value
    assert params["manifest.param_checksum"] == manifest["param_checksum"]
    assert all(len(v) <= 6000 for v in params.values())
    summary = json.load(open(client.download_artifacts(run_id, "summary.json", str(tracked["dir"] / "dl"))))
    assert summary["steps"] == 3


@pytest.mark.slow
def test_trackio_local_store_holds_the_metrics(tracked):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    name = tracked["ids"]["trackio"]["name"]
    (run,) = [r for r in trackio.Api().runs(PROJECT) if r.name == name]
    assert run.config["config"]["seed"] == 0 and run.config["run_dir"] == str(tracked["dir"])
    got = {row["step"]: row[SERIES] for row in SQLiteStorage.get_logs(PROJECT, name) if SERIES in row}
    assert got == pytest.approx(_metrics_series(tracked["dir"]), rel=1e-12)


class BrokenLogging:
    """A tracker that opens and then raises on every record."""

    logged = 0

    def __init__(self, run, config):
        pass

    def log_config(self, config):
        pass

    def log(self, step, metrics, *, axis="step"):
        BrokenLogging.logged += 1
        raise ConnectionError("tracker server went away")

    def log_summary(self, summary):
        pass

    def close(self):
        pass


@pytest.mark.slow
def test_failing_trackers_do_not_stop_the_run(local_stores, monkeypatch):
    monkeypatch.setitem(TRACKERS, "broken", BrokenLogging)
    monkeypatch.setitem(sys.modules, "trackio", None)  # as if not installed
    run_dir = local_stores / "failing"
    said = _train(run_dir, "tpurl.LoggingConfig.trackers=('broken', 'trackio', 'tensorboard')",
                  "tpurl.RLConfig.steps=2")
    assert said == [
        "[tpurl] tracker 'trackio' could not start and is off for the rest of this run: ModuleNotFoundError: "
        "import of trackio halted; None in sys.modules (pip install 'tpurl[trackio]'); the run goes on without it",
        "[tpurl] tracker 'broken' failed in log and is off for the rest of this run: ConnectionError: tracker "
        "server went away; the run goes on without it",
        "[tpurl] checkpoints are off (CheckpointConfig.every_steps=0): this run cannot be resumed if it stops"]
    assert BrokenLogging.logged == 1
    assert sorted(_metrics_series(run_dir)) == [1, 2] and (run_dir / "summary.json").exists()
    assert glob.glob(str(run_dir / "tb" / "events*"))  # the tracker that works wrote on


def test_the_registry_is_the_config_vocabulary():
    assert tuple(TRACKERS) == ("tensorboard", "wandb", "mlflow", "trackio")
    assert all(cls.install.startswith("pip install ") for cls in TRACKERS.values())
