"""The files of a Hugging Face export: normal permissions, and the temporary directory of a
killed export removed by the next one."""

import os
import stat

import pytest

from helpers import random_model
from tpurl.models import preset
from tpurl.models.hf import load_hf_checkpoint, save_hf_checkpoint


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8)
    return random_model(cfg)


def test_export_files_have_normal_permissions(model, tmp_path):
    old = os.umask(0o022)
    try:
        written = save_hf_checkpoint(model, str(tmp_path / "export"), max_shard_bytes=4096)
    finally:
        os.umask(old)
    assert len(written) > 3  # sharded: several safetensors files and an index
    for name in written:
        assert stat.S_IMODE(os.stat(tmp_path / "export" / name).st_mode) == 0o644, name


def test_interrupted_export_is_cleaned_up_by_the_next(model, tmp_path):
    killed = tmp_path / ".export.tmp-k1ll3d"  # what a kill during the export leaves
    killed.mkdir()
    (killed / "part-0.safetensors").write_bytes(b"half")
    other = tmp_path / ".other.tmp-x"  # another directory's save is not touched
    other.mkdir()
    save_hf_checkpoint(model, str(tmp_path / "export"))
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-x", "export"]
    load_hf_checkpoint(str(tmp_path / "export"))
