"""A run whose disk fills up: one line saying so, where, and how to continue; no traceback of
orbax's writers; the checkpoints before the one that did not fit are kept. The run writes to a
600 KiB tmpfs mounted in a mount namespace of its own (nothing outside sees it)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from multiprocess_helpers import cpu_env

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")


@pytest.mark.slow  # a whole run in a subprocess
def test_a_full_disk_is_one_line(tmp_path):
    unshare = shutil.which("unshare")
    if not unshare or subprocess.run([unshare, "--mount", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespaces on this machine to make a small disk in")
    disk = tmp_path / "disk"
    disk.mkdir()
    train = [sys.executable, "-m", "tpurl", "train", "--quiet", "--gin_file", GIN,
             "--gin_param", f"tpurl.LoggingConfig.run_dir='{disk}/run'", "--gin_param", "tpurl.CheckpointConfig.every_steps=1"]
    script = f"mount -t tmpfs -o size=600k tmpfs {disk} && exec \"$@\""
    done = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", *train],
                          env=cpu_env(8), capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("WARNING:tpurl.sharding.layout")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    # Which write runs out depends on how much the logs took first (their paths' lengths, ...) and
    # on when a tracker's thread flushes: a checkpoint's save, or another write of the run.
    assert re.fullmatch(f"tpurl train: no space left on the device of {re.escape(str(disk))}/run"
                        r"(/checkpoints: checkpoint step \d+ was not saved \(the ones before it are kept\); free "
                        r"space there, then continue the run with --resume|: the run could not write its files; free "
                        r"space there, (then continue the run with --resume \(from checkpoint step \d+\)|and run it "
                        r"again \(it wrote no checkpoint\)))( \(traceback: .*\))?", lines[0]), lines


def test_a_full_disk_that_names_no_file_names_the_run_directory(tmp_path, monkeypatch):
    """A write that runs out of space without naming its file (a tracker's, the summary's) is one
    line naming the run directory and how to continue (from its latest checkpoint, or run again
    without one), when that directory's device is the full one; errors that say where already,
    other errors, and a full disk elsewhere pass unchanged."""
    import errno

    from tpurl.rl import loop

    bare = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(loop, "_free_bytes", lambda path: 4096)  # the run directory's device is full
    for steps, how in (((), "and run it again \\(it wrote no checkpoint\\)"),
                       ((2, 4), "then continue the run with --resume \\(from checkpoint step 4\\)")):
        for step in steps:
            (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
        with pytest.raises(OSError, match=f"^no space left on the device of {re.escape(str(tmp_path))}: the run could "
                                          f"not write its files; free space there, {how}$") as got:
            with loop.no_space_named(str(tmp_path)):
                raise bare
        assert got.value.errno == errno.ENOSPC and got.value.__cause__ is bare
    for error in (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/metrics.jsonl"),
                  OSError(errno.ENOSPC, "no space left to write /runs/r/metrics.jsonl"), OSError(errno.EIO, "io")):
        with pytest.raises(OSError) as got, loop.no_space_named(str(tmp_path)):
            raise error
        assert got.value is error
    for run_dir, free in ((None, 4096), (str(tmp_path), 1 << 30)):  # writes nothing; a full disk elsewhere
        monkeypatch.setattr(loop, "_free_bytes", lambda path: free)
        with pytest.raises(OSError) as got, loop.no_space_named(run_dir):
            raise bare
        assert got.value is bare
