"""One RL rollout on the engine, timed with the decode loop's options on and off; prints JSON.

The rollout of `scripts/bench_vs_trl.py`'s 128-token setting: its Qwen3-shaped random-init model
(vocab 64, D 256, 4 layers, fp32, one CPU device), 16 prompts x 8 samples, temperature 1, up to
`--new-tokens` new tokens, stopping at one token id (a random-init vocab-64 model draws it ~1/64 of
the time: completions of ~50 of 128 tokens on average, the longest 128). Variants, timed in
interleaved rounds in one process (a neighbour's load hits all alike) after `--warmup` untimed
rollouts of each (compilations excluded):

* `default`: decode steps narrowed to the slots in use (`EngineConfig.decode_buckets` widths,
  `tpurl.generate.compaction`) and pipelined (`generate(pipeline=True)`: step k+1 dispatched
  before step k is read, `tpurl.generate.driver`);
* `not_pipelined`: every step read before the next is dispatched;
* ``widths_<n>``: `decode_buckets=n` for each `--buckets` n (1: every step at full width).

Each variant reports the median rollout seconds, decode steps and slot-steps per rollout, and
`over_default` (its median over the default's). The same seeds sample the same tokens in every
variant up to the rounding of matmuls at another batch width: `same_tokens` says whether they did
(a report, not a check: a flipped near-tie is not an error).

    PYTHONPATH=. python scripts/bench_rollout.py [--rounds 5] [--buckets 1 4]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from flax import nnx

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.models import init_model, preset

MODEL = preset("tiny-qwen3", vocab_size=64, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
               num_kv_heads=2, head_dim=64)
PROMPTS, SAMPLES, PROMPT_LEN, STOP_ID = 16, 8, 8, 1


def _variants(buckets: list[int], new_tokens: int, graphdef) -> dict[str, tuple[Engine, bool]]:
    """Name -> (engine, pipelined)."""
    def engine(n: int | None = None) -> Engine:
        extra = {} if n is None else {"decode_buckets": n}
        return Engine(MODEL, EngineConfig(max_slots=PROMPTS * SAMPLES, max_seq_len=PROMPT_LEN + new_tokens,
                                          page_size=16, prefill_buckets=(PROMPT_LEN,), **extra), graphdef=graphdef)

    default = engine()
    out = {"default": (default, True), "not_pipelined": (default, False)}
    out.update({f"widths_{n}": (engine(n), True) for n in buckets})
    return out


def _rollout(engine: Engine, pipelined: bool, params, prompts, sampling, seed: int) -> tuple[float, list, dict]:
    """Seconds, the sampled token lists, and the engine's decode counters for one rollout."""
    before = dict(engine.stats)
    start = time.perf_counter()
    out = generate(engine, params, prompts, n_samples=SAMPLES, sampling=sampling, seed=seed, pipeline=pipelined)
    seconds = time.perf_counter() - start
    counts = {k: engine.stats[k] - before.get(k, 0) for k in ("decode_steps", "decode_slot_steps")}
    return seconds, [c.token_ids.tolist() for row in out for c in row], counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rollouts of each variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rollouts of each variant first")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--buckets", type=int, nargs="*", default=[1, 4], help="decode_buckets of the widths_<n> variants")
    args = ap.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"--rounds {args.rounds} / --warmup {args.warmup}: need at least one timed round and "
                 "no negative warm-up")
    graphdef, params = nnx.split(init_model(MODEL, seed=0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, MODEL.vocab_size, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=(STOP_ID,))
    variants = _variants(args.buckets, args.new_tokens, graphdef)
    for r in range(args.warmup):
        for engine, pipelined in variants.values():
            _rollout(engine, pipelined, params, prompts, sampling, seed=r)
    runs = {name: [] for name in variants}
    same = True
    for r in range(args.rounds):
        tokens = []
        for name, (engine, pipelined) in variants.items():
            seconds, toks, counts = _rollout(engine, pipelined, params, prompts, sampling, seed=1000 + r)
            runs[name].append((seconds, counts))
            tokens.append(toks)
        same = same and all(t == tokens[0] for t in tokens)
        lengths = [len(t) for t in tokens[0]]
    base = float(np.median([s for s, _ in runs["default"]]))
    doc = {"model": "bench_vs_trl's (vocab 64, D 256, 4 layers, fp32)", "rollout": f"{PROMPTS} x {SAMPLES}",
           "new_tokens": args.new_tokens, "mean_completion_tokens": float(np.mean(lengths)),
           "max_completion_tokens": int(max(lengths)), "same_tokens": same,
           "widths": list(variants["default"][0]._narrowing.widths)}
    for name, rs in runs.items():
        median = float(np.median([s for s, _ in rs]))
        doc[name] = {"seconds": median, "over_default": median / base,
                     **{k: int(np.mean([c[k] for _, c in rs])) for k in ("decode_steps", "decode_slot_steps")}}
    print(json.dumps(doc))


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_rollout")
    main()
