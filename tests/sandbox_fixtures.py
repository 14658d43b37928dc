"""Helpers for sandbox tests: what a sandboxed execution may have left behind on this machine."""

from __future__ import annotations

import glob
import os
import tempfile
import time

from tpurl.sandbox.process import UID_RANGE

# Every sandbox process of this test process carries its working directory, which starts with
# this, on its command line (the settings argument); forks keep it.
SANDBOX_MARK = f"tpurl-sandbox-{os.getpid()}-"


def _live_processes() -> dict[int, tuple[bytes, int]]:
    """pid -> (command line, real uid) of every process that is not a zombie."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
        except (OSError, ValueError):
            continue
        if not fields.get("State", "Z").strip().startswith(("Z", "X")):
            out[int(p)] = (cmdline, int(fields["Uid"].split()[0]))
    return out


def leftover_processes(*markers: str, uid_base: int | None = None, wait_s: float = 2.0) -> list[str]:
    """Live processes from sandboxes of this test process, or whose command line holds one of
    `markers`, or (with `uid_base`) running as a sandbox uid, which parallel test workers share;
    waits up to `wait_s` for dying ones to go."""
    needles = [m.encode() for m in (SANDBOX_MARK, *markers)]
    end = time.monotonic() + wait_s
    while True:
        found = [f"{pid} uid={uid} {cmd[:120]!r}" for pid, (cmd, uid) in _live_processes().items()
                 if any(n in cmd for n in needles) or (uid_base is not None and uid_base <= uid < uid_base + UID_RANGE)]
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def leftover_dirs() -> list[str]:
    """Working directories of this test process's sandboxes that were not removed."""
    return glob.glob(os.path.join(tempfile.gettempdir(), SANDBOX_MARK + "*"))


def kill_marked(marker: str) -> None:
    """Kill what a deliberately unsandboxed run (a control) left running."""
    for pid, (cmd, _) in _live_processes().items():
        if marker.encode() in cmd:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
