"""Hugging Face PEFT LoRA adapters in and out: `adapter_config.json` + `adapter_model.safetensors`.

A PEFT adapter directory holds the LoRA settings (`r`, `lora_alpha`, `target_modules`, ...) and,
per layer and targeted module, `base_model.model.<module>.lora_A.weight` `[r, in_features]` and
`...lora_B.weight` `[out_features, r]`, where `<module>` is the Hugging Face module name
(`model.layers.{i}.self_attn.q_proj`) and the features are flattened in HF's order (`n * H + h`
for a head-split axis: a row-major reshape of ours). Ours are stacked over layers and split by
head (`tpurl.models.lora`), so per layer `lora_A.weight = A.reshape(in_features, r).T` and
`lora_B.weight = B.reshape(r, out_features).T`; both compute `x @ W + scale * (x @ A) @ B`.

- `save_peft_adapter(adapters, cfg, dir)` writes what `peft.PeftModel.from_pretrained(base, dir)`
  loads onto the base that `save_hf_checkpoint` writes (atomic, like `hf_export`);
- `peft_lora_config(dir)` reads the adapter's `LoraConfig`, refusing PEFT settings that compute
  something other than plain LoRA on every layer's projections (DoRA, per-module ranks, biases,
  saved modules, a subset of layers, ...);
- `load_peft_adapter(dir, cfg, shardings)` reads the adapters state of a model built from `cfg`;
- `with_peft_adapter(model, dir)` attaches an adapter, unmerged, to a base model.

This module reads and writes the files itself; it never imports `peft`, `torch` or `transformers`.
"""

from __future__ import annotations

import json
import numbers
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from tpurl.files import read_json_object
from tpurl.models.config import ModelConfig
from tpurl.models.hf_export import move_in, staging_dir
from tpurl.models.hf_import import _listing, _sharding_lookup
from tpurl.models.hf_mapping import param_tensors
from tpurl.models.lora import PROJECTIONS, LoraConfig, adapter_names, adapter_state, fans
from tpurl.models.safetensors_reader import SliceReader, TensorInfo, read_header
from tpurl.models.transformer import Transformer, abstract_model
from tpurl.sharding.host import barrier, is_writer, to_host, to_mesh

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."

# PEFT settings that make an adapter compute something other than plain LoRA on every layer's
# projections (or carry weights beside it): a value other than null / false / empty is refused.
_UNSUPPORTED = {
    "modules_to_save": "tpurl loads adapters only, not whole modules saved beside them; train without modules_to_save",
    "layers_to_transform": "tpurl adapts every layer; train on all layers (layers_to_transform null)",
    "layers_pattern": "tpurl adapts every layer; train on all layers (layers_pattern null)",
    "exclude_modules": "tpurl adapts every layer's targets; train without exclude_modules",
    "rank_pattern": "tpurl gives every module one rank; train with r alone (rank_pattern {})",
    "alpha_pattern": "tpurl gives every module one alpha; train with lora_alpha alone (alpha_pattern {})",
    "use_dora": "tpurl implements plain LoRA, not DoRA; train with use_dora=false",
    "fan_in_fan_out": "that layout is for Conv1D (GPT-2) weights; Llama and Qwen adapters have fan_in_fan_out=false",
    "lora_bias": "tpurl's adapters have no bias; train with lora_bias=false",
    "target_parameters": "tpurl adapts modules, not parameters; train with target_modules alone",
    "layer_replication": "tpurl does not replicate layers; train without layer_replication",
    "trainable_token_indices": "tpurl does not train token embeddings; train without trainable_token_indices",
    "alora_invocation_tokens": "tpurl implements plain LoRA, not activated LoRA; train without alora_invocation_tokens",
    "use_qalora": "tpurl implements plain LoRA, not QA-LoRA; train with use_qalora=false",
    "use_bdlora": "tpurl implements plain LoRA, not block-diagonal LoRA; train without use_bdlora",
    "arrow_config": "tpurl implements plain LoRA, not Arrow routing; train without arrow_config",
}


