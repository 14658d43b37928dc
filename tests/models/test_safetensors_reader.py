"""`SliceReader` boxes equal numpy slicing of the tensors safetensors itself loads."""

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tpurl.models.safetensors_reader import SliceReader, checkpoint_tensors, read_header


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        "vec": rng.standard_normal(37).astype(np.float32),
        "mat": rng.standard_normal((13, 11)).astype(ml_dtypes.bfloat16),
        "cube": rng.integers(-100, 100, (6, 5, 7)).astype(np.int16),
        "scalar": np.array(2.5, np.float64),
    }
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _boxes(shape, rng, n=12):
    """Random non-empty boxes."""
    for _ in range(n):
        starts = [int(rng.integers(0, d)) for d in shape]
        yield tuple(slice(a, int(rng.integers(a + 1, d + 1))) for a, d in zip(starts, shape))


@pytest.mark.parametrize("chunk_bytes", [1, 64, 1 << 20])
def test_boxes_match_numpy(file, chunk_bytes):
    want = load_file(file)
    infos = read_header(file)
    rng = np.random.default_rng(chunk_bytes)
    with SliceReader(chunk_bytes=chunk_bytes) as reader:
        for name, value in want.items():
            assert infos[name].dtype == value.dtype and infos[name].shape == value.shape
            np.testing.assert_array_equal(reader.read(infos[name]), value)
            boxes = list(_boxes(value.shape, rng)) + [tuple(slice(None) for _ in value.shape)]
            if value.ndim:  # whole rows (contiguous) and one column band (chunked)
                boxes += [(slice(2, 5),) + tuple(slice(None) for _ in value.shape[1:])]
                boxes += [tuple(slice(None) for _ in value.shape[:-1]) + (slice(1, 3),)]
            for box in boxes:
                got = reader.read(infos[name], box)
                np.testing.assert_array_equal(got, value[box], err_msg=f"{name}{box}")
                assert got.dtype == value.dtype


def test_bad_boxes_and_files(file, tmp_path):
    info = read_header(file)["mat"]
    with SliceReader() as reader:
        with pytest.raises(ValueError, match="only unit-step"):
            reader.read(info, (slice(0, 4, 2), slice(None)))
        with pytest.raises(ValueError, match="does not match shape"):
            reader.read(info, (slice(None),))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((16).to_bytes(8, "little") + b"not json at all!")
    with pytest.raises(ValueError, match="header is not JSON"):
        checkpoint_tensors(str(tmp_path))
    bad.write_bytes((10**9).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="bad header length"):
        read_header(str(bad))
    header = b'{"x":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="dtype C64"):
        read_header(str(bad))
    for shard in ("a", "b"):  # the same tensor in two shards
        save_file({"t": np.zeros(2, np.float32)}, str(tmp_path / f"{shard}.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"t": "a.safetensors"}, "x": 1}')
    assert set(checkpoint_tensors(str(tmp_path))) == {"t"}
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"t": "a.safetensors", "u": "b.safetensors"}}')
    with pytest.raises(ValueError, match="tensor t appears in both"):
        checkpoint_tensors(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text('{"no_map": {}}')
    with pytest.raises(ValueError, match="not a safetensors index"):
        checkpoint_tensors(str(tmp_path))
