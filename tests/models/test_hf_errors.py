"""Hugging Face import/export: config.json variants, every bad-input error, atomic writes."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from helpers import random_model
from tpurl.models import abstract_model, hf_export, preset
from tpurl.models.config import RopeScaling
from tpurl.models.hf import (UnsupportedCheckpointError, config_from_hf, config_to_hf, load_hf_checkpoint,
                             load_hf_config, save_hf_checkpoint)

BASE = {"model_type": "qwen2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def model():
    """A random qwen2 model built from numpy (no JAX compiles: these tests only move bytes)."""
    cfg = preset("tiny", model_type="qwen2", attention_bias=True, vocab_size=50, hidden_size=32,
                 intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8)
    return random_model(cfg)


@pytest.fixture()
def ckpt(model, tmp_path):
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(model, path)
    return path


def _rewrite(path, edit):
    """Apply `edit(dict of tensors)` to a single-file checkpoint."""
    file = os.path.join(path, "model.safetensors")
    tensors = dict(load_file(file))
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _params(m):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(m))}


def test_config_variants():
    legacy = config_from_hf({**BASE, "model_type": "llama", "head_dim": 16, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "tie_word_embeddings": True})
    v5 = config_from_hf({**BASE, "model_type": "llama", "head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "tie_word_embeddings": True})
    assert legacy == v5
    assert legacy.rope_scaling == RopeScaling(factor=32.0) and legacy.rope_theta == 5e5 and legacy.head_dim == 16
    qwen = config_from_hf({**BASE, "rope_scaling": None, "sliding_window": 4096, "use_sliding_window": False},
                          param_dtype="bfloat16")
    assert qwen.attention_bias and not qwen.qk_norm and qwen.head_dim == 8 and qwen.rope_scaling is None
    assert qwen.param_dtype == "bfloat16" and not qwen.tie_word_embeddings
    assert config_from_hf({**BASE, "model_type": "qwen3", "head_dim": 32}).qk_norm
    for cfg in (legacy, qwen):  # export -> import is the identity on every field HF can express
        assert config_from_hf(config_to_hf(cfg), param_dtype=cfg.param_dtype) == cfg


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({"num_experts": 8}, "mixture-of-experts"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"use_sliding_window": True, "sliding_window": 128}, "use_sliding_window=true"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias=true for llama"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
])
def test_unsupported_configs(change, message):
    with pytest.raises(UnsupportedCheckpointError, match=message):
        config_from_hf({**BASE, **change})


def test_invalid_configs(tmp_path):
    with pytest.raises(ValueError, match="required field 'hidden_size' is missing"):
        config_from_hf({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="no head_dim and hidden_size=30"):
        config_from_hf({**BASE, "hidden_size": 30})
    with pytest.raises(ValueError, match="lacks 'low_freq_factor'"):
        config_from_hf({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_hf_config(str(tmp_path))
    with pytest.raises(UnsupportedCheckpointError, match="has no Hugging Face equivalent"):
        config_to_hf(preset("tiny", qk_norm=True))


def test_missing_files(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .* does not exist"):
        load_hf_checkpoint(str(tmp_path / "nowhere"), config=load_hf_config(ckpt))
    os.rename(os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor .*converted to safetensors"):
        load_hf_checkpoint(ckpt)


def test_sharded_index_errors(model, tmp_path):
    path = str(tmp_path / "sharded")
    save_hf_checkpoint(model, path, max_shard_bytes=4096)
    index_file = os.path.join(path, "model.safetensors.index.json")
    original = json.load(open(index_file))
    first = original["weight_map"]["model.embed_tokens.weight"]
    other = next(f for f in original["weight_map"].values() if f != first)
    json.dump({**original, "weight_map": {**original["weight_map"], "model.embed_tokens.weight": other}},
              open(index_file, "w"))
    with pytest.raises(ValueError, match="maps tensors to shards that do not hold them: model.embed_tokens.weight"):
        load_hf_checkpoint(path)
    json.dump(original, open(index_file, "w"))
    os.remove(os.path.join(path, first))
    with pytest.raises(FileNotFoundError, match=f"names shard files that do not exist: {first}"):
        load_hf_checkpoint(path)


def test_missing_unexpected_and_mismatched_tensors(ckpt):
    _rewrite(ckpt, lambda t: [t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.norm.weight")])
    with pytest.raises(ValueError, match="missing from the checkpoint: model.layers.1.mlp.up_proj.weight, model.norm.weight"):
        load_hf_checkpoint(ckpt)
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((48, 32), np.float32),
                                       "model.norm.weight": np.ones(32, np.float32),
                                       "model.layers.2.self_attn.o_proj.weight": np.zeros((32, 32), np.float32),
                                       "model.extra.scale": np.ones(3, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensors .*: model.extra.scale, model.layers.2.self_attn.o_proj.weight"):
        load_hf_checkpoint(ckpt)
    _rewrite(ckpt, lambda t: [t.pop("model.extra.scale"), t.pop("model.layers.2.self_attn.o_proj.weight"),
                              t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 32), np.float32)})])
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight: checkpoint \(24, 32\) vs model \(16, 32\)"):
        load_hf_checkpoint(ckpt)


def test_truncated_file(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    with pytest.raises(ValueError, match="past the end of the file"):
        load_hf_checkpoint(ckpt)
    with open(file, "wb") as f:
        f.write(b"\x00" * 4)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_hf_checkpoint(ckpt)


def test_ignored_tensors_and_dtype_cast(model, ckpt):
    """Old checkpoints carry rotary inv_freq buffers; bf16 weights are cast to the config's dtype."""
    _rewrite(ckpt, lambda t: t.update({k: v.astype("bfloat16") for k, v in t.items()} |
                                      {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    loaded = load_hf_checkpoint(ckpt)
    want = {p: v.astype("bfloat16").astype(np.float32) for p, v in _params(model).items()}
    for path, value in _params(loaded).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))
    as_bf16 = load_hf_checkpoint(ckpt, config=load_hf_config(ckpt, param_dtype="bfloat16"))
    assert all(v.dtype == np.dtype("bfloat16") for v in _params(as_bf16).values())


def test_tied_checkpoint_may_carry_lm_head(model, ckpt):
    """Tied means lm_head is the embedding: a stored copy is ignored, not reported as unexpected."""
    config = json.load(open(os.path.join(ckpt, "config.json")))
    json.dump({**config, "tie_word_embeddings": True}, open(os.path.join(ckpt, "config.json"), "w"))
    _rewrite(ckpt, lambda t: t.update({"lm_head.weight": np.zeros_like(t["model.embed_tokens.weight"])}))
    loaded = _params(load_hf_checkpoint(ckpt))
    assert ("lm_head",) not in loaded
    for p, v in _params(model).items():
        if p != ("lm_head",):
            np.testing.assert_array_equal(loaded[p], v)


def test_shardings_must_cover_every_parameter(ckpt):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="shardings has no entry for parameters .*embed_tokens"):
        load_hf_checkpoint(ckpt, shardings={"norm": NamedSharding(mesh, P())})


