"""Hugging Face PEFT LoRA adapters (tpurl.models.peft) against the real `peft`: tpurl's adapter
loaded by `PeftModel.from_pretrained` onto tpurl's exported base gives tpurl's logits, an adapter
PEFT wrote gives PEFT's logits in tpurl, save and load round-trip exactly (sharded too, bf16 too)
and atomically, bad adapters are one line, and `tpurl score|generate --adapter` compute the
adapted model."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import write_bpe_tokenizer
from tpurl.commands import main as cli
from tpurl.models import abstract_model, forward_logits, init_model, preset
from tpurl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from tpurl.models.lora import PROJECTIONS, LoraConfig, adapter_state
from tpurl.models.peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft_adapter, peft_lora_config,
                               save_peft_adapter, with_peft_adapter)
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
torch.set_num_threads(1)

ATOL = 1e-4
ALL = tuple(PROJECTIONS)
FAMILIES = {
    "qwen3": preset("tiny-qwen3", vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                    head_dim=16, initializer_range=0.2),
    "llama": preset("tiny", vocab_size=51, hidden_size=32, intermediate_size=40, num_heads=4, num_kv_heads=1,
                    head_dim=8, initializer_range=0.2),
}


def attach(base, lora: LoraConfig, seed: int = 1, std: float = 0.1):
    """`base` with a new adapter of `lora` whose A and B are both random (a trained adapter)."""
    cfg = base.config.replace(lora=lora)
    adapters = adapter_state(init_model(cfg))
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + std * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    return nnx.merge(nnx.graphdef(abstract_model(cfg)), nnx.state(base, nnx.Param), adapters)


def tokens_of(cfg, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()


def hf_base(path):
    """A fresh `transformers` model of tpurl's export at `path` (PEFT injects into the one it gets)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (tpurl base model, its `save_hf_checkpoint` directory)."""
    out = {}
    for family, cfg in FAMILIES.items():
        model = init_model(cfg, seed=3)
        path = str(tmp_path_factory.mktemp(family) / "base")
        save_hf_checkpoint(model, path)
        out[family] = model, path
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, targets, rslora", [
    ("qwen3", ALL, False), ("llama", ALL, False),
    ("qwen3", ("q_proj", "v_proj", "down_proj"), False), ("llama", ("k_proj", "o_proj", "gate_proj"), True)])
def test_tpurl_adapter_in_peft_gives_tpurl_logits(exported, tmp_path, family, targets, rslora):
    base, path = exported[family]
    model = attach(base, LoraConfig(rank=4, alpha=12.0, targets=targets, rslora=rslora))
    save_peft_adapter(adapter_state(model), model.config, str(tmp_path), base_model=path)
    tokens = tokens_of(model.config)
    ours = np.asarray(forward_logits(model, tokens))
    assert np.abs(ours - np.asarray(forward_logits(base, tokens))).max() > 0.1  # the adapter matters
    peft_model = peft.PeftModel.from_pretrained(hf_base(path), str(tmp_path)).eval()
    config = peft_model.peft_config["default"]
    assert (config.r, config.lora_alpha, set(config.target_modules), config.use_rslora) == (4, 12, set(targets), rslora)
    np.testing.assert_allclose(torch_logits(peft_model, tokens), ours, atol=ATOL)


