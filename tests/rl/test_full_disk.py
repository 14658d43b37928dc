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

pytestmark = pytest.mark.slow  # a whole run in a subprocess

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")


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
                        r"(/checkpoints: checkpoint step \d+ was not saved \(the ones before it are kept\)|: the run "
                        r"could not write its files); free space there, then continue the run with --resume"
                        r"( \(traceback: .*\))?", lines[0]), lines


def test_a_full_disk_that_names_no_file_names_the_run_directory():
    """A write that runs out of space without naming its file (a tracker's, the summary's) is
    one line naming the run directory; errors that say where already, or other errors, pass."""
    import errno

    from tpurl.rl.loop import no_space_named

    with pytest.raises(OSError, match=r"^no space left on the device of /runs/r: the run could not write its files; "
                                      r"free space there, then continue the run with --resume$") as got:
        with no_space_named("/runs/r"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert got.value.errno == errno.ENOSPC
    for error in (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/metrics.jsonl"),
                  OSError(errno.ENOSPC, "no space left to write /runs/r/metrics.jsonl"), OSError(errno.EIO, "io")):
        with pytest.raises(OSError) as got, no_space_named("/runs/r"):
            raise error
        assert got.value is error
    with pytest.raises(OSError) as got, no_space_named(None):  # a process that writes nothing
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(got.value) == f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
