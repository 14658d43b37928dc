"""Hugging Face-format tokenizers written by the tests themselves (no model hub here)."""

from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

# A ChatML template (Qwen's turn markers) without tools: enough to exercise chat prompts.
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_bpe_tokenizer(directory: str, corpus: list[str], vocab_size: int, *, chat_template: str | None = None,
                        eos: str = "</s>") -> None:
    """A byte-level BPE trained on `corpus` (any text encodes: bytes are the base alphabet) with
    `<pad>`, `<s>`, `</s>` and ChatML's markers as special tokens, saved as `tokenizer.json` +
    `tokenizer_config.json` in `directory`."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": eos, "pad_token": "<pad>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