def _peft_written(path: str, directory: str, **lora_kwargs):
    """A PEFT model on tpurl's export at `path` with random lora_B (new ones are zero), saved to
    `directory` by `save_pretrained`."""
    peft_model = peft.get_peft_model(hf_base(path), peft.LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(directory)
    return peft_model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family, lora_kwargs, targets", [
    ("qwen3", dict(r=4, lora_alpha=16, target_modules=list(ALL), use_rslora=True), ALL),
    ("llama", dict(r=2, lora_alpha=6, target_modules=["self_attn.q_proj", "k_proj", "mlp.up_proj"], lora_dropout=0.1,
                   task_type="CAUSAL_LM"), ("q_proj", "k_proj", "up_proj")),
])
def test_peft_adapter_in_tpurl_gives_peft_logits(exported, tmp_path, family, lora_kwargs, targets):
    _, path = exported[family]
    peft_model = _peft_written(path, str(tmp_path), **lora_kwargs)
    lora = peft_lora_config(str(tmp_path))
    assert lora == LoraConfig(rank=lora_kwargs["r"], alpha=float(lora_kwargs["lora_alpha"]), targets=targets,
                              rslora=lora_kwargs.get("use_rslora", False), dropout=lora_kwargs.get("lora_dropout", 0.0))
    base = load_hf_checkpoint(path)
    cfg = base.config.replace(lora=lora)
    adapters = load_peft_adapter(str(tmp_path), cfg)
    model = nnx.merge(nnx.graphdef(abstract_model(cfg)), nnx.state(base, nnx.Param), adapters)
    tokens = tokens_of(cfg, seed=1)
    want = torch_logits(peft_model, tokens)
    assert np.abs(want - np.asarray(forward_logits(base, tokens))).max() > 0.1
    np.testing.assert_allclose(np.asarray(forward_logits(model, tokens)), want, atol=ATOL)
    attached = with_peft_adapter(base, str(tmp_path))  # the CLI's path: the same model
    np.testing.assert_allclose(np.asarray(forward_logits(attached, tokens)), want, atol=ATOL)


def _flat(state):
    return {path: var for path, var in nnx.to_flat_state(state)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_exact_with_the_model_s_variables(tmp_path, dtype):
    base = init_model(FAMILIES["qwen3"].replace(param_dtype=dtype), seed=0)
    model = attach(base, LoraConfig(rank=3, alpha=5.0, targets=("q_proj", "o_proj", "down_proj")))
    saved = adapter_state(model)
    assert save_peft_adapter(saved, model.config, str(tmp_path / "a")) == str(tmp_path / "a")
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporary directory left
    stored = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    assert len(stored) == 2 * 3 * model.config.num_layers and {str(v.dtype) for v in stored.values()} == {dtype}
    back = load_peft_adapter(str(tmp_path / "a"), model.config)
    fresh = _flat(adapter_state(init_model(model.config)))
    assert jax.tree.structure(back) == jax.tree.structure(saved)
    for path, var in _flat(back).items():
        assert type(var) is nnx.LoRAParam and var.get_metadata() == fresh[path].get_metadata(), path
        assert var.get_value().dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(_flat(saved)[path].get_value()))


def test_config_file_is_what_peft_reads(tmp_path):
    model = attach(init_model(FAMILIES["llama"]), LoraConfig(rank=4, alpha=8.0, dropout=0.05,
                                                             targets=("v_proj", "gate_proj"), rslora=True))
    save_peft_adapter(adapter_state(model), model.config, str(tmp_path), base_model="org/base")
    config = json.load(open(tmp_path / ADAPTER_CONFIG))
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                   "use_rslora", "bias", "base_model_name_or_path", "fan_in_fan_out",
                                   "inference_mode", "use_dora")} == dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.05,
        target_modules=["gate_proj", "v_proj"], use_rslora=True, bias="none", base_model_name_or_path="org/base",
        fan_in_fan_out=False, inference_mode=True, use_dora=False)
    assert peft.PeftConfig.from_pretrained(str(tmp_path)).r == 4
    assert peft_lora_config(str(tmp_path)) == LoraConfig(rank=4, alpha=8.0, dropout=0.05,
                                                         targets=("v_proj", "gate_proj"), rslora=True)


def test_sharded_adapters_save_and_load_in_place(tmp_path, devices):
    """Adapters sharded by a layout are gathered to save; `shardings` over the whole model (as a
    run has them) places the loaded ones."""
    cfg = FAMILIES["qwen3"].replace(lora=LoraConfig(rank=4, alpha=8.0))
    mesh, layout = make_mesh(MeshConfig(shape=(2, 2, 2)), devices), layout_preset("fsdp_tp")
    adapters = adapter_state(attach(init_model(cfg.replace(lora=None)), cfg.lora))
    placed = jax.device_put(adapters, layout.param_shardings(adapter_state(abstract_model(cfg)), mesh))
    assert all(not x.sharding.is_fully_replicated for x in jax.tree.leaves(placed))
    save_peft_adapter(placed, cfg, str(tmp_path))
    back = load_peft_adapter(str(tmp_path), cfg, shardings=layout.param_shardings(abstract_model(cfg), mesh))
    for (path, var), want in zip(nnx.to_flat_state(back), jax.tree.leaves(placed)):
        assert var.get_value().sharding == want.sharding, path
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want))


