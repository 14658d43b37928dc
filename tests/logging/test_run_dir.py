"""Choosing a run's directory: never another run's, claimed atomically; `resume` only where
there is a checkpoint; a resumed run's leftovers of interrupted writes removed."""

import os
import time

import pytest

from tpurl.logging.run_dir import CLAIM_FILE, open_run_dir


def _notes():
    said = []
    return said, said.append


def test_new_run_uses_a_new_or_empty_directory(tmp_path):
    said, say = _notes()
    assert open_run_dir(str(tmp_path / "a" / "run"), say=say) == (str(tmp_path / "a" / "run"), False)
    assert os.path.isdir(tmp_path / "a" / "run")  # claimed
    (tmp_path / "empty").mkdir()
    assert open_run_dir(str(tmp_path / "empty"), say=say) == (str(tmp_path / "empty"), False)
    assert said == []
    # A second run started at the same time finds the empty directory taken: it goes elsewhere.
    second, _ = open_run_dir(str(tmp_path / "empty"), say=say)
    assert second != str(tmp_path / "empty") and os.listdir(tmp_path / "empty") == [CLAIM_FILE]


def test_new_run_never_writes_into_another(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261130-120000")
    said, say = _notes()
    first, resume = open_run_dir(str(run), say=say)
    second, _ = open_run_dir(str(run), say=say)  # the same second: numbered
    assert (first, second, resume) == (f"{run}-20261130-120000", f"{run}-20261130-120000-2", False)
    assert os.path.isdir(first) and os.path.isdir(second) and os.listdir(run) == ["metrics.jsonl"]
    assert said[0] == f"{run} holds an earlier run, which is left as it is; this run writes to {first}"


def test_resume(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=f"^nothing to resume: {run} does not exist"):
        open_run_dir(str(run), resume=True)
    assert not run.exists()
    (run / "checkpoints").mkdir(parents=True)  # an every_steps=0 run: the directory, no checkpoint
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=f"^nothing to resume: {run} holds no checkpoint"):
        open_run_dir(str(run), resume=True)
    said, say = _notes()
    fresh, resume = open_run_dir(str(run), resume=True, or_start=True, say=say)
    assert fresh.startswith(f"{run}-") and not resume
    assert said[0] == f"nothing to resume: {run} holds no checkpoint; starting a new run"

    (run / "checkpoints" / "4").mkdir()
    (run / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()  # orbax's own, left to orbax
    (run / ".export.tmp-x1").mkdir()  # an export killed half-way
    (run / ".export.tmp-x1" / "part-0.safetensors").write_bytes(b"half")
    (run / ".tmp-abcsummary.json").write_text("{")  # an atomic write killed half-way
    said, say = _notes()
    assert open_run_dir(str(run), resume=True, say=say) == (str(run), True)
    assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl"]
    assert said == [f"removed what an interrupted run left in {run}: .export.tmp-x1, .tmp-abcsummary.json"]


def test_a_file_is_not_a_run_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="LoggingConfig.run_dir=.* is a file, not a directory"):
        open_run_dir(str(tmp_path / "f"))
