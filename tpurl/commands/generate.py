"""`tpurl generate`: sample completions from a Hugging Face checkpoint directory or a model preset.

    tpurl generate --model DIR_OR_PRESET [--adapter PEFT_DIR] --prompt TEXT [--prompt-ids 1,2,3]
                   --max-new-tokens N --temperature T --top-p P --top-k K --n N --seed S [--stop STR] [--json]
                   [--compile-cache auto|DIR|none]

A directory must hold `config.json` + safetensors (and `tokenizer.json` for text prompts). A preset
name (`tiny`, `qwen2.5-0.5b`, ...) gets randomly initialized weights (`--init-seed`); text prompts
then use a character tokenizer (printable ASCII, then placeholder characters) when the vocabulary
is small (98...4096 ids), otherwise pass `--prompt-ids`. Prints each completion with its token ids and per-token logprobs
(`log_softmax(logits / T)` of the sampled token), or one JSON document with `--json` (strict JSON:
a non-finite number is written as null). `--adapter` attaches a Hugging Face PEFT LoRA adapter
(`adapter_config.json` + `adapter_model.safetensors`) to the model, computed beside the base weights
(unmerged; `tpurl.models.peft`). Compiled programs are kept between runs (`--compile-cache`, as
`tpurl train` keeps them), so a second call of the same shapes loads them. Token ids outside the
model's vocabulary, a bad model folder and the like exit with status 2 and a one-line message.
"""

from __future__ import annotations

import json

from flax import nnx

from tpurl.commands.common import EXPECTED_ERRORS, ArgumentParser, add_compile_cache_flag, enable_compile_cache, fail
from tpurl.generate.driver import check_requests, generate
from tpurl.generate.engine import Engine, EngineConfig
from tpurl.generate.sampling import SamplingConfig
from tpurl.models.load import load_config, load_weights
from tpurl.models.peft import with_peft_adapter, with_peft_config


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="tpurl generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or model preset name")
    p.add_argument("--adapter", default=None,
                   help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) on the model")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="prompt token ids, comma separated (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's KV pages)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; needs a tokenizer)")
    p.add_argument("--no-eos-stop", action="store_true", help="do not stop at the tokenizer's EOS token")
    p.add_argument("--cache", choices=("paged", "dense"), default="paged")
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default=None, help="compute/KV dtype, e.g. bfloat16 (default: the config's)")
    p.add_argument("--init-seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    add_compile_cache_flag(p)
    return p


def parse_prompt_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3` as ids (checked against the vocabulary by the caller)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None


def _prompts(args, cfg, tok) -> list[tuple[str, list[int]]]:
    """(the flag that gave it, token ids) of every prompt, checked against the model's vocabulary."""
    if args.prompt and tok is None:
        raise ValueError(f"--prompt needs a tokenizer and {args.model!r} has none; use --prompt-ids")
    prompts = [(f"--prompt {_quoted(text)}", tok.encode(text, add_bos=tok.bos_id is not None)) for text in args.prompt]
    prompts += [(f"--prompt-ids {_quoted(ids)}", parse_prompt_ids(ids)) for ids in args.prompt_ids]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    for where, ids in prompts:
        cfg.check_token_ids(ids, where, fix="use ids of the model's tokenizer")
    return prompts


def _quoted(text: str, limit: int = 40) -> str:
    """`text` quoted for an error line, a long one cut (with its length) so that the line stays short."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _sampling(args, tok) -> SamplingConfig:
    if args.stop and tok is None:
        raise ValueError(f"--stop needs a tokenizer and {args.model!r} has none (tokenizer.json)")
    stop_ids = () if args.no_eos_stop or tok is None or tok.eos_id is None else (tok.eos_id,)
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids, stop_strings=tuple(args.stop))


def _engine(args, cfg, prompts: list[tuple[str, list[int]]], sampling: SamplingConfig) -> Engine:
    """The engine for these prompts (one prefill bucket, the longest's), each checked to fit it."""
    bucket = 1 << max(max(len(ids) for _, ids in prompts) - 1, 1).bit_length()
    engine = Engine(cfg, EngineConfig(cache=args.cache, max_slots=args.max_slots, page_size=args.page_size,
                                      max_seq_len=bucket + args.max_new_tokens, prefill_buckets=(bucket,)))
    check_requests(engine, [ids for _, ids in prompts], sampling, names=[where for where, _ in prompts])
    return engine


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.n < 1:
            raise ValueError(f"--n {args.n}: samples per prompt must be >= 1")
        base, tok = load_config(args.model, dtype=args.dtype)  # every flag is checked before the weights load
        cfg = base if args.adapter is None else with_peft_config(base, args.adapter)
        prompts = _prompts(args, cfg, tok)
        sampling = _sampling(args, tok)
        enable_compile_cache(args.compile_cache)  # before anything compiles
        engine = _engine(args, cfg, prompts, sampling)
        model = load_weights(args.model, base, init_seed=args.init_seed)
        if args.adapter is not None:
            model = with_peft_adapter(model, args.adapter)
        out = generate(engine, nnx.state(model), [ids for _, ids in prompts], n_samples=args.n, sampling=sampling,
                       seed=args.seed, tokenizer=tok if args.stop else None)
    except EXPECTED_ERRORS as e:
        return fail("tpurl generate", e)
    records = []
    for row in out:
        for c in row:
            records.append({
                "prompt_index": c.prompt_index, "sample_index": c.sample_index,
                "prompt_ids": c.prompt_ids.tolist(), "token_ids": c.token_ids.tolist(),
                "logprobs": [round(float(x), 6) for x in c.logprobs], "finish_reason": c.finish_reason,
                **({"text": tok.decode(c.token_ids)} if tok is not None else {}),
            })
    if args.json:
        from tpurl.files import to_jsonable  # non-finite numbers -> null: valid JSON

        print(json.dumps(to_jsonable({"model": args.model, "completions": records}), allow_nan=False))
    else:
        for r in records:
            print(f"[prompt {r['prompt_index']} sample {r['sample_index']}] finish={r['finish_reason']}")
            if "text" in r:
                print(f"  text:     {r['text']!r}")
            print(f"  ids:      {r['token_ids']}")
            print(f"  logprobs: {r['logprobs']}")
    return 0