def test_export_is_atomic_and_replaces_stale_weights(model, tmp_path, monkeypatch):
    path = tmp_path / "out"
    save_hf_checkpoint(model, str(path), max_shard_bytes=4096)
    assert (path / "model.safetensors.index.json").exists()
    (path / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    calls = []

    def failing_save(tensors, file, metadata=None):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, file, metadata=metadata)

    monkeypatch.setattr(hf_export, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(model, str(path), max_shard_bytes=4096)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # untouched
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left behind
    monkeypatch.undo()

    written = save_hf_checkpoint(model, str(path))  # now one file: the old shards and index must go
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(written) == ["config.json", "model.safetensors"]
    for p, v in _params(load_hf_checkpoint(str(path))).items():
        np.testing.assert_array_equal(v, _params(model)[p])
    with pytest.raises(ValueError, match="max_shard_bytes=0 must be positive"):
        save_hf_checkpoint(model, str(path), max_shard_bytes=0)
    shutil.rmtree(path)


def test_export_waits_for_the_writer_in_multiprocess_runs(model, tmp_path, monkeypatch):
    """With several processes every one passes a barrier after process 0 has written, so none
    returns (and reads the directory) early. Simulated: process_count 2, this is process 0."""
    path = tmp_path / "out"
    barriers = []

    def barrier(name):
        barriers.append((name, sorted(os.listdir(path))))

    monkeypatch.setattr(hf_export.jax, "process_count", lambda: 2)
    monkeypatch.setattr(hf_export.multihost_utils, "sync_global_devices", barrier)
    written = save_hf_checkpoint(model, str(path))
    assert len(barriers) == 1 and "save_hf_checkpoint" in barriers[0][0]
    assert barriers[0][1] == sorted(written) == ["config.json", "model.safetensors"]  # complete at the barrier


def test_replicated_load_reads_each_box_once(model, ckpt, monkeypatch):
    """A layout that replicates parameters (data=2 here) reads each distinct box once and places
    it on all its devices; the loaded values equal the model's."""
    from tpurl.models import hf_import
    from tpurl.sharding.presets import layout_preset

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    shardings = layout_preset("fsdp_tp").param_shardings(abstract_model(model.config), mesh)
    reads = []
    original = hf_import.SliceReader.read

    def counting_read(self, info, index=None):
        reads.append((info.file, info.offset, tuple((s.start, s.stop) for s in index)))
        return original(self, info, index)

    monkeypatch.setattr(hf_import.SliceReader, "read", counting_read)
    loaded = load_hf_checkpoint(ckpt, config=model.config, shardings=shardings)
    assert reads and len(reads) == len(set(reads))  # no box read twice, although every box has 2 devices
    for p, v in _params(loaded).items():
        np.testing.assert_array_equal(v, _params(model)[p])


def _rewrite_header(ckpt, edit):
    """Replace the JSON header of a single-file checkpoint by `edit(header)` (the data stays)."""
    file = os.path.join(ckpt, "model.safetensors")
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    open(file, "wb").write(len(header).to_bytes(8, "little") + header + raw[8 + n:])


@pytest.mark.parametrize("edit, message", [
    (lambda h: list(h), r"header is a JSON list, not an object"),
    (lambda h: {k: ({f: x for f, x in v.items() if f != "dtype"} if k == "model.norm.weight" else v)
                for k, v in h.items()}, r"header entry of tensor model.norm.weight has no 'dtype'"),
    (lambda h: {**h, "model.norm.weight": 7}, r"header entry of tensor model.norm.weight is a JSON int"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "shape": "32"}}, r"has shape '32'"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "data_offsets": None}}, r"data_offsets None"),
])
def test_malformed_safetensors_header(ckpt, edit, message):
    _rewrite_header(ckpt, edit)
    with pytest.raises(ValueError, match=message) as e:
        load_hf_checkpoint(ckpt)
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_malformed_index(model, tmp_path):
    path = str(tmp_path / "sharded")
    save_hf_checkpoint(model, path, max_shard_bytes=4096)
    index_file = os.path.join(path, "model.safetensors.index.json")
    for content, message in [("[1, 2]", "is not a safetensors index"), ('{"weight_map": [1]}', "must map tensor names"),
                             ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "RecursionError")]:
        open(index_file, "w").write(content)
        with pytest.raises(ValueError, match=message):
            load_hf_checkpoint(path)


