"""Model configuration for the decoder-only families tpurl supports (Llama 3, Qwen2/2.5, Qwen3).

`ModelConfig` carries shapes and the few architectural switches that distinguish the families:
Qwen2's q/k/v bias (`attention_bias`), Qwen3's per-head q/k RMSNorm (`qk_norm`), Llama 3's
`rope_scaling`, tied or untied embeddings. Presets give the shapes of real checkpoints (no weights)
and tiny sizes for tests and the demo.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from tpurl.config_types import check_types
from tpurl.models.lora import LoraConfig, fans
from tpurl.models.moe import MoeConfig, layer_kinds
from tpurl.models.invariant import CONSISTENCY
from tpurl.models.quant import check_format

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type: "llama3"` in config.json)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        check_types(self)
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling: need factor > 0 and 0 < low_freq_factor < high_freq_factor, got {self}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and switches of one decoder-only transformer.

    `dtype` is the compute dtype (activations, matmul inputs); `param_dtype` the stored weights'.
    `remat` chooses activation rematerialization of each scanned layer: "none", "full" (recompute
    everything in the backward pass) or "dots" (save matmul outputs, recompute the rest).
    `attention_impl` picks the kernel of the dense (training / scoring) attention: "xla", "cudnn"
    (fused flash attention; GPU only, bf16/fp16 compute) or "auto" (cuDNN where it applies, else
    XLA; see `attention.resolve_attention_impl`).
    `unroll_layers`: layers per iteration of the layer scan in full-sequence forwards (training,
    scoring; `jax.lax.scan`'s `unroll`, capped at `num_layers`: all of them is straight-line code).
    Unrolling lets XLA fuse and schedule across layers and drops the scan's stacked residual
    buffers (faster updates, docs/performance.md); compile time grows with it, so the default
    keeps one layer per iteration. Decode steps always scan one layer at a time: unrolled, XLA
    copies the KV pool at each layer's update.
    `attention_query_blocks`: the XLA dense attention (training, scoring, prefill) splits its
    queries into this many blocks, each scored only against the keys up to its last query (the
    mask is causal), so n equal blocks cost (n + 1) / 2n of the full square: 2/3 at 3. Sequences
    shorter than 32 n tokens get fewer blocks (`attention.query_block_cuts`); 1 is one product
    over all keys. Exact (the skipped keys are masked anyway); on CPU the blocks are also
    independent ops that XLA runs concurrently (its batched products use one thread each; CPU
    figures in docs/performance.md); the FLOPs saved are the same on an accelerator.
    `lora`: low-rank adapters on the projections (`tpurl.models.lora`); a model with them trains
    only the adapters, its base frozen.
    `moe`: the sparse (mixture-of-experts) MLP layers of a `qwen3_moe` model (`tpurl.models.moe`);
    its other layers' MLPs are dense, of width `intermediate_size`.
    `quantization`: how the layer projections and experts are held: None (in `param_dtype`) or
    "fp8" (float8 e4m3 values with per-channel scales, `tpurl.models.quant`). The rollout model of
    a run with `SyncConfig.quantize`, never a model being trained.
    `consistency`: "fast", or "bitwise": batch-invariant computation (`tpurl.models.invariant`), in
    which the rollout engine's logprob of a token equals the trainer's bit for bit, whatever else
    shares the batch. Slow; for checking and small models (not with `lora` or `moe`).
    `bitwise_window`: the keys each query gathers in bitwise mode (`attention_window`); None:
    `max_position_embeddings`. An RL run sets it to its sequence length rounded up to 64.
    """

    model_type: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    unroll_layers: int = 1
    attention_query_blocks: int = 3
    lora: LoraConfig | None = None
    moe: MoeConfig | None = None
    quantization: str | None = None
    consistency: str = "fast"
    bitwise_window: int | None = None

    def __post_init__(self):
        check_types(self)
        check_format(self.quantization, "ModelConfig.quantization")
        if self.consistency not in CONSISTENCY:
            raise ValueError(f"ModelConfig.consistency={self.consistency!r}; use one of {CONSISTENCY}")
        if self.bitwise_window is not None and not 0 < self.bitwise_window <= self.max_position_embeddings:
            raise ValueError(f"ModelConfig.bitwise_window={self.bitwise_window} must be in [1, max_position_embeddings="
                             f"{self.max_position_embeddings}] or None")
        if self.bitwise and (self.lora is not None or self.moe is not None):
            raise ValueError("ModelConfig.consistency='bitwise' with " + ("lora" if self.lora is not None else "moe")
                             + ": bitwise mode covers dense models without adapters for now; use consistency='fast'")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.rope_theta > 0 or self.rms_norm_eps < 0 or self.initializer_range < 0:
            raise ValueError(f"ModelConfig: need rope_theta > 0, rms_norm_eps >= 0 and initializer_range >= 0, got "
                             f"{self.rope_theta}, {self.rms_norm_eps}, {self.initializer_range}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.unroll_layers < 1:
            raise ValueError(f"ModelConfig.unroll_layers={self.unroll_layers} must be >= 1 (1: scan one layer at a "
                             "time; num_layers: unroll them all)")
        if self.attention_query_blocks < 1:
            raise ValueError(f"ModelConfig.attention_query_blocks={self.attention_query_blocks} must be >= 1 "
                             "(1: one attention product over all keys)")
        if (self.model_type == "qwen3_moe") != (self.moe is not None):
            raise ValueError(f"ModelConfig.model_type={self.model_type!r} with moe={'set' if self.moe else 'None'}: a "
                             "mixture-of-experts model is model_type='qwen3_moe' with a MoeConfig, and only it")
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"MoeConfig.dense_layers={self.moe.dense_layers} names a layer beyond the model's "
                             f"num_layers={self.num_layers}")
        if self.moe is not None and "moe" not in self.layer_kinds:
            raise ValueError(f"MoeConfig (sparse_step={self.moe.sparse_step}, dense_layers={self.moe.dense_layers}) "
                             f"leaves none of the {self.num_layers} layers sparse; make some layer sparse or use a "
                             "dense model")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; use one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}; use one of {ATTENTION_IMPLS}")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not a dtype name") from None

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def bitwise(self) -> bool:
        """Whether the model computes batch-invariantly (`consistency="bitwise"`)."""
        return self.consistency == "bitwise"

    @property
    def attention_window(self) -> int | None:
        """The keys a query attends over in bitwise mode (`invariant.window_attention`):
        `bitwise_window`, else `max_position_embeddings`; None in fast mode."""
        if not self.bitwise:
            return None
        return self.bitwise_window or self.max_position_embeddings

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def projection_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each layer projection's weight shape (without `layers`): `q_proj` `(D, N, H)`, ..."""
        d, f, n, k, h = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        return {"q_proj": (d, n, h), "k_proj": (d, k, h), "v_proj": (d, k, h), "o_proj": (n, h, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}

    def adapter_params(self) -> int:
        """Parameters of the LoRA adapters (0 without `lora`): R x (fan-in + fan-out) per target and layer."""
        if self.lora is None:
            return 0
        shapes = self.projection_shapes()
        return self.num_layers * sum(self.lora.rank * sum(fans(name, shapes[name])) for name in self.lora.targets)

    def check_lora(self) -> None:
        """A one-line ValueError if `lora`'s rank does not fit this model's projections, or it
        targets a mixture-of-experts model's MLP (checked where the architecture is known: a
        placeholder config of an `init_from` run is not)."""
        if self.lora is None:
            return
        self.lora.check_shapes(self.projection_shapes())
        mlp = [t for t in self.lora.targets if t in ("gate_proj", "up_proj", "down_proj")]
        if self.moe is not None and mlp:
            raise ValueError(f"LoraConfig.targets={self.lora.targets!r}: a mixture-of-experts model's adapters go on "
                             f"its attention projections only; drop {mlp}")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP: "dense" or "moe" (`tpurl.models.moe.layer_kinds`)."""
        return layer_kinds(self.num_layers, self.moe)

    def layers_of(self, kind: str) -> list[int]:
        """The layers whose MLP is of `kind` ("dense" | "moe"): the rows of that kind's stacked
        parameters, in order."""
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    def num_params(self) -> int:
        """Parameter count of the base model (embedding counted once when tied; adapters not
        counted: `adapter_params`)."""
        d, f, n, k, h = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * n * h + 2 * d * k * h + n * h * d
        if self.attention_bias:
            attn += n * h + 2 * k * h
        if self.qk_norm:
            attn += 2 * h
        kinds = self.layer_kinds
        mlp = kinds.count("dense") * 3 * d * f
        if self.moe is not None:
            e = self.moe.num_experts
            mlp += kinds.count("moe") * (d * e + 3 * e * d * self.moe.intermediate_size)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * d) + mlp + emb + d

    def check_token_ids(self, ids, where: str, fix: str = "use ids the model's tokenizer produces") -> None:
        """Raise a one-line ValueError, naming `where`, if an id of `ids` is outside [0, vocab_size)
        (an out-of-range id would read garbage: NaN logprobs, or silently another row)."""
        arr = np.asarray(ids).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary "
                             f"[0, {self.vocab_size}); {fix}")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _qwen2(**kw) -> ModelConfig:
    return ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, **kw)


def _qwen3(**kw) -> ModelConfig:
    return ModelConfig(model_type="qwen3", qk_norm=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, vocab_size=151936, head_dim=128, **kw)


def _llama3(factor: float, **kw) -> ModelConfig:
    return ModelConfig(model_type="llama", rope_theta=500_000.0, rms_norm_eps=1e-5, vocab_size=128256,
                       rope_scaling=RopeScaling(factor=factor), max_position_embeddings=131072, **kw)


PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                           num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                           num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                         num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         num_kv_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                         num_kv_heads=8, tie_word_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                       num_kv_heads=8, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       num_kv_heads=8, tie_word_embeddings=False),
    "llama-3.2-1b": _llama3(32.0, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                            num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": _llama3(32.0, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                            num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": _llama3(8.0, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 sparse layers of 128 experts, 8 per token (about 3B parameters active).
    "qwen3-30b-a3b": _qwen3(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                            tie_word_embeddings=False).replace(
        model_type="qwen3_moe", moe=MoeConfig(num_experts=128, experts_per_token=8, intermediate_size=768)),
    "tiny-moe": ModelConfig(model_type="qwen3_moe", qk_norm=True, vocab_size=128, hidden_size=64,
                            intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            max_position_embeddings=512,
                            moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=32)),
    # Tiny sizes for tests, benchmarks and the demo.
    "tiny": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512),
    "tiny-qwen3": ModelConfig(model_type="qwen3", qk_norm=True, vocab_size=128, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              tie_word_embeddings=True, max_position_embeddings=512),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced (e.g. `preset("tiny", vocab_size=40)`)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[key], **overrides)
