"""Weight sync across processes: 2 processes x 4 CPU devices (gloo), process 0 trains and process
1 generates. After each sync the rollout weights on process 1 equal the trainer's weights on
process 0 cast to bfloat16 (numpy's round-to-nearest-even), bit for bit, for every leaf; the
check itself fails on a wrong cast or a leaf the sync skipped."""

import os

import ml_dtypes
import numpy as np
import pytest

from multiprocess_helpers import last_json, run_workers

WORKER = os.path.join(os.path.dirname(__file__), "cross_process_worker.py")


def assert_cast_exactly(train: dict[str, np.ndarray], rollout_bits: dict[str, np.ndarray]) -> None:
    """Every train leaf has a rollout leaf whose bfloat16 bits are the numpy cast's."""
    assert sorted(rollout_bits) == sorted(train)
    for name, x in train.items():
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        assert rollout_bits[name].dtype == np.uint16, name
        np.testing.assert_array_equal(rollout_bits[name], want, err_msg=name)


def _load(path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return dict(f)


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_process")
    stdouts = run_workers([WORKER, str(out)], num_processes=2, devices_per_process=4, timeout=300)
    reports = [last_json(s) for s in stdouts]
    return out, reports


@pytest.mark.slow
def test_rollout_weights_equal_train_weights_cast_exactly(synced):
    out, reports = synced
    for r in reports:  # both processes ran the same syncs, by collective permute
        assert [x["method"] for x in r["reports"]] == ["permute", "permute"]
        assert [x["buckets"] for x in r["reports"]] == [x["buckets"] for x in reports[0]["reports"]]
    v1, v2 = _load(out / "train_v1.npz"), _load(out / "train_v2.npz")
    assert all(x.dtype == np.float32 for x in v1.values()) and len(v1) > 5
    assert not any(np.array_equal(v1[k], v2[k]) for k in v1)  # the update changed every leaf
    assert_cast_exactly(v1, _load(out / "rollout_v1.npz"))
    assert_cast_exactly(v2, _load(out / "rollout_v2.npz"))


@pytest.mark.slow  # its fixture runs two processes
def test_the_check_catches_a_wrong_cast_or_a_skipped_leaf(synced):
    out, _ = synced
    train, rollout = _load(out / "train_v2.npz"), _load(out / "rollout_v2.npz")
    name = next(k for k in train if "mlp" in k or "proj" in k)
    truncated = dict(rollout)  # bfloat16 by dropping the low 16 bits instead of rounding to nearest
    truncated[name] = (train[name].view(np.uint32) >> 16).astype(np.uint16)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_cast_exactly(train, truncated)
    skipped = dict(rollout)  # one leaf kept the previous version's weights
    skipped[name] = _load(out / "rollout_v1.npz")[name]
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_cast_exactly(train, skipped)
    missing = {k: v for k, v in rollout.items() if k != name}
    with pytest.raises(AssertionError):
        assert_cast_exactly(train, missing)
