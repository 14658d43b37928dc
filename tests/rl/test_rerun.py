"""`tpurl train` run again into the same run directory, with and without checkpoints: the first
run's files stay byte-identical and the second run writes to a fresh sibling directory; `--resume`
with nothing to resume is one line and changes nothing; resuming a finished run logs no second
final evaluation; a damaged latest checkpoint is skipped for the one before it; a checkpoint that
does not fit the run's config and a damaged log are one-line errors.

The runs go through the real CLI dispatcher (`tpurl.commands.main.main`) in this process, at the sizes of
`configs/test_tiny.gin` with one RL step."""

import glob
import hashlib
import os

import pytest

from tpurl.commands import main as cli
from tpurl.logging import read_jsonl

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")


def train(capfd, run_dir, *params, flags=()):
    """Run `tpurl train` on the tiny config; returns (exit status, stderr lines)."""
    argv = ["train", "--quiet", "--gin_file", GIN, *flags]
    for p in (f"tpurl.LoggingConfig.run_dir='{run_dir}'", "tpurl.RLConfig.steps=1", "tpurl.EvalConfig.pass_k=1",
              *params):
        argv += ["--gin_param", p]
    capfd.readouterr()
    rc = cli.main(argv)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    # The tiny model's 2 kv heads on a 4-way tensor axis are replicated, with a warning: not errors.
    return rc, [line for line in err.splitlines() if not line.startswith("WARNING:tpurl.sharding.layout")]


def snapshot(directory) -> dict[str, str]:
    """sha256 of every file under `directory` (paths relative to it), and its permissions."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(path):
            rel = os.path.relpath(path, directory)
            out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest() + f" {os.stat(path).st_mode:o}"
    return out


def siblings(run_dir) -> list[str]:
    return sorted(glob.glob(f"{run_dir}-*"))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("rerun")


def test_rerun_without_checkpoints(tmp, capfd):
    run_dir = tmp / "plain"
    rc, _ = train(capfd, run_dir)  # CheckpointConfig.every_steps=0: no checkpoints
    assert rc == 0
    first = snapshot(run_dir)
    assert {"metrics.jsonl", "eval.jsonl", "trajectories.jsonl", "manifest.json", "summary.json"} <= set(first)
    assert all(mode.endswith("644") for mode in (v.split()[1] for v in first.values()))  # not mkstemp's 0600

    rc, err = train(capfd, run_dir)
    assert rc == 0 and snapshot(run_dir) == first  # nothing of the first run lost or changed
    [second] = siblings(run_dir)
    assert err == [f"[tpurl] {run_dir} holds an earlier run, which is left as it is; this run writes to {second}",
                   "[tpurl] checkpoints are off (CheckpointConfig.every_steps=0): this run cannot be resumed if it stops"]
    assert [r["step"] for r in read_jsonl(os.path.join(second, "metrics.jsonl"))] == [1]

    # --resume with nothing to resume: one line, status 2, nothing created or changed.
    rc, err = train(capfd, run_dir, flags=["--resume"])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"tpurl train: nothing to resume: {run_dir} holds no "
                                                           "checkpoint")
    assert snapshot(run_dir) == first and siblings(run_dir) == [second]


def test_rerun_with_checkpoints_then_resume(tmp, capfd):
    run_dir = tmp / "ckpt"
    ck = "tpurl.CheckpointConfig.every_steps=1"  # checkpoints at steps 0 (the warm start) and 1
    rc, _ = train(capfd, run_dir, ck)
    assert rc == 0 and sorted(os.listdir(run_dir / "checkpoints")) == ["0", "1"]
    first = snapshot(run_dir)

    # Again into the same directory, without --resume (before: a traceback, "already holds checkpoints").
    rc, err = train(capfd, run_dir, ck)
    [second] = siblings(run_dir)
    assert rc == 0 and snapshot(run_dir) == first
    assert err == [f"[tpurl] {run_dir} holds an earlier run (--resume continues it), which is left as it is; "
                   f"this run writes to {second}"]
    assert [r["step"] for r in read_jsonl(os.path.join(second, "eval.jsonl"))] == [0, 1]

    # A checkpoint written with another config: one line, nothing changed; named as intended, the
    # shapes still do not fit: one line again.
    rc, err = train(capfd, run_dir, ck, "tpurl.model_preset.num_layers=3", flags=["--resume"])
    assert rc == 2 and err == ["tpurl train: the config differs from the one checkpoint step 1 was written with: "
                               "model.num_layers 2 -> 3; resume with that config, or name the changes you intend "
                               "with --resume-changed model.num_layers"], err
    rc, err = train(capfd, run_dir, ck, "tpurl.model_preset.num_layers=3", flags=["--resume-changed", "model.num_layers"])
    assert rc == 2 and len(err) == 2 and err[0].startswith("[tpurl] resuming from checkpoint step 1 with changed"), err
    assert err[1].startswith(f"tpurl train: checkpoint {run_dir}/checkpoints/1 does not fit the run: ") and \
        err[1].endswith("; resume with the config the checkpoint was written with")
    assert snapshot(run_dir) == first

    # Resuming the finished run evaluates the final policy again but logs it once.
    rc, err = train(capfd, run_dir, ck, flags=["--resume"])
    assert rc == 0, err
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "eval.jsonl"))] == [0, 1]
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [1]

    # A damaged latest checkpoint: skipped (and moved aside) for the one before it.
    data = [p for p in glob.glob(f"{run_dir}/checkpoints/1/arrays/**", recursive=True)
            if os.path.isfile(p) and "/d/" in p]
    assert data
    for path in data:
        with open(path, "wb") as f:
            f.write(b"damaged")
    rc, err = train(capfd, run_dir, ck, flags=["--resume"])
    assert rc == 0, err
    assert len(err) == 1 and err[0].startswith("[tpurl] checkpoint step 1 does not restore (") and \
        err[0].endswith(f"moved it to {run_dir}/checkpoints.damaged/1, resuming from step 0")
    assert os.path.isdir(run_dir / "checkpoints.damaged" / "1")
    # Resumed from step 0 and ran step 1 again: one record per step, one evaluation per step.
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [1]
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "eval.jsonl"))] == [0, 1]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["0", "1"]  # step 1 saved afresh

    # A damaged log line: one line naming the file and line.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "oops\n')
    rc, err = train(capfd, run_dir, ck, flags=["--resume"])
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"tpurl train: {run_dir}/metrics.jsonl:2 is not a JSON record (") and \
        err[0].endswith("the log is damaged: delete that line (or restore the file) and run again")
