"""Agents through the endpoint against the in-process environment path: model tokens/s of the same
multi-turn workload both ways, in one run; prints JSON.

The workload is `bench_tools.py`'s: episode (i, j) makes 1..`--turns` tool calls, a turn ends at any
of `--stop-ids` of the tiny preset's 128 ids (turns of ~16 tokens), and each call is answered at
once with 1-6 observation tokens. In process, `generate(..., on_turn_end=...)` runs it on the
engine (a sequence waits for its tool out of its slot and is extended in its own KV pages). Through
the endpoint, `--prompts` agent sessions written against the real `openai` client (`AsyncOpenAI`,
real HTTP to uvicorn on 127.0.0.1, `tpurl.serve.agents.run_agents`) send the same work as
completions calls, token ids in and out: each call carries the episode so far, and resumes the
KV pages of the episode's previous call (`tpurl.generate.session_cache`), and asks for
`ignore_eos`, so that its turns end at the same ids as in process (the endpoint would also stop
at the tokenizer's end-of-sequence id, 1 more of 128: turns ~12% shorter); the agents run twice:
on a thread of the engine's process (`endpoint`) and in `--agent-processes` worker processes
(`endpoint_processes`, `AgentLimits.processes`). `tokens/s` counts the tokens the model sampled
over the wall time of the whole rollout, after warm-up runs of each until one compiles nothing new
(`programs_compiled` counts those the timed runs still compiled).

    python scripts/bench_agent.py [--slots 32] [--prompts 256] [--turns 3] [--reps 2]
                                  [--hidden-size 64 --layers 2] [--agent-processes 1]

The model is the tiny preset (`--hidden-size 64 --layers 2`, 90k parameters) or a wider and
deeper one of the same vocabulary: at the tiny size a decode step costs less than the Python of
one HTTP call (the `openai` client, uvicorn and FastAPI), so the ratio there measures the HTTP
stack; at `--hidden-size 256 --layers 4` (2.4M) and `--hidden-size 512 --layers 8` (19M) the
model's work weighs more.

The last line is one JSON object: `tokens_per_s_environment`, `tokens_per_s_endpoint`,
`tokens_per_s_endpoint_processes`, `ratio` and `ratio_processes` (endpoint / environment; target
>= 0.8).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time


def _observation(i: int, n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng([i, n]).integers(3, 90, 1 + (i + n) % 6).tolist()


def _calls(i: int, turns: int) -> int:
    return 1 + (i * 7) % turns


def _environment(engine, params, prompts, sampling, turns: int) -> tuple[float, int]:
    from tpurl.generate import generate

    calls: dict[int, int] = {}

    def on_turn_end(i, j, token_ids):
        n = calls.get(i, 0)
        if n >= _calls(i, turns):
            return None
        calls[i] = n + 1
        return _observation(i, n)

    start = time.perf_counter()
    out = generate(engine, params, prompts, n_samples=1, sampling=sampling, seed=0, on_turn_end=on_turn_end,
                   tool_workers=len(prompts))
    return time.perf_counter() - start, int(sum(c.model_mask.sum() for row in out for c in row))


async def _agent(client, problem, *, turns: int, budget: int, stop_ids: tuple[int, ...]):
    """Episode i's agent: the environment path's work as completions calls, token ids in and out."""
    i, ids = problem
    ids, used = list(ids), 0
    for n in range(_calls(i, turns) + 1):
        r = await client.completions.create(model="policy", prompt=ids, max_tokens=budget - used, seed=i,
                                            extra_body={"stop_token_ids": list(stop_ids), "ignore_eos": True})
        new = r.choices[0].model_extra["token_ids"]
        ids, used = ids + new, used + len(new)
        obs = _observation(i, n)
        if r.choices[0].finish_reason != "stop" or n == _calls(i, turns) or budget - used - len(obs) < 1:
            break
        ids, used = ids + obs, used + len(obs)
    return 0.0


def _endpoint(engine, params, prompts, sampling, turns: int, stop_ids, processes: int) -> tuple[float, int]:
    from tpurl.generate import KVPool, Weights, WeightSlot
    from tpurl.models.load import preset_tokenizer
    from tpurl.serve.agents import AgentLimits, run_agents

    agent = functools.partial(_agent, turns=turns, budget=sampling.max_new_tokens, stop_ids=tuple(stop_ids))
    with KVPool(engine) as pool:
        start = time.perf_counter()
        episodes = run_agents(agent, list(enumerate(prompts)), 1, engine=engine, weights=WeightSlot(Weights(params, 0)),
                              pool=pool, tokenizer=preset_tokenizer(engine.model_cfg.vocab_size),
                              context_length=engine.config.max_seq_len,
                              limits=AgentLimits(concurrency=len(prompts), timeout_s=600, processes=processes),
                              temperature=sampling.temperature, seed=0)
        wall = time.perf_counter() - start
    errors = [e.error for row in episodes for e in row if e.error]
    if errors:
        raise RuntimeError(f"{len(errors)} agents failed, e.g. {errors[0]}")
    tokens = sum(len(c.token_ids) for row in episodes for e in row for call in e.calls for c in call.completions)
    return wall, tokens


def _warm(fn, engine, most: int = 8) -> None:
    """Run `fn` until a run compiles no program the runs before it did not (at most `most` runs):
    a run's batch shapes depend on timing, so one run may not meet them all, and a program
    compiled inside a timed run would weigh seconds."""
    for _ in range(most):
        before = sum(engine.trace_counts.values())
        fn()
        if sum(engine.trace_counts.values()) == before:
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3, help="most tool calls per episode")
    ap.add_argument("--stop-ids", type=int, default=8, help="ids of the 128 that end a turn (8: ~16-token turns)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each, interleaved; the best is kept")
    ap.add_argument("--hidden-size", type=int, default=64, help="the model's width (the tiny preset's: 64)")
    ap.add_argument("--layers", type=int, default=2, help="the model's depth (the tiny preset's: 2)")
    ap.add_argument("--agent-processes", type=int, default=1,
                    help="worker processes of the agents in the run endpoint_processes (AgentLimits.processes)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from tpurl.generate import Engine, EngineConfig, SamplingConfig
    from tpurl.models import init_model, preset

    cfg = preset("tiny", hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size, num_layers=args.layers,
                 num_heads=args.hidden_size // 16, num_kv_heads=max(1, args.hidden_size // 32))
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    engine = Engine(cfg, EngineConfig(max_slots=args.slots, max_seq_len=128, page_size=16, prefill_buckets=(16, 128),
                                      num_pages=args.prompts * 8, max_stop_tokens=32), graphdef=graphdef)
    stops = tuple(range(128 - args.stop_ids, 128))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=96, stop_token_ids=stops)
    prompts = [np.random.default_rng(i).integers(3, 90, 4 + i % 12).tolist() for i in range(args.prompts)]
    runs = {"environment": lambda: _environment(engine, params, prompts, sampling, args.turns),
            "endpoint": lambda: _endpoint(engine, params, prompts, sampling, args.turns, stops, 0),
            "endpoint_processes": lambda: _endpoint(engine, params, prompts, sampling, args.turns, stops,
                                                    args.agent_processes)}
    results = {}
    for fn in runs.values():
        _warm(fn, engine)
    walls: dict[str, list[float]] = {name: [] for name in runs}
    compiles = dict.fromkeys(runs, 0)
    for _ in range(args.reps):  # interleaved, so that a slow spell of a shared machine hits all three
        for name, fn in runs.items():
            before = sum(engine.trace_counts.values())
            wall, tokens = fn()
            walls[name].append(wall)
            compiles[name] += sum(engine.trace_counts.values()) - before
            results[name] = {"wall_s": min(walls[name]), "walls_s": walls[name], "tokens": tokens,
                             "tokens_per_s": tokens / min(walls[name]), "programs_compiled": compiles[name]}
    for name, r in results.items():
        print(f"[{name}] {r['tokens']} model tokens in {r['wall_s']:.2f} s", file=sys.stderr)
    out = {"backend": jax.default_backend(), "slots": args.slots, "prompts": args.prompts, "turns": args.turns,
           "runs": results, "tokens_per_s_environment": results["environment"]["tokens_per_s"],
           "tokens_per_s_endpoint": results["endpoint"]["tokens_per_s"],
           "tokens_per_s_endpoint_processes": results["endpoint_processes"]["tokens_per_s"]}
    out["ratio"] = out["tokens_per_s_endpoint"] / out["tokens_per_s_environment"]
    out["ratio_processes"] = out["tokens_per_s_endpoint_processes"] / out["tokens_per_s_environment"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_agent")
    raise SystemExit(main())