def _unset(value: Any) -> bool:
    """PEFT's "not used": null, false or an empty list / object / string (0 is a layer index)."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def _hf_modules(target: str, num_layers: int) -> list[str]:
    """The HF module of `target` in each layer (`model.layers.{i}.self_attn.q_proj`)."""
    ins, outs = PROJECTIONS[target]
    tensors = param_tensors(("layers", target), (num_layers, *(1,) * (len(ins) + len(outs))))
    return [t.name.removesuffix(".weight") for t in tensors]


def _target_aliases() -> dict[str, str]:
    """The `target_modules` names PEFT matches to each projection: every dot-suffix of its module
    name below the layer (`q_proj`, `self_attn.q_proj`) -> our target."""
    out = {}
    for target in PROJECTIONS:
        parts = _hf_modules(target, 1)[0].split(".")[3:]  # after "model.layers.0"
        out.update({".".join(parts[k:]): target for k in range(len(parts))})
    return out


def _read_config(directory: str) -> tuple[str, dict[str, Any]]:
    """`(path, dict)` of `directory/adapter_config.json`; a one-line ValueError when it is missing
    or not a JSON object."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isdir(directory):
        raise ValueError(f"adapter directory {directory} does not exist; give a PEFT adapter directory "
                         f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS} (PeftModel.save_pretrained(dir))")
    return path, read_json_object(path, "an adapter config")


def _targets(value: Any, path: str) -> tuple[str, ...]:
    """Our targets (in `PROJECTIONS` order) from PEFT's `target_modules`."""
    if isinstance(value, str) or not isinstance(value, list) or not value:
        raise ValueError(f"{path}: target_modules={value!r:.80} must be a non-empty list of module names "
                         f"(a regex is not read); save the adapter with a list such as {sorted(PROJECTIONS)}")
    aliases = _target_aliases()
    unknown = [name for name in value if not isinstance(name, str) or name not in aliases]
    if unknown:
        raise ValueError(f"{path}: target_modules {unknown} are not projections of tpurl's model; its projections "
                         f"are {list(PROJECTIONS)}: train the adapter on those only")
    chosen = {aliases[name] for name in value}
    return tuple(t for t in PROJECTIONS if t in chosen)


def _number(raw: dict[str, Any], field: str, default, kind, path: str):
    """`raw[field]` (PEFT's `default` when absent), checked to be a `kind` (never a bool)."""
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if kind is numbers.Integral else "a number"
        raise ValueError(f"{path}: {field}={value!r:.80} must be {what}; save the adapter again with a valid value")
    return value


def peft_lora_config(directory: str) -> LoraConfig:
    """The `LoraConfig` of the PEFT adapter in `directory` (its `adapter_config.json`): rank `r`,
    `lora_alpha`, `lora_dropout`, `use_rslora` and the targets (in `PROJECTIONS` order), PEFT's
    defaults where a field is absent; `base_dtype` and `init_seed` keep `LoraConfig`'s defaults.
    Settings tpurl's adapters cannot compute (`_UNSUPPORTED`, a bias, other modules) are a
    one-line ValueError naming the field and the fix."""
    path, raw = _read_config(directory)
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type={raw.get('peft_type')!r:.40} is not 'LORA'; tpurl loads LoRA adapters "
                         "only")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={raw['bias']!r:.40} trains biases beside the adapter, which tpurl's model does "
                         "not have; train with bias='none'")
    for field, fix in _UNSUPPORTED.items():
        if not _unset(raw.get(field)):
            raise ValueError(f"{path}: {field}={raw[field]!r:.80} is not supported: {fix}")
    targets = _targets(raw.get("target_modules"), path)
    rank = _number(raw, "r", 8, numbers.Integral, path)
    alpha = _number(raw, "lora_alpha", 8, numbers.Real, path)
    dropout = _number(raw, "lora_dropout", 0.0, numbers.Real, path)
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"{path}: use_rslora={rslora!r:.40} must be true or false")
    try:
        return LoraConfig(rank=int(rank), alpha=float(alpha), dropout=float(dropout), targets=targets, rslora=rslora)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _expected_tensors(cfg: ModelConfig) -> dict[str, tuple[str, int, tuple[int, int]]]:
    """PEFT tensor name -> (our adapter parameter, layer, PEFT shape) for every adapter of `cfg`."""
    shapes, rank = cfg.projection_shapes(), cfg.lora.rank
    out = {}
    for target in cfg.lora.targets:
        fan_in, fan_out = fans(target, shapes[target])
        name_a, name_b = adapter_names(target)
        for layer, module in enumerate(_hf_modules(target, cfg.num_layers)):
            out[f"{PREFIX}{module}.lora_A.weight"] = (name_a, layer, (rank, fan_in))
            out[f"{PREFIX}{module}.lora_B.weight"] = (name_b, layer, (fan_out, rank))
    return out


