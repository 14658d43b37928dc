"""Save a `Transformer` as a Hugging Face checkpoint (`config.json` + safetensors) that
`transformers` loads with `AutoModelForCausalLM.from_pretrained`.

Host memory: parameters are fetched one at a time and converted tensor by tensor; at most one
stacked parameter plus one output shard (`max_shard_bytes`) are on the host at once.

Atomicity: everything is written into a temporary directory next to the target and then moved in
with `os.replace` (shards first, then stale weight files of an earlier save are removed, then
`config.json` and the index), so a crash never leaves a half-written file under a final name and
other files in the directory (a tokenizer, say) are kept. The temporary directory of a save that
was killed is removed by the next save to the same directory. Files get the usual permissions
(safetensors alone writes them 0o600).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from tpurl.files import default_file_mode
from tpurl.models.hf_mapping import config_to_hf, param_tensors, to_hf
from tpurl.models.safetensors_reader import INDEX_FILE, SINGLE_FILE
from tpurl.models.transformer import Transformer
from tpurl.sharding.host import to_host

DEFAULT_MAX_SHARD_BYTES = 4 << 30


def hf_tensors(model: Transformer, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """`(hf_name, array)` for every tensor of the HF checkpoint, one parameter fetched at a time.

    All processes of a multi-host run must iterate (fetching gathers across processes)."""
    out_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype is not None else None
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(str(k) for k in path)
        value = to_host(var[...])
        for t in param_tensors(path, value.shape, model.config):
            piece = to_hf(t.kind, value[t.index])
            yield t.name, piece if out_dtype is None else piece.astype(out_dtype)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _is_weight_file(name: str) -> bool:
    return name in (SINGLE_FILE, INDEX_FILE) or (name.startswith("model-") and name.endswith(".safetensors"))


def _write_shards(model: Transformer, tmp: str | None, max_shard_bytes: int, dtype: str | None
                  ) -> tuple[list[list[str]], int]:
    """Write `part-<k>.safetensors` files into `tmp` (on the writing process; `tmp` is None on
    the others, which only take part in the gathers). Returns the tensor names of each part and
    the total byte count."""
    parts: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    pending_bytes = total = 0
    for name, array in itertools.chain(hf_tensors(model, dtype), [(None, None)]):
        if pending and (name is None or pending_bytes + array.nbytes > max_shard_bytes):
            if tmp is not None:
                save_file(pending, os.path.join(tmp, f"part-{len(parts)}.safetensors"), metadata={"format": "pt"})
            parts.append(list(pending))
            pending, pending_bytes = {}, 0
        if name is not None:
            pending[name] = array
            pending_bytes += array.nbytes
            total += array.nbytes
    return parts, total


def save_hf_checkpoint(model: Transformer, directory: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: str | None = None, extra_config: dict[str, Any] | None = None) -> list[str]:
    """Write `model` to `directory` as a Hugging Face checkpoint; returns the files written.

    Args:
      max_shard_bytes: above this the weights are split into `model-0000i-of-0000n.safetensors`
        files with a `model.safetensors.index.json` (a single tensor larger than this gets a file
        of its own).
      dtype: store the weights in this dtype (default: the parameters' dtype).
      extra_config: extra `config.json` entries (e.g. `bos_token_id`, `eos_token_id`).

    In a multi-process run every process must call this (parameters are gathered); process 0
    writes and the others return [] once it is done (a barrier).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    cfg = model.config if dtype is None else model.config.replace(param_dtype=dtype)
    config = {**config_to_hf(cfg), **(extra_config or {})}
    directory = os.path.abspath(directory)
    with staging_dir(directory) if jax.process_index() == 0 else contextlib.nullcontext() as tmp:
        parts, total = _write_shards(model, tmp, max_shard_bytes, dtype)
        written = [] if tmp is None else _finish(directory, tmp, parts, total, config)
    if jax.process_count() > 1:
        # The other processes must not return (and, e.g., load the checkpoint) before process 0
        # has written it.
        multihost_utils.sync_global_devices(f"tpurl.save_hf_checkpoint {directory}")
    return written


def remove_interrupted_saves(directory: str) -> list[str]:
    """Delete the temporary directories that killed saves to `directory` left next to it (whoever
    saves into a directory owns it); returns their paths."""
    directory = os.path.abspath(directory)
    pattern = os.path.join(os.path.dirname(directory), f".{glob.escape(os.path.basename(directory))}.tmp-*")
    stale = [p for p in glob.glob(pattern) if os.path.isdir(p)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


@contextlib.contextmanager
def staging_dir(directory: str) -> Iterator[str]:
    """A temporary directory next to `directory` (absolute) to write a save into before `move_in`,
    made once the leftovers of interrupted saves are gone (`remove_interrupted_saves`); deleted on
    exit, so a failed save leaves `directory` as it was."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    remove_interrupted_saves(directory)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=os.path.dirname(directory))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_in(tmp: str, directory: str, names: list[tuple[str, str]]) -> None:
    """Move each `(name in tmp, name in directory)` into `directory` (made if missing), in order,
    with the permissions a new file gets (`default_file_mode`)."""
    os.makedirs(directory, exist_ok=True)
    mode = default_file_mode()
    for src, dst in names:
        os.chmod(os.path.join(tmp, src), mode)
        os.replace(os.path.join(tmp, src), os.path.join(directory, dst))


def _finish(directory: str, tmp: str, parts, total: int, config: dict) -> list[str]:
    """Write config and index next to the shards in `tmp`, then move everything into place."""
    shards = [SINGLE_FILE] if len(parts) == 1 else [_shard_name(i + 1, len(parts)) for i in range(len(parts))]
    metadata = ["config.json"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if len(parts) > 1:
        weight_map = {name: shard for names, shard in zip(parts, shards) for name in names}
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
        metadata.append(INDEX_FILE)
    move_in(tmp, directory, [(f"part-{k}.safetensors", shard) for k, shard in enumerate(shards)])
    for name in os.listdir(directory):  # weights of an earlier save that this one did not overwrite
        if _is_weight_file(name) and name not in shards and name not in metadata:
            os.remove(os.path.join(directory, name))
    # Last: a reader that sees the new index finds every shard it names.
    move_in(tmp, directory, [(name, name) for name in metadata])
    return shards + metadata
