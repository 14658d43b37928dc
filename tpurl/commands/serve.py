"""`tpurl serve`: an OpenAI-compatible endpoint on the rollout engine.

    tpurl serve --model DIR_OR_PRESET [--host 127.0.0.1] [--port 8000] [--max-slots 16]
                [--max-model-len N] [--served-model-name NAME] [--compile-cache auto|DIR|none]

Serves `POST /v1/chat/completions` and `/v1/completions` (streaming included), `GET /v1/models`
and `/health` (`tpurl.serve`). Concurrent requests join the engine's continuous batch; every
response carries the exact token ids. `--port 0` takes a free port; the address is printed as
`tpurl serve: listening on URL` once requests are taken. SIGINT/SIGTERM stop it cleanly. Compiled
programs are kept between runs (`--compile-cache`), so a restarted server loads the ones its
requests compiled before. Needs the optional extra `tpurl[serve]` (FastAPI, uvicorn).
"""

from __future__ import annotations

import os
import sys

from flax import nnx

from tpurl.commands.common import ArgumentParser, add_compile_cache_flag, enable_compile_cache
from tpurl.generate.engine import Engine, EngineConfig
from tpurl.generate.protocol import MAX_TOP_LOGPROBS
from tpurl.generate.service import Service
from tpurl.models.load import load_config, load_weights


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="tpurl serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or model preset name")
    p.add_argument("--served-model-name", default=None, help="the name requests use (default: the folder's "
                   "or preset's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port")
    p.add_argument("--max-slots", type=int, default=16, help="sequences decoded at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per sequence (default: the model's, at most 4096)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: every slot at full length)")
    p.add_argument("--dtype", default=None, help="compute/KV dtype, e.g. bfloat16 (default: the config's)")
    p.add_argument("--init-seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--top-logprobs", type=int, default=5,
                   help=f"the most alternatives per token a request may ask for (top_logprobs; 0-{MAX_TOP_LOGPROBS}); "
                        "decode steps compute them only while a request that asks for them runs")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_compile_cache_flag(p)
    return p


def prefill_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 16 below `max_len`, then `max_len`: one prefill program per bucket used."""
    buckets, b = [], 16
    while b < max_len:
        buckets.append(b)
        b *= 2
    return (*buckets, max_len)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        from tpurl.serve.app import Endpoint
        from tpurl.serve.server import bind, serve, url_of
    except ImportError as e:
        raise ValueError(f"tpurl serve needs the optional extra: pip install 'tpurl[serve]' ({e})") from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: must be in [0, 65535] (0: a free port)")
    if args.max_slots < 1:
        raise ValueError(f"--max-slots {args.max_slots}: must be >= 1")
    if not 0 <= args.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"--top-logprobs {args.top_logprobs}: must be in [0, {MAX_TOP_LOGPROBS}]")
    cfg, tokenizer = load_config(args.model, dtype=args.dtype)  # the flags are checked before the weights load
    if tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer (tokenizer.json); the endpoint takes text")
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
    if not 2 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len}: must be in [2, {cfg.max_position_embeddings}] "
                         "(the model's max_position_embeddings)")
    engine_cfg = EngineConfig(max_slots=args.max_slots, max_seq_len=max_len, page_size=args.page_size,
                              num_pages=args.num_pages, prefill_buckets=prefill_buckets(max_len),
                              top_logprobs=args.top_logprobs)
    enable_compile_cache(args.compile_cache)  # before anything compiles
    engine = Engine(cfg, engine_cfg)  # sized (and its flags checked) before the weights load
    params = nnx.state(load_weights(args.model, cfg, init_seed=args.init_seed))
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    sock = bind(args.host, args.port)
    with Service(engine, params, tokenizer=tokenizer) as service:
        endpoint = Endpoint(service, tokenizer, name=name, context_length=max_len)

        def ready():
            print(f"tpurl serve: listening on {url_of(sock)} (model {name!r})", flush=True)

        serve(endpoint, sock, on_ready=ready, log_level=args.log_level)
    if service.error is not None:
        print(f"tpurl serve: the engine failed: {service.error}", file=sys.stderr, flush=True)
        return 1
    print("tpurl serve: stopped", file=sys.stderr, flush=True)
    return 0
