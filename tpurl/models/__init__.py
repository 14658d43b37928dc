"""Decoder-only transformers (Llama 3, Qwen2/2.5, Qwen3) and their Hugging Face I/O."""

from tpurl.models.config import PRESETS, ModelConfig, RopeScaling, preset
from tpurl.models.transformer import (DenseAttention, Transformer, abstract_model, causal_padding_mask,
                                      dense_attention, forward_logits, identity_constrain, init_model,
                                      positions_from_mask, resolve_attention_impl)

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "preset", "DenseAttention", "Transformer",
           "abstract_model", "causal_padding_mask", "dense_attention", "forward_logits", "identity_constrain",
           "init_model", "positions_from_mask", "resolve_attention_impl"]
