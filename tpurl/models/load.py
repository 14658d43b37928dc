"""A model and its tokenizer by name: a Hugging Face checkpoint directory or a preset.

What `tpurl generate` and `tpurl serve` load from `--model`: the config and tokenizer first
(`load_config`: the command checks its input against them), then the weights (`load_weights`). A
directory must hold `config.json` and safetensors (and `tokenizer.json` for text). A preset gets
randomly initialized weights and, when its vocabulary is small (98...4096 ids), a character
tokenizer: printable ASCII, then placeholder characters, so that every id a random model samples
can be shown.
"""

from __future__ import annotations

import os
import string

from tpurl.models.config import PRESETS, ModelConfig, preset
from tpurl.models.transformer import Transformer, init_model
from tpurl.tokenizer import CharTokenizer


def load_config(name: str, *, dtype: str | None) -> tuple[ModelConfig, object]:
    """(config, tokenizer or None) of a checkpoint directory or a preset, without its weights: what
    a command checks its input against before it spends the time to load them."""
    if os.path.isdir(name):
        from tpurl.models.hf import load_hf_config
        from tpurl.tokenizer import load_hf_tokenizer
        cfg = load_hf_config(name)
        tok = load_hf_tokenizer(name) if os.path.exists(os.path.join(name, "tokenizer.json")) else None
    elif name.lower() in PRESETS:
        cfg = preset(name)
        tok = preset_tokenizer(cfg.vocab_size)
    else:
        raise ValueError(f"--model {name!r} is neither a checkpoint directory nor a preset; "
                         f"presets: {', '.join(sorted(PRESETS))}")
    return (cfg.replace(dtype=dtype, param_dtype=dtype) if dtype else cfg), tok


def load_weights(name: str, cfg: ModelConfig, *, init_seed: int) -> Transformer:
    """The model of `load_config(name)`'s `cfg`: the checkpoint's weights, or a preset's random ones."""
    if os.path.isdir(name):
        from tpurl.models.hf import load_hf_checkpoint
        return load_hf_checkpoint(name, config=cfg)
    return init_model(cfg, seed=init_seed)


def preset_tokenizer(vocab_size: int) -> CharTokenizer | None:
    """A character tokenizer covering a small preset vocabulary (see the module docstring)."""
    printable = string.printable[:95]  # digits, letters, punctuation, space
    n = vocab_size - len(CharTokenizer.SPECIALS)
    if n < len(printable) or vocab_size > 4096:
        return None
    return CharTokenizer(printable + "".join(chr(0x100 + i) for i in range(n - len(printable))))
