"""Tool latency hidden behind decoding: multi-turn rollout tokens/s with instant vs slow tools; prints JSON.

The same episodes (same model, prompts, seeds and observations, so the same tokens) run twice on
the paged engine: once with tools that answer at once, once with tools that take `--tool-ms`
milliseconds each (a sleeping thread, as a sandboxed execution or a remote call would). A turn
ends at any of `--stop-ids` of the 128 ids (turns of ~16 tokens by default) and the tool answers
with 1-6 observation tokens, up to `--turns` tool calls per episode. While a sequence waits for
its tool it holds its KV pages but no decode slot, so the slot decodes another sequence
(`generate(..., on_turn_end=...)`): with a pool of `--pool` sequences for `--slots` slots, the
slow run should lose little throughput. `tokens/s` counts the tokens the model sampled over
the wall time of the whole rollout (after a warm-up run that compiles every program).

    python scripts/bench_tools.py [--slots 32] [--pool 128] [--prompts 256] [--tool-ms 50] [--reps 2]

The last line is one JSON object: `tokens_per_s_instant`, `tokens_per_s_slow`, `ratio` (target
>= 0.8).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _episodes(turns: int, delay_s: float):
    """The tool of every episode: episode (i, j) makes 1..`turns` calls (fixed by i, j); each call
    answers with 1-6 observation tokens after `delay_s` seconds."""
    import numpy as np

    calls: dict[tuple[int, int], int] = {}

    def on_turn_end(i, j, token_ids):
        n = calls.get((i, j), 0)
        if n >= 1 + (i * 7 + j) % turns:
            return None
        calls[(i, j)] = n + 1
        if delay_s:
            time.sleep(delay_s)
        return np.random.default_rng([i, j, n]).integers(3, 90, 1 + (i + n) % 6).tolist()

    return on_turn_end


def _run(engine, params, prompts, sampling, turns: int, delay_s: float) -> tuple[float, int]:
    from tpurl.generate import generate

    start = time.perf_counter()
    out = generate(engine, params, prompts, n_samples=1, sampling=sampling, seed=0,
                   on_turn_end=_episodes(turns, delay_s), tool_workers=len(prompts))
    wall = time.perf_counter() - start
    return wall, int(sum(c.model_mask.sum() for row in out for c in row))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--turns", type=int, default=3, help="most tool calls per episode")
    ap.add_argument("--pool", type=int, default=128, help="sequences the KV pool holds (in flight at once)")
    ap.add_argument("--stop-ids", type=int, default=8, help="ids of the 128 that end a turn (8: ~16-token turns)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each; the best is kept")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from tpurl.generate import Engine, EngineConfig, SamplingConfig
    from tpurl.models import init_model, preset

    cfg = preset("tiny")
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    # A pool of `--pool` sequences' pages for `--slots` decode slots: a sequence waiting for its
    # tool holds pages but no slot, so more sequences than slots are in flight.
    max_pages = 128 // 16
    engine = Engine(cfg, EngineConfig(max_slots=args.slots, max_seq_len=128, page_size=16, prefill_buckets=(16,),
                                      num_pages=args.pool * max_pages, max_stop_tokens=32), graphdef=graphdef)
    stops = tuple(range(128 - args.stop_ids, 128))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=96, stop_token_ids=stops)
    prompts = [np.random.default_rng(i).integers(3, 90, 4 + i % 12).tolist() for i in range(args.prompts)]
    _run(engine, params, prompts, sampling, args.turns, 0.0)  # compiles every program
    results = {}
    for name, delay in (("instant", 0.0), ("slow", args.tool_ms / 1000.0)):
        best = None
        for _ in range(args.reps):
            wall, tokens = _run(engine, params, prompts, sampling, args.turns, delay)
            best = wall if best is None else min(best, wall)
        results[name] = {"wall_s": best, "tokens": tokens, "tokens_per_s": tokens / best}
        print(f"[{name}] {tokens} model tokens in {best:.2f} s", file=sys.stderr)
    out = {"backend": jax.default_backend(), "slots": args.slots, "prompts": args.prompts, "tool_ms": args.tool_ms,
           "extends": engine.stats["extends"], "runs": results,
           "tokens_per_s_instant": results["instant"]["tokens_per_s"],
           "tokens_per_s_slow": results["slow"]["tokens_per_s"]}
    out["ratio"] = out["tokens_per_s_slow"] / out["tokens_per_s_instant"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_tools")
    raise SystemExit(main())
