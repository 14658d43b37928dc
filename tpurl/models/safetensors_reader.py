"""Bounded-memory reads of boxes of tensors from (sharded) safetensors checkpoints.

Why not `safetensors.safe_open`: it memory-maps the file, and every mapped page a read touches
stays in the process's resident set until the file is closed. Reading a column slice of a
`[V, D]` embedding touches all of its pages, so loading a model shard by shard would still hold a
full extra copy of the largest tensors in memory. The safetensors format is simple (an 8-byte
little-endian header length, a JSON header with dtype/shape/byte offsets, then raw row-major
data), so this module reads exactly the rows a box needs with plain `readinto` calls, through a
fixed-size chunk buffer when the box is not contiguous. Peak extra host memory per read is the
box itself plus one chunk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from typing import Sequence

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 16 << 20

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file, absolute byte offset, dtype and shape."""

    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one `.safetensors` file (reads only its header). A header that is not the
    format's JSON object of {"dtype", "shape", "data_offsets"} entries is a one-line ValueError."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not a safetensors file (header is not JSON: {e})") from None
        except RecursionError:
            raise ValueError(f"{path} is not a safetensors file (header nests JSON too deeply)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (header is a JSON {type(header).__name__}, not an object)")
    return {name: _tensor_info(path, name, entry, 8 + n, size) for name, entry in header.items()
            if name != "__metadata__"}


def _tensor_info(path: str, name: str, entry, data_start: int, size: int) -> TensorInfo:
    """One header entry as a TensorInfo, checked against the format and the file's size."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: header entry of tensor {name} {what}; the file is damaged or not written by "
                          "safetensors (save the checkpoint again)")

    if not isinstance(entry, dict):
        raise bad(f"is a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype is None:
        raise bad("has no 'dtype'")
    if dtype not in DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which tpurl cannot read")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    info = TensorInfo(path, data_start + begin, DTYPES[dtype], tuple(shape))
    if begin < 0 or end - begin != info.nbytes or data_start + end > size:
        raise ValueError(f"{path}: tensor {name} has a byte range [{begin}, {end}) that does not match "
                         f"shape {info.shape} x {dtype} or lies past the end of the file (truncated?)")
    return info


def checkpoint_tensors(directory: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory: `model.safetensors`, or the shards that
    `model.safetensors.index.json` names. Errors name the missing or inconsistent file."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, "rb") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # not JSON, or no object with the key
                raise ValueError(f"{index_path} is not a safetensors index (no valid 'weight_map': "
                                 f"{type(e).__name__}: {e})") from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {', '.join(missing)}")
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
        weight_map, files = None, [SINGLE_FILE]
    else:
        present = sorted(os.listdir(directory))
        hint = (" (PyTorch .bin weights must be converted to safetensors first)"
                if any(p.endswith((".bin", ".pt", ".pth")) for p in present) else "")
        raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}; "
                                f"it contains: {', '.join(present) or 'nothing'}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for tensor, info in read_header(os.path.join(directory, name)).items():
            if tensor in tensors:
                raise ValueError(f"tensor {tensor} appears in both {tensors[tensor].file} and {info.file}")
            tensors[tensor] = info
    if weight_map is not None:
        absent = sorted(t for t, f in weight_map.items()
                        if t not in tensors or os.path.basename(tensors[t].file) != f)
        if absent:
            raise ValueError(f"{index_path} maps tensors to shards that do not hold them: {', '.join(absent)}")
    return tensors


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
    """Slices with explicit start/stop; only unit steps (what shardings produce) are accepted."""
    if len(index) != len(shape):
        raise ValueError(f"index {index} does not match shape {tuple(shape)}")
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index {index}: only unit-step slices can be read")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class SliceReader:
    """Reads boxes of tensors. Keeps file handles open until `close()` (no memory is mapped)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._files: dict[str, object] = {}
        self._lock = threading.Lock()  # seek + readinto on a shared handle must not interleave

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _readinto(self, info: TensorInfo, offset: int, out: np.ndarray) -> None:
        if not out.flags.c_contiguous:  # reshape would copy and the read would land in the copy
            raise ValueError("SliceReader: read target must be C-contiguous")
        view = memoryview(out.reshape(-1).view(np.uint8))
        with self._lock:
            f = self._files.get(info.file)
            if f is None:
                f = self._files[info.file] = open(info.file, "rb", buffering=0)
            f.seek(info.offset + offset)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{info.file}: unexpected end of file (truncated checkpoint?)")
                done += n

    def read(self, info: TensorInfo, index: Sequence[slice] | None = None) -> np.ndarray:
        """The box `index` (a tuple of slices; None: everything) of a tensor, in its stored dtype."""
        index = normalize_index(index if index is not None else (slice(None),) * len(info.shape), info.shape)
        out = np.empty(tuple(s.stop - s.start for s in index), info.dtype)
        if out.size == 0:
            return out
        if not info.shape:
            self._readinto(info, 0, out)
            return out
        rows, rest = index[0], index[1:]
        row_shape = info.shape[1:]
        row_bytes = math.prod(row_shape) * info.dtype.itemsize
        if all(s.start == 0 and s.stop == n for s, n in zip(rest, row_shape)):
            # Whole rows: the box is one contiguous byte range; read it straight into the output.
            self._readinto(info, rows.start * row_bytes, out)
            return out
        chunk_rows = max(1, min(rows.stop - rows.start, self.chunk_bytes // max(row_bytes, 1)))
        buf = np.empty((chunk_rows, *row_shape), info.dtype)
        for r in range(rows.start, rows.stop, chunk_rows):
            n = min(chunk_rows, rows.stop - r)
            self._readinto(info, r * row_bytes, buf[:n])
            out[r - rows.start:r - rows.start + n] = buf[(slice(0, n), *rest)]
        return out