def test_a_failed_save_keeps_the_earlier_adapter(tmp_path, monkeypatch):
    from tpurl.models import peft as tpurl_peft

    directory = tmp_path / "adapter"
    cfg = FAMILIES["llama"].replace(lora=LoraConfig(rank=2, targets=("q_proj",)))
    save_peft_adapter(adapter_state(attach(init_model(FAMILIES["llama"]), cfg.lora, seed=1)), cfg, str(directory))
    (directory / "README.md").write_text("kept")
    before = {name: (directory / name).read_bytes() for name in os.listdir(directory)}

    def broken(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tpurl_peft, "save_file", broken)
    with pytest.raises(OSError):
        save_peft_adapter(adapter_state(attach(init_model(FAMILIES["llama"]), cfg.lora, seed=2)), cfg, str(directory))
    assert {name: (directory / name).read_bytes() for name in os.listdir(directory)} == before
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    monkeypatch.undo()
    adapters = adapter_state(attach(init_model(FAMILIES["llama"]), cfg.lora, seed=2))
    save_peft_adapter(adapters, cfg, str(directory))
    assert (directory / "README.md").read_text() == "kept"
    np.testing.assert_array_equal(np.asarray(load_peft_adapter(str(directory), cfg)["layers"]["q_proj_lora_b"][...]),
                                  np.asarray(adapters["layers"]["q_proj_lora_b"][...]))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A good adapter (llama family; q_proj, o_proj, up_proj; rank 4) and its model config."""
    cfg = FAMILIES["llama"].replace(lora=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "up_proj")))
    path = str(tmp_path_factory.mktemp("good") / "adapter")
    save_peft_adapter(adapter_state(init_model(cfg)), cfg, path)
    return path, cfg


def _copy_with(good_path, tmp_path, config=None, tensors=None):
    """A copy of the good adapter with `config(dict)` / `tensors(dict, tmp_path)` edits (each returns the
    new value)."""
    out = tmp_path / "bad"
    out.mkdir()
    raw = json.load(open(os.path.join(good_path, ADAPTER_CONFIG)))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config(raw) if config else raw))
    stored = load_file(os.path.join(good_path, ADAPTER_WEIGHTS))
    save_file(tensors(stored, tmp_path) if tensors else stored, str(out / ADAPTER_WEIGHTS))
    return str(out)


def _set(**changes):
    return lambda raw: {**raw, **changes}


# (edit of adapter_config.json, what the one line must name)
BAD_CONFIGS = [
    (_set(peft_type="LOHA"), "peft_type='LOHA' is not 'LORA'"),
    (_set(target_modules=["q_proj", "lm_head"]), "target_modules ['lm_head'] are not projections of tpurl's model"),
    (_set(target_modules=".*q_proj"), "target_modules='.*q_proj' must be a non-empty list"),
    (_set(target_modules=[]), "target_modules=[] must be a non-empty list"),
    (_set(target_modules=["q_proj", {"a": 1}]), "target_modules [{'a': 1}] are not projections"),
    (_set(bias="lora_only"), "bias='lora_only'"),
    (_set(modules_to_save=["lm_head"]), "modules_to_save=['lm_head'] is not supported"),
    (_set(layers_to_transform=[0]), "layers_to_transform=[0] is not supported"),
    (_set(layers_to_transform=0), "layers_to_transform=0 is not supported"),
    (_set(layers_pattern="layers"), "layers_pattern='layers' is not supported"),
    (_set(rank_pattern={"q_proj": 8}), "rank_pattern={'q_proj': 8} is not supported"),
    (_set(alpha_pattern={"q_proj": 2}), "alpha_pattern={'q_proj': 2} is not supported"),
    (_set(use_dora=True), "use_dora=True is not supported"),
    (_set(fan_in_fan_out=True), "fan_in_fan_out=True is not supported"),
    (_set(lora_bias=True), "lora_bias=True is not supported"),
    (_set(r="4"), "r='4' must be an integer"),
    (_set(r=0), "LoraConfig.rank=0 must be >= 1"),
    (_set(lora_alpha=None), "lora_alpha=None must be a number"),
    (_set(lora_dropout=1.5), "LoraConfig.dropout=1.5"),
    (_set(use_rslora="yes"), "use_rslora='yes' must be true or false"),
]


@pytest.mark.parametrize("edit, names", BAD_CONFIGS, ids=[n[:40] for _, n in BAD_CONFIGS])
def test_bad_config_is_one_line(good, tmp_path, edit, names):
    path = _copy_with(good[0], tmp_path, config=edit)
    with pytest.raises(ValueError) as e:
        peft_lora_config(path)
    assert "\n" not in str(e.value) and names in str(e.value) and ADAPTER_CONFIG in str(e.value), str(e.value)


def _write_raw(text):
    def edit(path):
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            f.write(text)
    return edit


BAD_FILES = [
    (lambda p: os.remove(os.path.join(p, ADAPTER_CONFIG)), "adapter_config.json does not exist"),
    (_write_raw("{not json"), "adapter_config.json is not valid JSON"),
    (_write_raw("[1, 2]"), "adapter_config.json holds a JSON list, not an object"),
    (_write_raw('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nests JSON too deeply"),
]


@pytest.mark.parametrize("damage, names", BAD_FILES, ids=[n[:40] for _, n in BAD_FILES])
def test_bad_config_file_is_one_line(good, tmp_path, damage, names):
    path = _copy_with(good[0], tmp_path)
    damage(path)
    for load in (peft_lora_config, lambda p: load_peft_adapter(p, good[1])):
        with pytest.raises(ValueError) as e:
            load(path)
        assert "\n" not in str(e.value) and names in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="adapter directory .*nowhere does not exist"):
        peft_lora_config(str(tmp_path / "nowhere"))


def _other_model_adapter(**changes):
    """The tensors of an adapter with the good one's config on another base (`changes`)."""
    def tensors(_stored, tmp_path):
        cfg = FAMILIES["llama"].replace(**changes, lora=LoraConfig(rank=4, alpha=8.0,
                                                                   targets=("q_proj", "o_proj", "up_proj")))
        save_peft_adapter(adapter_state(init_model(cfg)), cfg, str(tmp_path / "other"))
        return load_file(str(tmp_path / "other" / ADAPTER_WEIGHTS))
    return tensors


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
# (edit of the tensors, the model config's lora (None: the good one's), what the one line must name)
BAD_ADAPTERS = [
    (lambda t, _: {k: v for k, v in t.items() if k != f"{Q0}.lora_B.weight"}, None,
     f"tensors missing from the adapter: {Q0}.lora_B.weight"),
    (lambda t, _: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 32), np.float32)}, None,
     "unexpected tensors in the adapter: base_model.model.lm_head.lora_A.weight"),
    (lambda t, _: {**t, f"{Q0}.lora_A.weight": np.zeros((4, 32), np.int32)}, None,
     f"tensor {Q0}.lora_A.weight has dtype int32"),
    (_other_model_adapter(hidden_size=48), None,
     f"tensor {Q0}.lora_A.weight has shape (4, 48), the model's is (4, 32)"),
    (_other_model_adapter(num_layers=3), None,
     "unexpected tensors in the adapter: base_model.model.model.layers.2.mlp.up_proj.lora_A.weight"),
    (_other_model_adapter(num_layers=1), None,
     "tensors missing from the adapter: base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"),
    (None, LoraConfig(rank=2, alpha=8.0, targets=("q_proj", "o_proj", "up_proj")), "differ in rank: 2 vs 4"),
    (None, LoraConfig(rank=4, alpha=4.0, targets=("q_proj", "o_proj", "up_proj")), "differ in alpha: 4.0 vs 8.0"),
    (None, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj")), "differ in targets: ('q_proj', 'o_proj') vs "
                                                                        "('q_proj', 'o_proj', 'up_proj')"),
    (None, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "up_proj"), rslora=True),
     "differ in rslora: True vs False"),
]


