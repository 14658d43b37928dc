"""Choosing a run's directory: never another run's, claimed atomically; `resume` only where
there is a checkpoint; a resumed run's leftovers of interrupted writes removed."""

import os
import subprocess
import sys
import time

import pytest

from tpurl.logging.run_dir import CLAIM_FILE, LOCK_FILE, RunDirBusy, RunLock, open_run_dir


def _notes():
    said = []
    return said, said.append


def test_new_run_uses_a_new_or_empty_directory(tmp_path):
    said, say = _notes()
    opened = [open_run_dir(str(tmp_path / "a" / "run"), say=say)]
    assert opened[0][:2] == (str(tmp_path / "a" / "run"), False)
    assert os.path.isdir(tmp_path / "a" / "run")  # claimed
    (tmp_path / "empty").mkdir()
    opened.append(open_run_dir(str(tmp_path / "empty"), say=say))
    assert opened[1][:2] == (str(tmp_path / "empty"), False)
    assert said == []
    # A second run started at the same time finds the empty directory taken: it goes elsewhere.
    opened.append(open_run_dir(str(tmp_path / "empty"), say=say))
    second = opened[2][0]
    for _, _, lock in opened:
        lock.release()
    assert second != str(tmp_path / "empty") and sorted(os.listdir(tmp_path / "empty")) == sorted([CLAIM_FILE, LOCK_FILE])


def test_new_run_never_writes_into_another(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261130-120000")
    said, say = _notes()
    first, resume, lock1 = open_run_dir(str(run), say=say)
    second, _, lock2 = open_run_dir(str(run), say=say)  # the same second: numbered
    lock1.release()
    lock2.release()
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
    fresh, resume, lock = open_run_dir(str(run), resume=True, or_start=True, say=say)
    lock.release()
    assert fresh.startswith(f"{run}-") and not resume
    assert said[0] == f"nothing to resume: {run} holds no checkpoint; starting a new run"

    (run / "checkpoints" / "4").mkdir()
    (run / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()  # orbax's own, left to orbax
    (run / ".export.tmp-x1").mkdir()  # an export killed half-way
    (run / ".export.tmp-x1" / "part-0.safetensors").write_bytes(b"half")
    (run / ".tmp-abcsummary.json").write_text("{")  # an atomic write killed half-way
    said, say = _notes()
    directory, resume, lock = open_run_dir(str(run), resume=True, say=say)
    lock.release()
    assert (directory, resume) == (str(run), True)
    assert sorted(os.listdir(run)) == [LOCK_FILE, "checkpoints", "metrics.jsonl"]
    assert said == [f"removed what an interrupted run left in {run}: .export.tmp-x1, .tmp-abcsummary.json"]


def test_a_file_is_not_a_run_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="LoggingConfig.run_dir=.* is a file, not a directory"):
        open_run_dir(str(tmp_path / "f"))


def test_one_process_writes_a_run_directory(tmp_path):
    """The run holds the directory's lock while it runs: a second `--resume` is refused in one line
    naming the holder and changes nothing; once released (or the holder is dead) the next takes it."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / ".tmp-abcsummary.json").write_text("{")  # the holder's atomic write in progress
    said, say = _notes()
    directory, resume, lock = open_run_dir(str(run), resume=True, say=say)
    (run / ".tmp-live.json").write_text("{")  # written by the holder after it started
    holder = f"pid {os.getpid()} on "
    with pytest.raises(RunDirBusy, match=f"^{run} is in use by another run \\({holder}.*\\); nothing of it was changed"):
        open_run_dir(str(run), resume=True, say=say)
    assert (run / ".tmp-live.json").exists()  # the refused one removed nothing
    other = subprocess.run([sys.executable, "-c", f"from tpurl.logging.run_dir import RunLock; RunLock({str(run)!r})"],
                           capture_output=True, text=True)  # the lock holds across processes too
    assert other.returncode == 1 and "RunDirBusy" in other.stderr
    lock.release()
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly: nothing to take over
    _, _, again = open_run_dir(str(run), resume=True, say=say)
    again.release()
    assert not any("left locked" in m for m in said)


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # A process that dies holding the lock (SIGKILL: no release): the kernel drops the lock, the name stays.
    code = f"import os; from tpurl.logging.run_dir import RunLock; RunLock({str(run)!r}); os._exit(9)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    left = (run / LOCK_FILE).read_text()
    assert left.startswith("pid ")
    said, say = _notes()
    lock = RunLock(str(run), say=say)
    assert said == [f"{run} was left locked by {left}, which is no longer running; this run takes it over"]
    lock.release()


def test_a_directory_another_run_just_made_is_not_shared(tmp_path):
    """Run A has made the directory (mkdir) but not yet claimed it when run B finds it empty: the
    exclusive claim file decides, and the loser goes to a sibling instead of failing."""
    run = tmp_path / "run"
    run.mkdir()  # A's mkdir
    said, say = _notes()
    b, _, lock_b = open_run_dir(str(run), say=say)  # B finds it empty and claims it
    assert b == str(run)
    from tpurl.logging.run_dir import _claim
    assert not _claim(str(run))  # A's claim, after its mkdir, loses
    lock_b.release()


def test_a_file_system_without_locks_is_said_not_fatal(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    said, say = _notes()
    lock = RunLock(str(tmp_path), say=say)
    lock.release()
    assert said == [f"{tmp_path} is on a file system without file locks ({os.strerror(errno.ENOLCK)}): this run "
                    "cannot stop another process from writing there at the same time"]
