"""Load Hugging Face Llama / Qwen2 / Qwen3 checkpoints straight into a sharded `Transformer`.

Streaming: every parameter is built shard by shard. For each distinct box of the checkpoint that
the addressable devices' shards need (for stacked layer parameters, one box per layer, stacked),
the loader reads it once, converts it to our layout and dtype, copies it to every device that
holds it (replicas) and drops it. The host never holds more than one shard of one parameter (plus a fixed read chunk)
beyond what the devices keep, so a model that fits across the devices loads without a second
full copy in host memory. On a multi-host mesh each process reads only its addressable shards.

    cfg = load_hf_config(path, param_dtype="bfloat16")
    shardings = layout.param_shardings(abstract_model(cfg), mesh)
    model = load_hf_checkpoint(path, config=cfg, shardings=shardings)
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from tpurl.files import read_json_object
from tpurl.models.config import ModelConfig
from tpurl.models.hf_mapping import (IGNORED_SUFFIXES, HFTensor, config_from_hf, from_hf_region, hf_region,
                                     param_tensors)
from tpurl.models.safetensors_reader import CHUNK_BYTES, SliceReader, TensorInfo, checkpoint_tensors, normalize_index
from tpurl.models.transformer import Transformer, abstract_model
from tpurl.sharding.layout import path_keys

_MAX_LISTED = 20


def load_hf_config(directory: str, **overrides) -> ModelConfig:
    """`ModelConfig` from `directory/config.json`; `overrides` replace fields (e.g. dtypes, remat).

    The checkpoint's stored dtype is not adopted: parameters are float32 (`ModelConfig`'s
    default, what training wants) unless `param_dtype=...` says otherwise."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; a Hugging Face checkpoint needs its config.json")
    return config_from_hf(read_json_object(path, "a model config"), where=path, **overrides)


def _listing(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def match_tensors(cfg: ModelConfig, present: dict[str, TensorInfo], directory: str = "checkpoint"
                  ) -> dict[tuple[str, ...], list[tuple[HFTensor, TensorInfo]]]:
    """Pair every HF tensor the model needs with its place in the checkpoint, per our parameter.

    Raises one error listing all missing names, all unexpected names, or all shape mismatches.
    An `lm_head.weight` in a tied checkpoint is ignored (tying means it equals the embedding).
    """
    _, state = nnx.split(abstract_model(cfg))
    needed: dict[tuple[str, ...], list[HFTensor]] = {
        tuple(str(k) for k in path): param_tensors(tuple(str(k) for k in path), tuple(var.get_value().shape), cfg)
        for path, var in nnx.to_flat_state(state)}
    expected = {t.name: t for tensors in needed.values() for t in tensors}
    missing = [name for name in expected if name not in present]
    if missing:
        raise ValueError(f"{directory}: tensors missing from the checkpoint: {_listing(missing)}")
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [name for name in present
                  if name not in expected and name not in ignored and not name.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        raise ValueError(f"{directory}: unexpected tensors in the checkpoint (not part of a {cfg.model_type} model "
                         f"with this config.json): {_listing(unexpected)}")
    mismatched = [f"{t.name}: checkpoint {present[t.name].shape} vs model {t.shape}"
                  for t in expected.values() if present[t.name].shape != t.shape]
    if mismatched:
        raise ValueError(f"{directory}: tensor shapes differ from config.json: {_listing(mismatched)}")
    return {path: [(t, present[t.name]) for t in tensors] for path, tensors in needed.items()}


def _sharding_lookup(shardings: Any, paths) -> dict[tuple[str, ...], jax.sharding.Sharding]:
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return {path: shardings for path in paths}
    leaves = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    table = {path_keys(p): s for p, s in leaves}
    absent = [path for path in paths if path not in table]
    if absent:
        raise ValueError(f"shardings has no entry for parameters {_listing('/'.join(p) for p in absent)}; "
                         "pass layout.param_shardings(abstract_model(cfg), mesh) or a single Sharding")
    return table


def _load_param(reader: SliceReader, cfg: ModelConfig, shape, dtype, sharding, sources) -> jax.Array:
    """One parameter, one distinct box at a time: read the box once, copy it to every device that
    holds it (replicas share a box: a `data` axis, or a layout that replicates this parameter),
    drop the host copy. The host never holds more than one box of one parameter.
    (Not `jax.make_array_from_callback`: it collects every shard's host array before copying,
    i.e. a whole extra copy of the parameter on the host, and reads replicated boxes once per
    device.)"""
    lead = len(sources[0][0].index)  # 0: unstacked; 1: stacked over layers; 2: over (layers, experts)
    by_index = {hf.index: (hf, info) for hf, info in sources}
    groups: dict[tuple, list[jax.Device]] = {}
    boxes: dict[tuple, tuple[slice, ...]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = normalize_index(index, shape)
        key = tuple((s.start, s.stop) for s in box)
        groups.setdefault(key, []).append(device)
        boxes[key] = box

    def read_box(index) -> np.ndarray:
        out = np.empty(tuple(s.stop - s.start for s in index), dtype)
        inner = index[lead:]
        for at in itertools.product(*(range(s.start, s.stop) for s in index[:lead])):
            hf, info = by_index[at]
            region = reader.read(info, hf_region(hf.kind, inner, cfg.head_dim))
            out[tuple(i - s.start for i, s in zip(at, index))] = from_hf_region(hf.kind, region, inner, cfg.head_dim)
        return out

    buffers = {}
    for key, devices in groups.items():
        box = read_box(boxes[key])
        for device in devices:
            target = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
            # block: the copy must be done before `box` is dropped (and the next one read)
            buffers[device] = jax.device_put(box, target).block_until_ready()
        del box
    ordered = [buffers[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def load_hf_checkpoint(directory: str, *, config: ModelConfig | None = None, shardings: Any = None,
                       chunk_bytes: int = CHUNK_BYTES) -> Transformer:
    """A `Transformer` with the weights of a Hugging Face checkpoint directory.

    Args:
      directory: holds `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards.
      config: the model config (default: `load_hf_config(directory)`); pass one to change dtypes or
        remat. Its shapes must match the checkpoint's tensors.
      shardings: where the parameters land: a pytree of `jax.sharding.Sharding`s shaped like
        `nnx.state(abstract_model(config))` (e.g. `layout.param_shardings(...)`), a single
        `Sharding` for all parameters, or None (the first device).
      chunk_bytes: read-buffer size for non-contiguous boxes (bounds the extra host memory).

    Weights are cast to `config.param_dtype`.
    """
    cfg = config if config is not None else load_hf_config(directory)
    sources = match_tensors(cfg, checkpoint_tensors(directory), directory)
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = [(tuple(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]
    table = _sharding_lookup(shardings, [path for path, _ in flat])
    with SliceReader(chunk_bytes) as reader:
        for path, var in flat:
            abstract = var.get_value()
            var.set_value(_load_param(reader, cfg, tuple(abstract.shape), np.dtype(abstract.dtype), table[path],
                                      sources[path]))
    return nnx.merge(graphdef, state)