@pytest.mark.parametrize("tensors, lora, names", BAD_ADAPTERS, ids=[n[:50] for *_, n in BAD_ADAPTERS])
def test_bad_adapter_is_one_line(good, tmp_path, tensors, lora, names):
    path = _copy_with(good[0], tmp_path, tensors=tensors)
    cfg = good[1] if lora is None else good[1].replace(lora=lora)
    with pytest.raises(ValueError) as e:
        load_peft_adapter(path, cfg)
    assert "\n" not in str(e.value) and names in str(e.value), str(e.value)


def test_missing_weights_and_a_model_without_lora_are_one_line(good, tmp_path):
    path = _copy_with(good[0], tmp_path)
    with pytest.raises(ValueError, match="has no lora; load the adapter in .* into cfg.replace"):
        load_peft_adapter(path, good[1].replace(lora=None))
    os.remove(os.path.join(path, ADAPTER_WEIGHTS))
    open(os.path.join(path, "adapter_model.bin"), "wb").close()
    with pytest.raises(ValueError, match=r"adapter_model.safetensors does not exist \(convert adapter_model.bin"):
        load_peft_adapter(path, good[1])


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, an adapter for it and the adapted model in memory."""
    root = tmp_path_factory.mktemp("cli")
    base = init_model(FAMILIES["qwen3"].replace(vocab_size=300), seed=4)
    save_hf_checkpoint(base, str(root / "base"))
    write_bpe_tokenizer(str(root / "base"), ["the cat sat on the mat"] * 5, vocab_size=290)
    model = attach(base, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj")))
    save_peft_adapter(adapter_state(model), model.config, str(root / "adapter"))
    return str(root / "base"), str(root / "adapter"), model


def _run(capfd, *argv):
    rc = cli.main(list(argv))
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_score_with_adapter_equals_the_adapted_model(cli_checkpoint, capfd):
    base, adapter, model = cli_checkpoint
    rc, out, err = _run(capfd, "score", "--model", base, "--adapter", adapter, "--prompt", "the cat sat", "--json")
    assert rc == 0, err
    result = json.loads(out)
    ids = [t["id"] for t in result["tokens"]]
    logits = forward_logits(model, jnp.asarray([ids], jnp.int32))[0, :-1]
    want = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(ids[1:])[:, None], 1)[:, 0])
    got = np.array([t["logprob"] for t in result["tokens"][1:]])
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert result["adapter"] == adapter
    rc, out, _ = _run(capfd, "score", "--model", base, "--prompt", "the cat sat", "--json")
    plain = np.array([t["logprob"] for t in json.loads(out)["tokens"][1:]])
    assert rc == 0 and np.abs(plain - got).max() > 1e-3  # without it: the base's


@pytest.mark.slow
def test_generate_with_adapter_decodes_the_adapted_model_greedily(cli_checkpoint, capfd):
    base, adapter, model = cli_checkpoint
    prompt = [5, 17, 42, 9]
    rc, out, err = _run(capfd, "generate", "--model", base, "--adapter", adapter, "--prompt-ids", "5,17,42,9",
                        "--max-new-tokens", "5", "--temperature", "0", "--no-eos-stop", "--json")
    assert rc == 0, err
    got = json.loads(out)["completions"][0]["token_ids"]
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(jnp.argmax(forward_logits(model, jnp.asarray([ids], jnp.int32))[0, -1])))
    assert got == ids[len(prompt):]


def test_bad_adapter_flag_is_one_line_with_status_2(cli_checkpoint, tmp_path, capfd):
    base, adapter, _ = cli_checkpoint
    wide = FAMILIES["qwen3"].replace(vocab_size=300, hidden_size=48, lora=LoraConfig(rank=4, alpha=8.0))
    save_peft_adapter(adapter_state(init_model(wide)), wide, str(tmp_path / "wide"))
    cases = [(["score", "--prompt", "the cat"], str(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'} does not exist"),
             (["generate", "--prompt-ids", "5,6"], str(tmp_path / "nowhere"), "does not exist"),
             (["generate", "--prompt-ids", "5,6"], str(tmp_path / "wide"), "has shape (4, 48), the model's is (4, 32)"),
             (["score", "--prompt", "the cat"], base, "adapter_config.json does not exist")]
    for (command, *flags), directory, names in cases:
        rc, _, err = _run(capfd, command, "--model", base, "--adapter", directory, *flags)
        lines = err.splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert lines[0].startswith(f"tpurl {command}: ") and names in lines[0], lines[0]
