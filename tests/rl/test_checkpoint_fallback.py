"""Resuming from the newest checkpoint that restores: a damaged one (unreadable, or bytes changed
with every size kept) is reported and moved aside, one without checksums restored unverified with
a line; one written with another structure or shapes is a one-line error at once."""

import glob
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.checkpoint import CHECKSUM_FILE, Checkpointer, CheckpointMismatchError

TREE = {"w": jnp.arange(1000.0), "b": jnp.ones((30, 30))}


def _damage(directory, step):
    files = [p for p in glob.glob(f"{directory}/{step}/arrays/**", recursive=True) if os.path.isfile(p) and "/d/" in p]
    assert files
    for path in files:
        with open(path, "wb") as f:
            f.write(b"damaged")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 2 and 4, written once (orbax's saves take about a second)."""
    directory = str(tmp_path_factory.mktemp("saved") / "checkpoints")
    ck = Checkpointer(directory, max_to_keep=3)
    for step in (2, 4):
        ck.save(step, {"w": TREE["w"] + step, "b": TREE["b"]}, {"step": step})
    ck.close()
    return directory


@pytest.fixture()
def ckpt(saved, tmp_path):
    """A copy of them for one test to damage."""
    return shutil.copytree(saved, str(tmp_path / "checkpoints"))


def test_damaged_latest_falls_back_to_the_previous(ckpt, capfd):
    _damage(ckpt, 4)
    ck = Checkpointer(ckpt, max_to_keep=3)
    said = []
    step, tree, meta = ck.restore_latest(TREE, say=said.append)
    assert (step, meta) == (2, {"step": 2}) and np.array_equal(np.asarray(tree["w"]), np.arange(1000.0) + 2)
    assert len(said) == 1 and said[0].startswith("checkpoint step 4 does not restore (")
    assert said[0].endswith(f"moved it to {ckpt}.damaged/4, resuming from step 2") and "\n" not in said[0]
    assert "TensorStore" not in said[0] and capfd.readouterr().err == ""  # no tracebacks of orbax's readers
    assert ck.all_steps() == [2] and os.path.isdir(f"{ckpt}.damaged/4")
    ck.save(4, TREE, {"step": 4})  # the run saves that step again
    assert ck.all_steps() == [2, 4]
    ck.close()


def _flip(directory, step):
    """Flip 64 bytes in the middle of the largest array file: every size stays the same."""
    path = max((p for p in glob.glob(f"{directory}/{step}/arrays/**", recursive=True)
                if os.path.isfile(p) and "/d/" in p), key=os.path.getsize)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(path) == size
    return os.path.relpath(path, f"{directory}/{step}")


def test_changed_bytes_are_damage(ckpt):
    """Bytes flipped with the size unchanged restore without error in orbax (other weights, from then
    on, silently): the checksums catch them."""
    what = _flip(ckpt, 4)
    ck = Checkpointer(ckpt, max_to_keep=3)
    said = []
    step, tree, _ = ck.restore_latest(TREE, say=said.append)
    assert step == 2 and np.array_equal(np.asarray(tree["w"]), np.arange(1000.0) + 2)
    assert said == [f"checkpoint step 4 does not restore (ChecksumError: its files differ from what was saved: {what} "
                    f"(changed)); moved it to {ckpt}.damaged/4, resuming from step 2"]
    ck.close()


def test_a_checkpoint_without_checksums_restores_unverified_and_says_so(ckpt):
    """orbax's commit is atomic: a checkpoint whose checksums were never written (the run stopped
    right after the commit, or an older tpurl saved it) is whole, only unverified."""
    os.unlink(f"{ckpt}/4/{CHECKSUM_FILE}")
    ck = Checkpointer(ckpt, max_to_keep=3)
    said = []
    step, tree, _ = ck.restore_latest(TREE, say=said.append)
    assert step == 4 and np.array_equal(np.asarray(tree["w"]), np.arange(1000.0) + 4)
    assert said == ["checkpoint step 4 has no checksums (an older tpurl wrote it, or the run stopped right after "
                    "saving it): restored without verifying its files"]
    ck.close()


def test_no_checkpoint_restores(ckpt):
    _damage(ckpt, 2)
    _damage(ckpt, 4)
    ck = Checkpointer(ckpt, max_to_keep=3)
    with pytest.raises(ValueError, match=r"^no checkpoint in .* restores \(4 \(.*; 2 \(.*nothing was moved"):
        ck.restore_latest(TREE, say=lambda m: None)
    # None restores here: that may be this machine's fault, not the checkpoints'; both stay put.
    assert ck.all_steps() == [2, 4] and not os.path.exists(f"{ckpt}.damaged")
    ck.close()


@pytest.mark.parametrize("like, match", [
    ({"w": jnp.arange(10.0), "b": TREE["b"]}, r"\['w'\] has shape \(1000,\) there but \(10,\) here"),
    ({"w": TREE["w"]}, "has a different structure than the run"),
])
def test_another_config_is_an_error_at_once(ckpt, like, match):
    ck = Checkpointer(ckpt, max_to_keep=3)
    with pytest.raises(CheckpointMismatchError, match=match) as e:
        ck.restore_latest(like, say=pytest.fail)  # not skipped as damage
    assert "resume with the config the checkpoint was written with" in str(e.value) and "\n" not in str(e.value)
    assert ck.all_steps() == [2, 4]
    ck.close()
