"""Append-safe JSONL writers and atomic file writes for run logs.

Every JSONL record is serialized first and appended whole or not at all: a short write (a full
disk, a signal) is continued until the record is complete, and a write that fails part-way is
taken back (the file is truncated to where the record began) before the error is raised. A crash
(even SIGKILL) inside a write can leave a torn last line: `read_jsonl` skips it, and a writer
opening the file cuts it off first, so it never turns into a corrupt line in the middle of the
file. Whole files (manifests, summaries) are written to a temporary file in the same directory,
fsynced and renamed over the target, so a reader sees the old or the new file, never a partial
one; the new file keeps the old one's permissions (a new one gets the umask's, as `open` would).
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from typing import Any, Iterable, Mapping

import numpy as np


def to_jsonable(x: Any) -> Any:
    """Plain-Python view of numpy / JAX scalars and arrays, dicts, lists; non-finite floats -> None."""
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, (str, bool)) or x is None:
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if hasattr(x, "__array__") or isinstance(x, np.generic):
        arr = np.asarray(x)
        if arr.ndim:
            return to_jsonable(arr.tolist())
        x = arr.item()
        if isinstance(x, (bool, int)):
            return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return str(x)


def default_file_mode() -> int:
    """The permissions `open(path, "w")` gives a new file: 0o666 less the process umask."""
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def os_no_space(error: BaseException) -> bool:
    """Whether `error` is the OS's own "No space left on device" (not an error whose message
    already says more, as `JsonlWriter`'s does)."""
    return isinstance(error, OSError) and error.errno == errno.ENOSPC and error.strerror == os.strerror(errno.ENOSPC)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, rename), with
    the permissions of the file it replaces, or the usual ones for a new file (`mkstemp` alone
    would leave 0o600)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = default_file_mode()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically: see `atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n")


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in `path` (a config file: `what` says which, e.g. "a model config"); a
    one-line ValueError naming the file when it is not valid JSON, nests too deeply to read, or
    holds something other than one object."""
    with open(path, "rb") as f:
        try:
            obj = json.load(f)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"{path} nests JSON too deeply to read; it is not {what}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; {what} is one object")
    return obj


class JsonlWriter:
    """Appends one JSON object per line, each record whole or not at all (see the module docstring)."""

    def __init__(self, path: str, *, fsync: bool = False):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._fsync = fsync
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        _cut_torn_tail(self._fd)

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(to_jsonable(record), sort_keys=True) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        done = 0
        try:
            while done < len(line):
                n = os.write(self._fd, line[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, f"no space left to write {self.path}")
                done += n
        except BaseException:
            if done:
                os.ftruncate(self._fd, start)  # take the partial record back
            raise
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cut_torn_tail(fd: int) -> None:
    """Truncate an unfinished last line (a writer killed inside a write) so that the next record
    starts on a line of its own."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:
        chunk = os.pread(fd, min(65536, end), end - min(65536, end))
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            end = end - len(chunk) + newline + 1
            break
        end -= len(chunk)
    os.ftruncate(fd, end)


def read_jsonl(path: str) -> list[dict]:
    """All complete records of a JSONL file (a torn last line from a crash is skipped). A complete
    line that is not a JSON object is a one-line ValueError naming the file and line."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break
            try:
                record = json.loads(raw)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{path}:{n} is not a JSON record ({e}); the log is damaged: delete that line "
                                 "(or restore the file) and run again") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n} holds {type(record).__name__} {str(record)[:40]!r}, not a JSON "
                                 "object; the log is damaged: delete that line (or restore the file) and run again")
            out.append(record)
    return out


def truncate_jsonl(path: str, keep: Iterable[dict] | None = None, *, max_step: int) -> None:
    """Drop records with `step > max_step` (used on resume so the log restarts where the restored
    checkpoint is, instead of holding the killed run's steps twice)."""
    if not os.path.exists(path):
        return
    records = [r for r in read_jsonl(path) if r.get("step", -1) <= max_step]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
