"""Hugging Face <-> tpurl: `config.json` fields and tensor names, shapes and layouts.

The one place that knows how a Hugging Face Llama / Qwen2 / Qwen3 checkpoint maps onto
`Transformer`'s parameters. Import (`hf_import.py`) and export (`hf_export.py`) both go through
`param_tensors` and the per-kind transforms below, so the two directions cannot drift apart.

Layouts (HF stores `nn.Linear.weight` as `[out, in]`; we store `[in, out]` split by head):

    ours                          HF                                          kind
    q_proj   [D, N, H]            self_attn.q_proj.weight   [N*H, D]          heads_in
    k/v_proj [D, K, H]            self_attn.{k,v}_proj.weight [K*H, D]        heads_in
    o_proj   [N, H, D]            self_attn.o_proj.weight   [D, N*H]          heads_out
    q_bias   [N, H]               self_attn.q_proj.bias     [N*H]             heads_bias
    gate/up  [D, F], down [F, D]  mlp.*_proj.weight         [F, D] / [D, F]   transpose
    lm_head  [D, V]               lm_head.weight            [V, D]            transpose
    embed_tokens [V, D], norms    same shapes                                 identity

Layer parameters are stacked along a leading `layers` axis on our side; HF has one tensor per
layer (`model.layers.{i}. ...`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tpurl.models.config import MODEL_TYPES, ModelConfig, RopeScaling
from tpurl.models.moe import EXPERT_NAMES, MoeConfig
from tpurl.models.transformer import stack_kind

# Our parameter path -> (HF name, or template with {i} for stacked layer parameters; kind).
_NAMES: dict[tuple[str, ...], tuple[str, str]] = {
    ("embed_tokens",): ("model.embed_tokens.weight", "identity"),
    ("norm",): ("model.norm.weight", "identity"),
    ("lm_head",): ("lm_head.weight", "transpose"),
    ("layers", "input_layernorm"): ("model.layers.{i}.input_layernorm.weight", "identity"),
    ("layers", "post_attention_layernorm"): ("model.layers.{i}.post_attention_layernorm.weight", "identity"),
    ("layers", "q_proj"): ("model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
    ("layers", "k_proj"): ("model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
    ("layers", "v_proj"): ("model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
    ("layers", "o_proj"): ("model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
    ("layers", "q_bias"): ("model.layers.{i}.self_attn.q_proj.bias", "heads_bias"),
    ("layers", "k_bias"): ("model.layers.{i}.self_attn.k_proj.bias", "heads_bias"),
    ("layers", "v_bias"): ("model.layers.{i}.self_attn.v_proj.bias", "heads_bias"),
    ("layers", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", "identity"),
    ("layers", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", "identity"),
    ("layers", "gate_proj"): ("model.layers.{i}.mlp.gate_proj.weight", "transpose"),
    ("layers", "up_proj"): ("model.layers.{i}.mlp.up_proj.weight", "transpose"),
    ("layers", "down_proj"): ("model.layers.{i}.mlp.down_proj.weight", "transpose"),
    ("layers", "router"): ("model.layers.{i}.mlp.gate.weight", "transpose"),
    # One tensor per (sparse layer, expert): our [E, ...] per layer, HF's `{j}`-th expert.
    ("layers", "experts_gate"): ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "transpose"),
    ("layers", "experts_up"): ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", "transpose"),
    ("layers", "experts_down"): ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", "transpose"),
}

# Tensors some checkpoints carry that hold nothing we need (non-persistent buffers saved by old
# transformers versions); they are skipped instead of being reported as unexpected.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


class UnsupportedCheckpointError(ValueError):
    """The checkpoint uses a model type or feature tpurl's transformer does not implement."""


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor and where it lives in our parameters.

    `path` is our parameter's path in `nnx.state(model)`; `index` its leading indices there: ()
    for an unstacked parameter, (row,) along a stacked one's `layers` axis, (row, expert) for a
    sparse layer's expert weights; `shape` the HF shape.
    """

    name: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    kind: str
    shape: tuple[int, ...]


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of one (unstacked) parameter of our shape `shape`."""
    if kind == "heads_in":
        d, x, h = shape
        return (x * h, d)
    if kind == "heads_out":
        n, h, d = shape
        return (d, n * h)
    if kind == "heads_bias":
        x, h = shape
        return (x * h,)
    if kind == "transpose":
        return tuple(reversed(shape))
    return tuple(shape)


