"""`SandboxConfig`: the limits of one sandboxed execution and the size of the pool that runs them."""

from __future__ import annotations

import dataclasses
import math
import os

from tpurl.config_types import check_types

# The longest wall clock one execution may have: a test that runs a day is a hung candidate, and
# the limits derived from it (RLIMIT_CPU) must stay within what the kernel takes.
MAX_TIMEOUT_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed execution (see `tpurl.sandbox`).

    `timeout_s`: wall clock; the whole process tree is killed when it runs out. `cpu_seconds`:
    RLIMIT_CPU (None: `ceil(timeout_s) + 1`, a backstop behind the wall clock). `memory_mb`:
    RLIMIT_AS (address space, so it also bounds a memory bomb that never touches its pages).
    `file_size_mb`: RLIMIT_FSIZE, the largest file the code may write. `max_processes`: processes
    and threads the code may hold at once (RLIMIT_NPROC under its own uid, or a pids cgroup).
    `output_bytes`: stdout and stderr are each kept up to this many bytes (the rest is read and
    dropped, so a writer never blocks). `result_bytes`: the same cap on the grader's result channel.
    `tmpfs_mb`: size of the private `/tmp` (and `/var/tmp`, `/dev/shm`) where a mount namespace is
    available. `workers`: executions a `SandboxPool` runs at once (None: the CPU count).
    `python`: the interpreter that runs the code (None: this one, or a system `python3` when this
    one cannot be read by the sandbox uid). `uid_base`: sandboxed code runs as an unused uid from
    `uid_base` to `uid_base + 1023` when this process is root (None: never change uid).
    """

    timeout_s: float = 10.0
    cpu_seconds: int | None = None
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 16
    output_bytes: int = 64 * 1024
    result_bytes: int = 8 * 1024 * 1024
    tmpfs_mb: int = 64
    workers: int | None = None
    python: str | None = None
    uid_base: int | None = 61000

    def __post_init__(self):
        check_types(self)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"SandboxConfig.timeout_s={self.timeout_s} must be > 0 and at most {MAX_TIMEOUT_S:g} "
                             "seconds (a day)")
        if self.cpu_seconds is not None and not 1 <= self.cpu_seconds <= MAX_TIMEOUT_S:
            raise ValueError(f"SandboxConfig.cpu_seconds={self.cpu_seconds} must be in [1, {MAX_TIMEOUT_S:g}] (or "
                             "None: derived from timeout_s)")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxConfig.memory_mb={self.memory_mb} is too small for a Python interpreter; "
                             "use >= 64")
        for name in ("file_size_mb", "max_processes", "output_bytes", "result_bytes", "tmpfs_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxConfig.{name}={getattr(self, name)} must be >= 1")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"SandboxConfig.workers={self.workers} must be >= 1 (or None: the CPU count)")
        if self.python is not None and not os.path.isabs(self.python):
            raise ValueError(f"SandboxConfig.python={self.python!r} must be an absolute path (or None: found "
                             "automatically)")
        if self.uid_base is not None and not 1000 <= self.uid_base <= 2**31 - 2048:
            raise ValueError(f"SandboxConfig.uid_base={self.uid_base} must be an unused uid >= 1000 (or None: "
                             "never change uid)")

    def replace(self, **changes) -> SandboxConfig:
        return dataclasses.replace(self, **changes)

    @property
    def cpu_limit(self) -> int:
        """RLIMIT_CPU in seconds: `cpu_seconds`, or derived from the wall clock."""
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout_s) + 1

    @property
    def num_workers(self) -> int:
        return self.workers if self.workers is not None else (os.cpu_count() or 1)
