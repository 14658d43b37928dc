"""Append-safe JSONL writers and atomic file writes for run logs.

Every JSONL record is serialized first and written with a single `write` on a file opened with
`O_APPEND`, then flushed: a crash (even SIGKILL) leaves at most the records written so far, never a
half-line followed by more data. `read_jsonl` drops a torn final line if the process died inside
the write. Whole files (manifests, summaries) are written to a temporary file in the same
directory, fsynced and renamed over the target, so a reader sees the old or the new file, never a
partial one.
"""

from __future__ import annotations

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


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (temp file in the same directory, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n")


class JsonlWriter:
    """Appends one JSON object per line; each record is a single `write` on an `O_APPEND` file."""

    def __init__(self, path: str, *, fsync: bool = False):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._fsync = fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(to_jsonable(record), sort_keys=True) + "\n").encode()
        os.write(self._fd, line)
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


def read_jsonl(path: str) -> list[dict]:
    """All complete records of a JSONL file (a torn last line from a crash is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            out.append(json.loads(line))
    return out


def truncate_jsonl(path: str, keep: Iterable[dict] | None = None, *, max_step: int) -> None:
    """Drop records with `step > max_step` (used on resume so the log restarts where the restored
    checkpoint is, instead of holding the killed run's steps twice)."""
    if not os.path.exists(path):
        return
    records = [r for r in read_jsonl(path) if r.get("step", -1) <= max_step]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