def param_tensors(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig | None = None) -> list[HFTensor]:
    """The HF tensors that make up our parameter at `path` with (stacked) shape `shape`; `cfg` (a
    mixture-of-experts model's) places an MLP parameter's rows in the layers of its kind."""
    if path not in _NAMES and "_lora_" in path[-1]:
        raise ValueError(f"parameter {'/'.join(path)} is a LoRA adapter, which a Hugging Face model checkpoint "
                         "does not hold: write the base (`tpurl.models.lora.base_state`, or a config with "
                         "lora=None) and the adapter apart (`tpurl.models.peft.save_peft_adapter`)")
    if path not in _NAMES:
        raise ValueError(f"parameter {'/'.join(path)} has no Hugging Face name; add it to hf_mapping._NAMES")
    template, kind = _NAMES[path]
    if path[0] != "layers":
        return [HFTensor(template, path, (), kind, hf_shape(kind, shape))]
    layers = _stack_layers(path[-1], shape[0], cfg)
    if path[-1] in EXPERT_NAMES:
        return [HFTensor(template.format(i=layer, j=j), path, (row, j), kind, hf_shape(kind, shape[2:]))
                for row, layer in enumerate(layers) for j in range(shape[1])]
    return [HFTensor(template.format(i=layer), path, (row,), kind, hf_shape(kind, shape[1:]))
            for row, layer in enumerate(layers)]


def _stack_layers(name: str, rows: int, cfg: ModelConfig | None) -> list[int]:
    """The model layer of each row of a stacked parameter (`transformer.stack_kind`; a model
    without `cfg` is taken to have layers of one kind)."""
    kind = stack_kind(name)
    if kind is None or cfg is None:
        if kind == "moe":
            raise ValueError(f"parameter layers/{name} of a mixture-of-experts model: pass its ModelConfig to place "
                             "its rows in the sparse layers")
        return list(range(rows))
    return cfg.layers_of(kind)


def hf_region(kind: str, index: tuple[slice, ...], head_dim: int) -> tuple[slice, ...]:
    """The box of the HF tensor to read for the box `index` of our (unstacked) parameter.

    Slices must be normalized (explicit start/stop, step 1). Head-split dims read whole heads;
    `from_hf_region` then cuts the head_dim slice out.
    """
    if kind == "heads_in":
        sd, sx, _ = index
        return (slice(sx.start * head_dim, sx.stop * head_dim), sd)
    if kind == "heads_out":
        sx, _, sd = index
        return (sd, slice(sx.start * head_dim, sx.stop * head_dim))
    if kind == "heads_bias":
        sx, _ = index
        return (slice(sx.start * head_dim, sx.stop * head_dim),)
    if kind == "transpose":
        return tuple(reversed(index))
    return tuple(index)


def from_hf_region(kind: str, region: np.ndarray, index: tuple[slice, ...], head_dim: int) -> np.ndarray:
    """Our box `index` from the HF box `region` read at `hf_region(kind, index, head_dim)`."""
    if kind == "heads_in":
        _, sx, sh = index
        nd = region.shape[1]
        return region.T.reshape(nd, sx.stop - sx.start, head_dim)[:, :, sh]
    if kind == "heads_out":
        sx, sh, _ = index
        nd = region.shape[0]
        return region.T.reshape(sx.stop - sx.start, head_dim, nd)[:, sh, :]
    if kind == "heads_bias":
        sx, sh = index
        return region.reshape(sx.stop - sx.start, head_dim)[:, sh]
    if kind == "transpose":
        return region.T
    return region


def to_hf(kind: str, value: np.ndarray) -> np.ndarray:
    """The HF tensor (C-contiguous) of one unstacked parameter value."""
    if kind == "heads_in":
        d, x, h = value.shape
        out = value.reshape(d, x * h).T
    elif kind == "heads_out":
        n, h, d = value.shape
        out = value.reshape(n * h, d).T
    elif kind == "heads_bias":
        out = value.reshape(-1)
    elif kind == "transpose":
        out = value.T
    else:
        out = value
    return np.ascontiguousarray(out)


