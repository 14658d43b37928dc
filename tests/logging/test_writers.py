"""Run-log writers: JSONL records whole or not at all (short writes, a full disk, a torn tail),
damaged lines named by file and line, and atomically rewritten files keeping normal permissions."""

import errno
import json
import os
import stat

import pytest

from tpurl import files as writers
from tpurl.files import JsonlWriter, atomic_write_json, read_jsonl, truncate_jsonl


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_writes_keep_normal_permissions(tmp_path, umask_022):
    new = tmp_path / "summary.json"
    atomic_write_json(str(new), {"a": 1})
    assert _mode(new) == 0o644  # mkstemp alone gives 0o600
    kept = tmp_path / "manifest.json"
    kept.write_text("{}")
    os.chmod(kept, 0o640)
    atomic_write_json(str(kept), {"b": 2})
    assert _mode(kept) == 0o640 and json.loads(kept.read_text()) == {"b": 2}
    log = tmp_path / "metrics.jsonl"
    with JsonlWriter(str(log)) as w:
        for step in (1, 2, 3):
            w.write({"step": step})
    truncate_jsonl(str(log), max_step=2)  # what a resume does
    assert _mode(log) == 0o644 and [r["step"] for r in read_jsonl(str(log))] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "metrics.jsonl", "summary.json"]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("step", ["fchmod", "fsync", "replace", "write"])
def test_a_failed_atomic_write_keeps_the_file_it_replaces(tmp_path, monkeypatch, step):
    """A failure at any point of an atomic write (the disk fills while writing or syncing, the rename
    fails) leaves the previous file whole and no temporary file behind."""
    path = tmp_path / "summary.json"
    atomic_write_json(str(path), {"steps": 1})
    before = path.read_bytes()
    if step == "write":
        real_fdopen = os.fdopen

        class FullDisk:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[: len(data) // 2])  # half of it lands, then the disk is full
                self.f.flush()
                _no_space()

        monkeypatch.setattr(writers.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(writers.os, step, _no_space)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_json(str(path), {"steps": 2, "text": "x" * 10000})
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["summary.json"]


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(writers.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    path = str(tmp_path / "m.jsonl")
    with JsonlWriter(path) as w:
        w.write({"step": 1, "loss": 0.5})
        w.write({"step": 2, "loss": 0.25})
    monkeypatch.undo()
    assert read_jsonl(path) == [{"loss": 0.5, "step": 1}, {"loss": 0.25, "step": 2}]


def test_failed_write_leaves_no_partial_record(tmp_path, monkeypatch):
    path = str(tmp_path / "m.jsonl")
    w = JsonlWriter(path)
    w.write({"step": 1})
    real_write = os.write
    calls = []

    def disk_fills(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:5]))  # part of the record fits
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.os, "write", disk_fills)
    with pytest.raises(OSError, match="No space left"):
        w.write({"step": 2, "text": "x" * 100})
    monkeypatch.undo()
    w.write({"step": 3})  # space was freed: the log goes on with whole lines only
    w.close()
    assert open(path).read() == '{"step": 1}\n{"step": 3}\n'


def test_writer_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # killed inside a write
    with JsonlWriter(str(path)) as w:
        w.write({"step": 2})
    assert read_jsonl(str(path)) == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.parametrize("line", ['{"step": 2, "lo\n', "[1, 2]\n", b"\xff\xfe\n"])
def test_damaged_line_is_named(tmp_path, line):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + (line if isinstance(line, bytes) else line.encode()) + b'{"step": 3}\n')
    with pytest.raises(ValueError) as e:
        read_jsonl(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:2 ") and "\n" not in msg and "delete that line" in msg
    with pytest.raises(ValueError, match=f"{path}:2 "):
        truncate_jsonl(str(path), max_step=5)  # a resume says the same