def test_zero_attention_heads():
    with pytest.raises(ValueError, match=r"^config.json: num_attention_heads=0 must be a positive integer$"):
        config_from_hf({**BASE, "num_attention_heads": 0})


@pytest.mark.parametrize("key, value", [("rope_scaling", "llama3"), ("rope_scaling", [8.0]), ("rope_parameters", 1e4)])
def test_rope_settings_of_the_wrong_type(key, value):
    with pytest.raises(ValueError, match=rf"^config.json: {key} must be an object \(or null\), not "):
        config_from_hf({**BASE, key: value})


def test_rope_scaling_numbers_that_are_not():
    scaling = {"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="llama3 rope scaling needs numbers for factor"):
        config_from_hf({**BASE, "model_type": "llama", "rope_scaling": scaling})


@pytest.mark.parametrize("key, value, message", [("rope_theta", float("inf"), "ModelConfig.rope_theta=inf must be a finite"),
                                                 ("rms_norm_eps", float("nan"), "ModelConfig.rms_norm_eps=nan must be"),
                                                 ("rope_theta", -1.0, "need rope_theta > 0")])
def test_non_finite_or_absurd_numbers(key, value, message):
    """json reads `Infinity` and `NaN`: a config.json can hold them."""
    with pytest.raises(ValueError, match=message):
        config_from_hf({**BASE, key: value})


def test_deeply_nested_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="config.json nests JSON too deeply"):
        load_hf_config(str(tmp_path))