def _check_lora(cfg: ModelConfig, directory: str) -> None:
    """A one-line ValueError unless `cfg.lora` computes what the adapter in `directory` does."""
    if cfg.lora is None:
        raise ValueError(f"the model config has no lora; load the adapter in {directory} into "
                         "cfg.replace(lora=peft_lora_config(directory))")
    differs = cfg.lora.mismatch(peft_lora_config(directory))
    if differs:
        raise ValueError(f"{directory}: the model's LoraConfig and the adapter differ in {differs}; use "
                         "cfg.replace(lora=peft_lora_config(directory))")


def _adapter_tensors(cfg: ModelConfig, directory: str) -> dict[str, TensorInfo]:
    """The tensors of `directory/adapter_model.safetensors`, checked against the adapters of `cfg`:
    none missing, none unexpected, every shape the model's, floating dtypes."""
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.exists(path):
        hint = " (convert adapter_model.bin: save with safe_serialization=True)" if os.path.exists(
            os.path.join(directory, "adapter_model.bin")) else ""
        raise ValueError(f"{path} does not exist{hint}; a PEFT adapter directory holds {ADAPTER_WEIGHTS}")
    present, expected = read_header(path), _expected_tensors(cfg)
    missing = [name for name in expected if name not in present]
    if missing:
        raise ValueError(f"{path}: tensors missing from the adapter: {_listing(missing)}; it was not saved for "
                         f"this model's {cfg.num_layers} layers and targets {list(cfg.lora.targets)}")
    unexpected = [name for name in present if name not in expected]
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors in the adapter: {_listing(unexpected)}; it belongs to a base "
                         f"model with other layers or modules than this {cfg.num_layers}-layer {cfg.model_type}")
    for name, (_, _, shape) in expected.items():
        info = present[name]
        if info.shape != shape:
            raise ValueError(f"{path}: tensor {name} has shape {info.shape}, the model's is {shape}; the adapter "
                             "belongs to another base model (other widths): load it onto the base it was trained on")
        if not jnp.issubdtype(info.dtype, jnp.floating):
            raise ValueError(f"{path}: tensor {name} has dtype {info.dtype}; adapters are floating point")
    return present


