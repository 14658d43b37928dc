"""`tpurl score`: load a Hugging Face checkpoint (or a randomly initialized preset) and print the
log-probability of every token of a prompt given the tokens before it, and their total.

    tpurl score --model path/to/Qwen2.5-0.5B-Instruct --prompt "The capital of France is Paris."
    tpurl score --model tiny --prompt "hello" --json
    tpurl score --model path/to/base --adapter path/to/peft_adapter --prompt "..."

A checkpoint directory needs `config.json`, safetensors weights and `tokenizer.json`. A preset
name uses random weights (`--seed`) and a character tokenizer over printable ASCII, which is
enough to exercise the whole path without downloading anything. `--adapter` attaches a Hugging
Face PEFT LoRA adapter directory to the model (unmerged; `tpurl.models.peft`).
"""

from __future__ import annotations

import functools
import json
import os
import string

import jax
import numpy as np
from flax import nnx

from tpurl.commands.common import EXPECTED_ERRORS, ArgumentParser, fail
from tpurl.models.config import PRESETS, preset
from tpurl.models.hf import load_hf_checkpoint
from tpurl.models.peft import with_peft_adapter
from tpurl.models.transformer import Transformer, init_model
from tpurl.tokenizer import CharTokenizer, Tokenizer, load_hf_tokenizer


def load_for_scoring(name: str, seed: int = 0) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer behind `--model`: a checkpoint directory or a preset name."""
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "tokenizer.json")):
            raise ValueError(f"{name} has no tokenizer.json; save the tokenizer next to the weights "
                             "(tokenizer.save_pretrained(dir))")
        return load_hf_checkpoint(name), load_hf_tokenizer(name)
    if name.lower() not in PRESETS:
        raise ValueError(f"--model {name!r} is neither a checkpoint directory nor a preset; "
                         f"presets: {', '.join(sorted(PRESETS))}")
    cfg = preset(name)
    tokenizer = CharTokenizer(string.printable)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"preset {name!r} has vocab_size={cfg.vocab_size} < {tokenizer.vocab_size} needed by the "
                         "printable-ASCII character tokenizer; use a checkpoint directory")
    return init_model(cfg, seed), tokenizer


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, tokens_BT, valid_BT):
    # The trainer's scorer (chunked, no [B, T, V] logits): logprobs[b, t] = log p(tokens[b, t] |
    # tokens[b, :t]), 0 at t = 0, so scoring here and in training cannot drift apart.
    from tpurl.train.logprobs import token_logprobs  # lazy: the training package is heavier

    return token_logprobs((graphdef, state), tokens_BT, valid_BT)[0]


def score_tokens(model: Transformer, ids: list[int]) -> np.ndarray:
    """Log-probability of `ids[t]` given `ids[:t]` for t >= 1 (float32, length `len(ids) - 1`).

    The sequence is right-padded to a power-of-two bucket (at least 16) so that prompts of
    similar length share one compiled program; causal attention keeps padding out of the result.
    """
    if len(ids) < 2:
        raise ValueError("the prompt must have at least two tokens to score (one to condition on)")
    if len(ids) > model.config.max_position_embeddings:
        raise ValueError(f"the prompt has {len(ids)} tokens, more than the model's max_position_embeddings="
                         f"{model.config.max_position_embeddings}; shorten it")
    model.config.check_token_ids(ids, "the prompt", fix="the tokenizer does not belong to this model")
    length = max(16, 1 << (len(ids) - 1).bit_length())
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    valid = np.arange(length)[None, :] < len(ids)
    graphdef, state = nnx.split(model)
    return np.asarray(_token_logprobs(graphdef, state, tokens, valid)[0, 1:len(ids)])


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tpurl score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or preset name")
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) on the model")
    parser.add_argument("--prompt", required=True, help="text to score")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--seed", type=int, default=0, help="initialization seed for presets")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_for_scoring(args.model, args.seed)
        if args.adapter is not None:
            model = with_peft_adapter(model, args.adapter)
        if args.chat:
            if not hasattr(tokenizer, "apply_chat_template"):
                raise ValueError(f"--chat needs a tokenizer with a chat template; {args.model} has none")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
        else:
            ids = tokenizer.encode(args.prompt, add_bos=True)
        logprobs = score_tokens(model, ids)
    except EXPECTED_ERRORS as e:
        return fail("tpurl score", e)
    rows = [{"id": int(i), "text": tokenizer.decode([i], skip_special=False),
             "logprob": None if t == 0 else float(logprobs[t - 1])} for t, i in enumerate(ids)]
    total = float(np.sum(logprobs, dtype=np.float64))
    result = {"model": args.model, **({"adapter": args.adapter} if args.adapter is not None else {}), "tokens": rows,
              "total_logprob": total, "num_scored": len(logprobs), "mean_logprob": total / len(logprobs)}
    if args.json:
        from tpurl.files import to_jsonable  # non-finite numbers -> null: valid JSON

        print(json.dumps(to_jsonable(result), allow_nan=False))
        return 0
    print(f"{'pos':>4}  {'id':>7}  {'logprob':>10}  token")
    for t, row in enumerate(rows):
        lp = "-" if row["logprob"] is None else f"{row['logprob']:.4f}"
        print(f"{t:>4}  {row['id']:>7}  {lp:>10}  {row['text']!r}")
    print(f"total logprob {total:.4f} over {len(logprobs)} tokens (mean {result['mean_logprob']:.4f})")
    return 0