def _rope_from_hf(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and Llama-3 scaling from either the transformers-5 `rope_parameters` dict or the
    older top-level `rope_theta` + `rope_scaling` pair."""
    params, scaling = (hf.get(key) or {} for key in ("rope_parameters", "rope_scaling"))
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be an object (or null), not {type(value).__name__} {value!r:.60}")
    scaling = scaling or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedCheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedCheckpointError(
            f"{where}: rope type {rope_type!r} is not supported; tpurl implements 'default' and 'llama3'")
    try:
        rs = RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                         high_freq_factor=float(scaling["high_freq_factor"]),
                         original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{where}: llama3 rope scaling lacks {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: llama3 rope scaling needs numbers for factor, low_freq_factor, high_freq_factor "
                         f"and original_max_position_embeddings, got {scaling}") from None
    return float(theta), rs


def config_from_hf(hf: dict[str, Any], *, where: str = "config.json", **overrides) -> ModelConfig:
    """`ModelConfig` from a Hugging Face `config.json` dict; `overrides` replace fields (e.g.
    `param_dtype="bfloat16"`, `remat="full"`). Raises `UnsupportedCheckpointError` for model types
    and features the transformer does not implement (so nothing silently computes the wrong thing).
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"{where}: model_type {model_type!r} is not supported; tpurl loads {', '.join(MODEL_TYPES)}")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key) and model_type != "qwen3_moe":
            raise UnsupportedCheckpointError(f"{where}: mixture-of-experts ({key}={hf[key]}) is supported for "
                                             f"qwen3_moe only, not {model_type}")
    if hf.get("quantization_config"):
        raise UnsupportedCheckpointError(f"{where}: quantized checkpoints are not supported; use unquantized weights")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedCheckpointError(f"{where}: hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
    if hf.get("mlp_bias"):
        raise UnsupportedCheckpointError(f"{where}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpointError(f"{where}: use_sliding_window=true is not supported; "
                                         "tpurl attends over the full context")
    layer_types = set(hf.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        raise UnsupportedCheckpointError(f"{where}: layer_types {sorted(layer_types)} are not supported; "
                                         "only 'full_attention'")
    # Qwen2 always has q/k/v biases and no o_proj bias; in Llama and Qwen3 `attention_bias` also
    # adds an o_proj bias, which the transformer does not have.
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise UnsupportedCheckpointError(f"{where}: attention_bias=true for {model_type} (with an o_proj bias) "
                                         "is not supported")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(
            model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        )
    except KeyError as e:
        raise ValueError(f"{where}: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: a size field is not an integer ({e})") from None
    if heads < 1:
        raise ValueError(f"{where}: num_attention_heads={heads} must be a positive integer")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{where}: no head_dim and hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads}")
        head_dim = hidden // heads
    try:
        theta, scaling = _rope_from_hf(hf, where)
        fields.update(
            head_dim=int(head_dim), rope_theta=theta, rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2", qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=_moe_from_hf(hf, where) if model_type == "qwen3_moe" else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        fields.update(overrides)
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from None


def _moe_from_hf(hf: dict[str, Any], where: str) -> MoeConfig:
    """A qwen3_moe config's sparse layers (`num_experts`, or transformers 5's `num_local_experts`)."""
    if hf.get("shared_expert_intermediate_size"):
        raise UnsupportedCheckpointError(f"{where}: shared experts (shared_expert_intermediate_size) are not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if value is None:
            raise ValueError(f"{where}: required field {key!r} is missing")
    return MoeConfig(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                     intermediate_size=int(hf["moe_intermediate_size"]),
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     sparse_step=int(hf.get("decoder_sparse_step", 1)),
                     dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` dict `transformers` needs to rebuild this model.

    Rope settings use the top-level `rope_theta` / `rope_scaling` keys, which both transformers 4
    and 5 read (5 folds them into `rope_parameters`).
    """
    expected = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True),
                "qwen3_moe": (False, True)}[cfg.model_type]
    if (cfg.attention_bias, cfg.qk_norm) != expected:
        raise UnsupportedCheckpointError(
            f"ModelConfig(model_type={cfg.model_type!r}, attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm}) "
            f"has no Hugging Face equivalent; {cfg.model_type} needs attention_bias={expected[0]}, qk_norm={expected[1]}")
    scaling = None
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                   "high_freq_factor": rs.high_freq_factor,
                   "original_max_position_embeddings": rs.original_max_position_embeddings}
    out = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        if cfg.model_type in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = False
    if cfg.moe is not None:
        m = cfg.moe
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob,
                   decoder_sparse_step=m.sparse_step, mlp_only_layers=list(m.dense_layers), output_router_logits=False)
    return out
