"""A model and its tokenizer by name: a Hugging Face checkpoint directory or a preset.

What `tpurl generate` and `tpurl serve` load from `--model`. A directory must hold `config.json`
and safetensors (and `tokenizer.json` for text). A preset gets randomly initialized weights and,
when its vocabulary is small (98...4096 ids), a character tokenizer: printable ASCII, then
placeholder characters, so that every id a random model samples can be shown.
"""

from __future__ import annotations

import os
import string

from tpurl.models.config import PRESETS, preset
from tpurl.models.transformer import Transformer, init_model
from tpurl.tokenizer import CharTokenizer


def load_model(name: str, *, dtype: str | None, init_seed: int) -> tuple[Transformer, object]:
    """(model, tokenizer or None) for a checkpoint directory or a preset name."""
    if os.path.isdir(name):
        from tpurl.models.hf import load_hf_checkpoint, load_hf_config
        from tpurl.tokenizer import load_hf_tokenizer
        cfg = load_hf_config(name)
        if dtype:
            cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
        model = load_hf_checkpoint(name, config=cfg)
        tok = load_hf_tokenizer(name) if os.path.exists(os.path.join(name, "tokenizer.json")) else None
        return model, tok
    if name.lower() not in PRESETS:
        raise ValueError(f"--model {name!r} is neither a checkpoint directory nor a preset; "
                         f"presets: {', '.join(sorted(PRESETS))}")
    cfg = preset(name)
    if dtype:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    model = init_model(cfg, seed=init_seed)
    return model, preset_tokenizer(cfg.vocab_size)


def preset_tokenizer(vocab_size: int) -> CharTokenizer | None:
    """A character tokenizer covering a small preset vocabulary (see the module docstring)."""
    printable = string.printable[:95]  # digits, letters, punctuation, space
    n = vocab_size - len(CharTokenizer.SPECIALS)
    if n < len(printable) or vocab_size > 4096:
        return None
    return CharTokenizer(printable + "".join(chr(0x100 + i) for i in range(n - len(printable))))