def load_peft_adapter(directory: str, cfg: ModelConfig, shardings: Any = None) -> nnx.State:
    """The adapters of a model built from `cfg` read from the PEFT adapter in `directory`: the tree
    of `adapter_state(init_model(cfg))` (its `nnx.LoRAParam`s and logical axes), in
    `cfg.param_dtype`, each placed with `shardings` (a pytree of shardings holding at least the
    adapters' paths, such as `layout.param_shardings(abstract_model(cfg), mesh)`; a single
    Sharding; None: the first device). The adapter's config must match `cfg.lora` (rank, alpha,
    targets, rslora) and its tensors the model's shapes: else a one-line ValueError."""
    _check_lora(cfg, directory)
    present = _adapter_tensors(cfg, directory)
    by_param: dict[str, list[str]] = {}
    for name, (param, _, _) in _expected_tensors(cfg).items():  # layer order
        by_param.setdefault(param, []).append(name)
    state = adapter_state(abstract_model(cfg))
    flat = [(tuple(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]
    table = _sharding_lookup(shardings, [path for path, _ in flat])
    with SliceReader() as reader:
        for path, var in flat:
            abstract = var.get_value()
            value = np.empty(abstract.shape, np.dtype(abstract.dtype))
            for layer, name in enumerate(by_param[path[-1]]):
                value[layer] = reader.read(present[name]).T.reshape(abstract.shape[1:])
            var.set_value(to_mesh(value, table[path]))
    return state


def _host_adapters(adapters: nnx.State, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our adapter parameter name -> stacked host array (gathered from every process), checked
    against the adapters a model built from `cfg` has."""
    if cfg.lora is None:
        raise ValueError("save_peft_adapter: the model config has no lora; pass the config of the adapted model")
    want = {tuple(str(k) for k in path): var.get_value()
            for path, var in nnx.to_flat_state(adapter_state(abstract_model(cfg)))}
    got = {tuple(str(k) for k in path): var.get_value() if isinstance(var, nnx.Variable) else var
           for path, var in nnx.to_flat_state(nnx.State(adapters))}
    if set(got) != set(want):
        raise ValueError(f"save_peft_adapter: the adapters hold {_listing('/'.join(p) for p in got)}, the config's "
                         f"are {_listing('/'.join(p) for p in want)}; pass adapter_state(model) and model.config")
    for path, value in got.items():
        if tuple(value.shape) != tuple(want[path].shape):
            raise ValueError(f"save_peft_adapter: adapter {'/'.join(path)} has shape {tuple(value.shape)}, the "
                             f"config's is {tuple(want[path].shape)}; pass adapter_state(model) and model.config")
    return {path[-1]: value for path, value in to_host(got).items()}


def _peft_config(lora: LoraConfig, base_model: str | None) -> dict[str, Any]:
    """The `adapter_config.json` PEFT reads for `lora` (plain LoRA on every layer)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(lora.targets), "use_rslora": lora.rslora,
        "bias": "none", "base_model_name_or_path": base_model, "revision": None, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False, "lora_bias": False,
    }


def _write(directory: str, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    """Write both files into a temporary directory next to `directory`, then move them in (the
    weights first, the config last): a failure leaves an earlier adapter there untouched."""
    with staging_dir(directory) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        move_in(tmp, directory, [(name, name) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)])


def save_peft_adapter(adapters: nnx.State, cfg: ModelConfig, directory: str, *, base_model: str | None = None) -> str:
    """Write `adapters` (`adapter_state(model)` of a model built from `cfg`; sharded arrays are
    gathered) to `directory` as a PEFT LoRA adapter that `peft.PeftModel.from_pretrained(base,
    directory)` loads onto the base `save_hf_checkpoint` writes; tensors keep the adapters' dtype.
    `base_model` is recorded as `base_model_name_or_path`. Atomic (see `_write`); other files in
    `directory` are kept. In a multi-process run every process must call this; process 0 writes.
    Returns the directory's absolute path."""
    directory = os.path.abspath(directory)
    stacked = _host_adapters(adapters, cfg)
    tensors = {name: np.ascontiguousarray(stacked[param][layer].reshape(shape[::-1]).T)
               for name, (param, layer, shape) in _expected_tensors(cfg).items()}
    if is_writer():
        _write(directory, tensors, _peft_config(cfg.lora, base_model))
    barrier(f"tpurl.save_peft_adapter {directory}")
    return directory


def with_peft_config(cfg: ModelConfig, directory: str) -> ModelConfig:
    """The config of a base model `cfg` with the PEFT adapter in `directory` attached (its
    `LoraConfig`); a one-line error where they do not fit. Reads the adapter's config only."""
    if cfg.lora is not None:
        raise ValueError(f"the model already has LoRA adapters; attach the adapter in {directory} to a base model")
    lora = peft_lora_config(directory)
    try:
        return cfg.replace(lora=lora)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None


def with_peft_adapter(model: Transformer, directory: str) -> Transformer:
    """`model` (a base model, no adapters) with the PEFT adapter in `directory` attached unmerged:
    its config gains the adapter's `LoraConfig` (`with_peft_config`) and its base weights are kept
    as they are."""
    cfg = with_peft_config(model.config, directory)
    adapters = load_peft_adapter(directory, cfg)
    return nnx.merge(nnx.graphdef(abstract_model(cfg)), nnx.state(model, nnx.Param), adapters)
