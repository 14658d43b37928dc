"""Where a paged decode step's time goes: XLA's ops of the step, timed by a `jax.profiler` trace.

Prints one JSON document. The model (`--model`) and setup are `bench_generate`'s (`--batch` slots, 32-token
prompts, `--warmup` steps generated before the timed ones so that the sequences have some context).
`--steps` steps run under the trace, each read to the host before the next (as the driver does
with `pipeline=False`):

* `step_ms`: the median wall time of a step (trace overhead included);
* `dispatch_ms`, `host_read_ms`: from untraced steps, the time `generate` takes to return (the
  program is asynchronous) and the time to read the tokens once the program has finished;
* `ops`: the XLA ops (fusions, loops, custom calls such as the matmuls' `ynn_fusion`s) with the
  most time per step, each with its calls per step. An op inside a loop is counted once per
  iteration, and a loop also counts the ops it runs (`while.*`), so the rows overlap; ops that run
  at the same time on different threads add up too. Match a name to its HLO with
  `XLA_FLAGS=--xla_dump_to=DIR` (the `*cpu_after_optimizations.txt` of `jit__decode_fn`).

e.g. `PYTHONPATH=. python scripts/profile_decode.py --batch 64` (or `--model vs_trl --batch 32`: the
bench_vs_trl model at a narrowed width).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from scripts.bench_generate import MODEL as BENCH_GENERATE_MODEL
from tpurl.generate import Engine, EngineConfig, SamplingConfig
from tpurl.models import init_model, preset

# `--model`: bench_generate's 19.8M model, or bench_vs_trl's 4M Qwen3-shaped one (`vs_trl`).
MODELS = {"bench_generate": BENCH_GENERATE_MODEL,
          "vs_trl": preset("tiny-qwen3", vocab_size=64, hidden_size=256, intermediate_size=1024, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=64)}


def _engine(model, batch: int, max_new: int):
    """A paged engine of `model` with `batch` running sequences, its params and decode state."""
    graphdef, params = nnx.split(init_model(model, seed=0))
    engine = Engine(model, EngineConfig(max_slots=batch, max_seq_len=32 + max_new, page_size=16,
                                        prefill_buckets=(32,)), graphdef=graphdef)
    rng = np.random.default_rng(0)
    state = engine.init_decode_state()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new)
    for slot in range(batch):
        prefix, _ = engine.prefill(params=params, padded_tokens=rng.integers(3, model.vocab_size, 32),
                                   true_length=32, sampling=sampling, seeds=(slot,))
        state = engine.insert(prefix, state, slot)
    return engine, params, state


def _host_costs(engine, params, state, steps: int):
    """Median dispatch and host-read times (ms) of untraced steps; returns them and the state."""
    dispatch, read = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, result = engine.generate(params, state)
        t1 = time.perf_counter()
        result.tokens.block_until_ready()
        t2 = time.perf_counter()
        np.asarray(result.tokens)
        dispatch.append(t1 - t0)
        read.append(time.perf_counter() - t2)
    return 1e3 * float(np.median(dispatch)), 1e3 * float(np.median(read)), state


def _traced_ops(engine, params, state, steps: int, top: int):
    """Median traced step (ms) and the `top` XLA ops by time per step."""
    walls = []
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                t0 = time.perf_counter()
                state, result = engine.generate(params, state)
                np.asarray(result.tokens)
                walls.append(time.perf_counter() - t0)
        (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        # Python frames are "$file:line name"; the runtime's own spans name C++ scopes ("::").
        if e.get("ph") == "X" and not e["name"].startswith("$") and "::" not in e["name"]:
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    ops = [{"op": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": calls[name] / steps}
           for name, us in total.most_common(top)]
    return 1e3 * float(np.median(walls)), ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=32, help="steps generated before anything is timed")
    ap.add_argument("--steps", type=int, default=10, help="traced steps (and as many untraced ones)")
    ap.add_argument("--top", type=int, default=30, help="ops listed")
    ap.add_argument("--model", default="bench_generate", choices=sorted(MODELS))
    args = ap.parse_args()
    engine, params, state = _engine(MODELS[args.model], args.batch, args.warmup + 2 * args.steps + 2)
    for _ in range(args.warmup):
        state, result = engine.generate(params, state)
        np.asarray(result.tokens)
    dispatch, read, state = _host_costs(engine, params, state, args.steps)
    step, ops = _traced_ops(engine, params, state, args.steps, args.top)
    # The context (cached positions) when the traced steps start: the prompt, the warm-up steps and
    # the untraced steps that measure dispatch and host read.
    print(json.dumps({"model": args.model, "batch": args.batch, "context": 32 + args.warmup + args.steps, "step_ms": step,
                      "dispatch_ms": dispatch, "host_read_ms": read, "ops": ops}, indent=1))


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("profile_decode")
    main()
