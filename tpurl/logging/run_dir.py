"""Which directory a run writes to, so that no run is overwritten, truncated or mixed with another.

- A new run writes to the configured directory (`LoggingConfig.run_dir`) when it does not exist
  or is empty. When it holds anything (an earlier run, finished or killed), the new run writes to a
  fresh sibling named after the time, `<run_dir>-YYYYmmdd-HHMMSS`, says so, and leaves the earlier
  run exactly as it was.
- `resume` continues the run in the configured directory from its checkpoints. Without one there,
  it is a one-line error that changes nothing, unless `or_start` asks for a new run instead.
- A resumed run owns its directory: what its interrupted writes left behind (the temporary
  directory of an export, a half-written manifest) is removed when it starts.

Directories are claimed with `mkdir`, which fails if another process got there first, so two runs
started at once never share one. And one process writes a run directory at a time: the run holds
an exclusive lock on it (`RunLock`, `<run_dir>/.tpurl-lock`) from the moment it chooses it until
it ends, so a second `--resume` of a run still going (a restart wrapper relaunching too early) is a
one-line error naming the holder, and changes nothing of the run.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import socket
import sys
import time
from typing import Callable

CHECKPOINT_DIR = "checkpoints"


def _notice(message: str) -> None:
    print(f"[tpurl] {message}", file=sys.stderr, flush=True)


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of the checkpoints in `run_dir` (committed ones: orbax renames a finished save
    to its step number)."""
    directory = os.path.join(run_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def holds_anything(path: str) -> bool:
    """Whether `path` is a directory with at least one entry in it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"LoggingConfig.run_dir={path} is a file, not a directory; choose another path")
    if not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:
        return any(True for _ in entries)


def _make(path: str) -> bool:
    """Create `path` (not its parents) if it does not exist; True if this call created it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    return True


CLAIM_FILE = ".tpurl-run"  # created exclusively by the run that takes an existing empty directory


def _claim(path: str) -> bool:
    """Take `path` for this run: create it (not its parents) if it does not exist, and, if it is
    (still) an empty directory, create `CLAIM_FILE` in it exclusively; True if this call took it.
    The exclusive create is the claim: two runs started at once never both take it, even when one
    finds the directory the other has just made."""
    if not _make(path) and holds_anything(path):
        return False
    try:
        os.close(os.open(os.path.join(path, CLAIM_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def fresh_sibling(path: str) -> str:
    """Create and return a new directory next to `path`: `<path>-YYYYmmdd-HHMMSS` (`-2`, `-3`, ...
    appended when that is taken)."""
    base = f"{path}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while not _make(candidate):  # a new name: an empty sibling may be another run's, just made
        n += 1
        candidate = f"{base}-{n}"
    return candidate


LOCK_FILE = ".tpurl-lock"


class RunDirBusy(ValueError):
    """Another process holds the run directory's lock (it is running in it)."""


class RunLock:
    """An exclusive `flock` on `<run_dir>/.tpurl-lock`, held by the process that writes the run
    until `release` (or until it dies: the kernel drops the lock of a dead process). The file says
    who holds it (pid, host, since when); a clean `release` empties it, so a name left there is a
    run that died holding the lock, which the next run takes over and says so.

    Raises `RunDirBusy` (one line naming the holder) when another process holds it."""

    def __init__(self, run_dir: str, *, say: Callable[[str], None] = _notice):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(f"{run_dir} is in use by another run ({holder or 'a process starting up'}); "
                             "nothing of it was changed; wait for that run to end (or stop it), then --resume") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_FLOCK:
                raise
            say(f"{run_dir} is on a file system without file locks ({os.strerror(e.errno)}): this run cannot stop "
                "another process from writing there at the same time")
            return
        try:
            previous = _holder(fd)
            if previous:
                say(f"{run_dir} was left locked by {previous}, which is no longer running; this run takes it over")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                          .encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Empty the lock file (the run ended cleanly) and drop the lock; idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


# flock not supported here (NFS mounted nolock, Lustre without -o flock, some FUSE mounts).
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _holder(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip()


def remove_interrupted_writes(run_dir: str) -> list[str]:
    """Delete what killed writes left in `run_dir`: temporary directories of exports
    (`.export.tmp-*`) and temporary files of atomic writes (`.tmp-*`). Returns their paths."""
    stale = sorted({*glob.glob(os.path.join(glob.escape(run_dir), ".*.tmp-*")),
                    *glob.glob(os.path.join(glob.escape(run_dir), ".tmp-*"))})
    for path in stale:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    return stale


def open_run_dir(run_dir: str, *, resume: bool = False, or_start: bool = False,
                 say: Callable[[str], None] = _notice) -> tuple[str, bool, RunLock]:
    """Decide where a run writes (see the module docstring) and lock it; returns `(directory,
    resume, lock)`: the caller releases the lock when the run ends.

    Args:
      run_dir: the configured directory.
      resume: continue the run in `run_dir` from its checkpoints.
      or_start: with `resume`, start a new run when `run_dir` has no checkpoint (else that is an
        error).
      say: how to tell the user where the run goes (it is printed whether or not the run is quiet).

    Raises a one-line ValueError when `resume` finds nothing to resume (and not `or_start`), and
    `RunDirBusy` when another process is running in `run_dir`.
    """
    run_dir = os.path.abspath(run_dir)
    if resume:
        steps = checkpoint_steps(run_dir)
        if steps:
            lock = RunLock(run_dir, say=say)  # before anything there is touched
            removed = remove_interrupted_writes(run_dir)
            if removed:
                say(f"removed what an interrupted run left in {run_dir}: "
                    f"{', '.join(os.path.basename(p) for p in removed)}")
            return run_dir, True, lock
        why = "does not exist" if not os.path.exists(run_dir) else "holds no checkpoint"
        if not or_start:
            raise ValueError(f"nothing to resume: {run_dir} {why} (checkpoints are written every "
                             "CheckpointConfig.every_steps steps); start a new run without --resume (it will not "
                             "touch this directory), or pass --resume-or-start")
        say(f"nothing to resume: {run_dir} {why}; starting a new run")
    if _claim(run_dir):
        return run_dir, False, RunLock(run_dir, say=say)
    fresh = fresh_sibling(run_dir)
    hint = " (--resume continues it)" if checkpoint_steps(run_dir) else ""
    say(f"{run_dir} holds an earlier run{hint}, which is left as it is; this run writes to {fresh}")
    return fresh, False, RunLock(fresh, say=say)
