"""The endpoint tests' checkpoints, written by the tests (no model hub here): a byte-level BPE
tokenizer with ChatML markers, a tool-call chat template and the tool-call markers as tokens, and
two models on it, saved in Hugging Face format for `tpurl serve --model DIR`:

* `random_checkpoint`: random float32 weights (logprobs worth comparing, text of any kind);
* `scripted_checkpoint`: a bigram model scripted by its weights. Its one layer adds nothing to the
  residual stream (zero output projections), the embeddings are one-hot, so the logits depend on
  the current token only, and the head maps each token to the one that follows it in `SCRIPT`:
  greedy decoding after the chat template's generation prompt writes a tool call and stops.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpurl.models.config import ModelConfig
from tpurl.models.hf import save_hf_checkpoint
from tpurl.models.transformer import init_model
from tpurl.tokenizer import load_hf_tokenizer

VOCAB = 320
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# No spaces: a byte-level decoder would mangle a space inside an added token.
CALL = '{"name":"add","arguments":{"a":2,"b":3}}'
ADDED = ["<tool_call>", "</tool_call>", CALL]
CORPUS = ["the quick brown fox jumps over the lazy dog", "what is two plus three", "hello world, how are you?",
          "The answer is 5.", "assistant user system tool"] * 20

TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + (t | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer(directory: str) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED) - 4, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(ADDED)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": TEMPLATE}, f)


def _config(hidden: int) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, max_position_embeddings=512, dtype="float32",
                       param_dtype="float32")


def random_checkpoint(directory: str) -> str:
    write_tokenizer(directory)
    save_hf_checkpoint(init_model(_config(64).replace(num_layers=2), seed=3), directory)
    return directory


def script(tokenizer) -> dict[int, int]:
    """token -> the token the scripted model writes after it: after the generation prompt's last
    token a tool call, then the end of the turn; every other token leads to a fixed other one."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is two plus three"}], tokenize=True)
    ids = [tokenizer.token_to_id(t) for t in ("<tool_call>", CALL, "</tool_call>", "<|im_end|>")]
    chain = {prompt[-1]: ids[0], ids[0]: ids[1], ids[1]: ids[2], ids[2]: ids[3]}
    plain = [t for t in range(len(SPECIALS), tokenizer.vocab_size) if t not in chain and t not in ids]
    for a, b in zip(plain, plain[1:] + plain[:1]):
        chain.setdefault(a, b)
    return chain


def scripted_checkpoint(directory: str) -> str:
    write_tokenizer(directory)
    tokenizer = load_hf_tokenizer(directory)
    model = init_model(_config(VOCAB), seed=0)
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for name, var in flat.items():
        value = np.asarray(var.get_value())
        if name[-1] in ("o_proj", "down_proj"):
            value = np.zeros_like(value)
        elif name[-1] == "embed_tokens":
            value = np.eye(VOCAB, VOCAB, dtype=np.float32)
        elif name[-1] == "lm_head":
            value = np.zeros_like(value)
            for a, b in script(tokenizer).items():
                value[a, b] = 10.0
        var.set_value(jnp.asarray(value))
    save_hf_checkpoint(nnx.merge(graphdef, state), directory)
    return directory
