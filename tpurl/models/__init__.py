"""Decoder-only transformers (Llama 3, Qwen2/2.5, Qwen3) and their Hugging Face I/O."""

from tpurl.models.config import PRESETS, ModelConfig, RopeScaling, preset
from tpurl.models.attention import DenseAttention, causal_padding_mask, dense_attention, resolve_attention_impl
from tpurl.models.transformer import (Transformer, abstract_model, forward_logits, identity_constrain, init_model,
                                      positions_from_mask)

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "preset", "DenseAttention", "Transformer",
           "abstract_model", "causal_padding_mask", "dense_attention", "forward_logits", "identity_constrain",
           "init_model", "positions_from_mask", "resolve_attention_impl"]
