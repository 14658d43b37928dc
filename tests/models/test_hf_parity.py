"""Parity with `transformers`: checkpoints written by `save_pretrained` load into tpurl with the
same logits, load into any sharding with the same values, and tpurl's export loads back into
`transformers` unchanged."""

import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

from tpurl.models import forward_logits
from tpurl.models.hf import load_hf_checkpoint, load_hf_config, save_hf_checkpoint

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

T = 7
ATOL = 1e-4

# family, tied, heads, kv_heads, vocab: every family with every GQA ratio (heads / kv_heads = 1, 2,
# 4), tied and untied alternating so that each family has both; odd vocab sizes.
CASES = {
    "llama-untied-gqa1": ("llama", False, 4, 4, 37),
    "llama-tied-gqa2": ("llama", True, 4, 2, 39),
    "llama-untied-gqa4": ("llama", False, 4, 1, 41),
    "qwen2-tied-gqa1": ("qwen2", True, 4, 4, 45),
    "qwen2-untied-gqa2": ("qwen2", False, 4, 2, 43),
    "qwen2-tied-gqa4": ("qwen2", True, 4, 1, 47),
    "qwen3-untied-gqa1": ("qwen3", False, 4, 4, 59),
    "qwen3-tied-gqa2": ("qwen3", True, 4, 2, 53),
    "qwen3-untied-gqa4": ("qwen3", False, 4, 1, 61),
}


def test_cases_cover_every_family_tying_and_gqa_ratio():
    families = {spec[0] for spec in CASES.values()}
    for family in families:
        specs = [spec for spec in CASES.values() if spec[0] == family]
        assert {spec[1] for spec in specs} == {True, False}, family
        assert {spec[2] // spec[3] for spec in specs} == {1, 2, 4}, family
    assert families == {"llama", "qwen2", "qwen3"}


def hf_model(family, tied, heads, kv_heads, vocab, seed=0, max_positions=64):
    """A random `transformers` model whose every weight (norms and biases too) is non-trivial."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                  rms_norm_eps=1e-5, max_position_embeddings=max_positions)
    if family == "llama":
        # original_max_position_embeddings=32 with theta=500 and head_dim=8 puts one frequency in
        # each band of the Llama 3 scaling (kept, smoothed, divided by factor).
        cfg = transformers.LlamaConfig(head_dim=8, rope_theta=500.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(rope_theta=10000.0, **common), transformers.Qwen2ForCausalLM
    else:  # Qwen3's head_dim is independent of hidden_size / heads.
        cfg, cls = transformers.Qwen3Config(head_dim=16, rope_theta=10000.0, **common), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return model.eval()


def batch(vocab):
    """Row 0 full, row 1 left-padded by 3, row 2 right-padded by 2; pads hold arbitrary ids."""
    rng = np.random.default_rng(vocab)
    tokens = rng.integers(0, vocab, (3, T)).astype(np.int32)
    valid = np.ones((3, T), bool)
    valid[1, :3] = False
    valid[2, T - 2:] = False
    positions = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
    return tokens, valid, positions


def hf_logits(model, tokens, valid, positions):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(valid).long(),
                    position_ids=torch.from_numpy(positions).long())
    return out.logits.numpy()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    model = hf_model(*spec)
    path = str(tmp_path_factory.mktemp(request.param) / "hf")
    model.save_pretrained(path, safe_serialization=True)
    tokens, valid, positions = batch(spec[-1])
    return dict(name=request.param, path=path, hf=model, tokens=tokens, valid=valid,
                ref=hf_logits(model, tokens, valid, positions))


@pytest.mark.slow
def test_logits_match_transformers_and_export_round_trips(case, tmp_path):
    cfg = load_hf_config(case["path"])
    family, tied, heads, kv_heads, vocab = CASES[case["name"]]
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        family, tied, heads, kv_heads, vocab)
    model = load_hf_checkpoint(case["path"])
    ours = np.asarray(forward_logits(model, case["tokens"], case["valid"]))
    valid = case["valid"]
    assert np.abs(ours[valid] - case["ref"][valid]).max() <= ATOL
    assert np.abs(case["ref"][valid]).max() > 0.5  # the weights are not trivially small

    out = str(tmp_path / "export")
    save_hf_checkpoint(model, out, max_shard_bytes=8 * 1024)  # several shards + an index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(back) is type(case["hf"])
    want = case["hf"].state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    again = hf_logits(back, case["tokens"], valid, np.maximum(np.cumsum(valid, 1) - 1, 0))
    assert np.abs(again[valid] - case["ref"][valid]).max() <= ATOL


@pytest.mark.slow
def test_long_sequences_in_query_blocks_match_transformers(tmp_path):
    """100 tokens, long enough for the attention's three causal query blocks (the default), one row
    left-padded by 40: logits on real tokens equal `transformers`' eager attention."""
    hf = hf_model(*CASES["qwen3-tied-gqa2"], max_positions=128)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, CASES["qwen3-tied-gqa2"][-1], (2, 100)).astype(np.int32)
    valid = np.ones((2, 100), bool)
    valid[1, :40] = False
    positions = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
    model = load_hf_checkpoint(str(tmp_path))
    assert model.config.attention_query_blocks == 3
    ours = np.asarray(forward_logits(model, tokens, valid))
    ref = hf_logits(hf, tokens, valid, positions)
    assert np.abs(ours[valid] - ref[valid]).max() <= ATOL


def _spread(shape, mesh, from_last):
    """A spec sharding as many dims as divisibility allows, each over a different mesh axis,
    starting with the first or the last dim (so that both leading and trailing dims get split)."""
    free, spec = list(mesh.axis_names), [None] * len(shape)
    for i in (reversed(range(len(shape))) if from_last else range(len(shape))):
        axis = next((a for a in free if shape[i] % mesh.shape[a] == 0), None)
        if axis is not None:
            free.remove(axis)
        spec[i] = axis
    return P(*spec)


@pytest.mark.parametrize("case", ["qwen2-untied-gqa2", "qwen3-tied-gqa2"], indirect=True)
def test_sharded_load_equals_single_device_load(case, devices, tmp_path):
    """Every box a sharding can ask for (layers, heads, head_dim, embed, vocab...) is read right,
    and a sharded model exports the same tensors transformers wrote."""
    reference = dict(nnx.to_flat_state(nnx.state(load_hf_checkpoint(case["path"]))))
    grid = np.asarray(devices).reshape(2, 2, 2)
    for from_last in (False, True):
        mesh = jax.sharding.Mesh(grid if from_last else grid.transpose(2, 1, 0), ("a", "b", "c"))
        specs = {path: _spread(var[...].shape, mesh, from_last) for path, var in reference.items()}
        shardings = nnx.from_flat_state({path: NamedSharding(mesh, spec) for path, spec in specs.items()})
        model = load_hf_checkpoint(case["path"], shardings=shardings)
        for path, var in nnx.to_flat_state(nnx.state(model)):
            got = var[...]
            assert got.sharding.spec == specs[path] and got.sharding.mesh == mesh, path
            np.testing.assert_array_equal(np.asarray(got), np.asarray(reference[path][...]), err_msg=str(path))
    save_hf_checkpoint(model, str(tmp_path))
    want, got = load_file(os.path.join(case["path"], "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
