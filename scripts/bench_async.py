"""Steps per hour of one RL config run three ways on the same 8 (fake CPU) devices, in one process:
colocated (both workloads on all 8 devices, taking turns), synchronous disaggregated (4 train + 4
rollout devices, phases one after another) and asynchronous disaggregated (the same split,
`AsyncConfig.max_staleness`: the rollout pool samples batch k+1 while the train pool updates on
batch k; `tpurl.rl.async_step`).

Config: a small model (D=128, 2 layers, F=512: the update takes about twice the rollout's time on
CPU, where overlap can pay), 16 prompts x 8 samples of 2-digit addition, GRPO without a reference,
truncated IS (`correction_preset("tis")`, cap 2, which async requires; the others run it too). Checkpoints every `--steps` steps (`CheckpointConfig.every_steps`, not written here),
so each asynchronous round is one segment: its first batch is sampled before any update can
overlap it, and its last step syncs; that cost is in the numbers. Each mode compiles in a warm-up
round, then the modes take turns for `--rounds` timed rounds of `--steps` steps (interleaved, so a
noisy machine slows all three alike); steps/hour is from the median round's wall time. Per mode
the mean idle fraction of each pool during a step is reported (async: from its timeline metrics;
synchronous disaggregated: the train pool idles during rollout and reward, the rollout pool during
everything else; colocated: both are the same devices), with each mode's mean phase seconds
(`compile/seconds` > 0 means a timed step compiled a program).

`--task calculator --tool-ms 200`: the calculator environment instead (2-digit products, episodes
that may call a calculator tool between turns),
each tool call sleeping 200 ms first, as a remote tool or a sandboxed run would: a rollout that
waits for its tools, not only for the CPU, the agentic case asynchronous RL is for (`phases_s`
gives each mode's `rollout/turns/mean`). Its episodes meet new shapes for a while (observation
lengths, packed rows), so give it `--warmup 3`; a timed round that still compiles shows in
`compile/seconds` and in `round_seconds`, and the median round leaves it out.

    python scripts/bench_async.py [--steps 6] [--rounds 3] [--warmup 1] [--max_staleness 1] [--hidden 128]
                                  [--layers 2] [--overlap thread|dispatch] [--in_flight drain|continue]
                                  [--task addition|calculator] [--tool-ms 0]

The last line printed is one JSON object with `steps_per_hour: {"colocated", "disaggregated",
"async"}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = ("colocated", "disaggregated", "async")
AXES = ("data", "fsdp", "tensor")


def bench_task(task: str):
    """The task: 2-digit addition (one turn, graded at once), or the calculator environment whose
    episodes call a tool between turns (`--tool-ms`: each call waits that long first, as a remote
    tool or a sandboxed run would)."""
    from tpurl.tasks import AdditionConfig, CalculatorConfig, TaskConfig

    if task == "calculator":
        return TaskConfig(name="calculator", calculator=CalculatorConfig(digits=2, num_eval=16))
    return TaskConfig(addition=AdditionConfig(digits=2, reverse_answer=True, num_eval=16))


def slow_tools(tool_ms: float) -> None:
    """Every calculator tool call sleeps `tool_ms` first (on the environment's worker threads)."""
    from tpurl.tasks.calculator import CalculatorEpisode

    call = CalculatorEpisode.call

    def slow_call(self, text):
        time.sleep(tool_ms / 1e3)
        return call(self, text)
    CalculatorEpisode.call = slow_call


def bench_config(mode: str, *, steps: int, max_staleness: int, hidden: int, layers: int, slots: int | None,
                 overlap: str = "thread", task: str = "addition", in_flight: str = "drain"):
    from tpurl.checkpoint import CheckpointConfig
    from tpurl.generate import EngineConfig
    from tpurl.logging import LoggingConfig
    from tpurl.models import preset
    from tpurl.rl.async_rollout import AsyncConfig
    from tpurl.rl.config import EvalConfig, RLConfig
    from tpurl.sharding.layout import MeshConfig
    from tpurl.sharding.placement import PlacementConfig
    from tpurl.train.config import OptimizerConfig, algorithm_preset
    from tpurl.train.correction import correction_preset

    if mode == "colocated":
        placement = PlacementConfig(train_mesh=MeshConfig(axes=AXES, shape=(1, 4, 2)),
                                    rollout_mesh=MeshConfig(axes=AXES, shape=(2, 1, 4)))
    else:
        placement = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4,
                                    train_mesh=MeshConfig(axes=AXES, shape=(1, 2, 2)),
                                    rollout_mesh=MeshConfig(axes=AXES, shape=(2, 1, 2)))
    return RLConfig(
        seed=0, steps=1000, batch_size=128,
        model=preset("tiny", hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers, num_heads=8,
                     num_kv_heads=8, head_dim=hidden // 8),
        engine=EngineConfig(max_slots=slots),
        task=bench_task(task),
        algorithm=algorithm_preset("grpo", group_size=8, kl_coef=0.0, correction=correction_preset("tis")),
        optimizer=OptimizerConfig(lr=1e-4), placement=placement,
        async_rollout=AsyncConfig(max_staleness=max_staleness if mode == "async" else 0, overlap=overlap,
                                  in_flight=in_flight if mode == "async" else "drain"),
        eval=EvalConfig(pass_k=1), checkpoint=CheckpointConfig(every_steps=steps, export_hf=False),
        logging=LoggingConfig(run_dir=tempfile.mkdtemp(prefix="bench_async_"), trackers=(), progress_bar=False))


class Mode:
    """One way of running the config: its runtime, state and step function."""

    def __init__(self, name: str, cfg):
        import functools

        from tpurl.rl.async_step import AsyncSteps
        from tpurl.rl.loop import prepare
        from tpurl.rl.runtime import RLRuntime
        from tpurl.rl.step import LoopState, rl_step

        self.name, self.rt = name, RLRuntime(*prepare(cfg))
        train = self.rt.new_train_state(self.rt.init_params(cfg.seed))
        self.rt.rollout.load(train.params, version=0)
        self.state = LoopState(train=train, ref_params=None, step=0, cursor=0, policy_version=0)
        self.steps = AsyncSteps(self.rt) if name == "async" else functools.partial(rl_step, self.rt)
        self.idle: dict[str, list[float]] = {"train": [], "rollout": []}
        self.phases: list[dict[str, float]] = []

    def round(self, steps: int) -> float:
        """Run `steps` steps (one segment); returns their wall seconds."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, metrics, _, _ = self.steps(self.state)
            self._account(metrics)
        return time.perf_counter() - t0

    def _account(self, m: dict[str, float]) -> None:
        self.phases.append({k: v for k, v in m.items()
                            if k.startswith(("time/", "rollout_side/", "compile/")) or k == "rollout/turns/mean"})
        if self.name == "async":
            train, rollout = m["timeline/train_idle_frac"], m["timeline/rollout_idle_frac"]
        elif self.name == "disaggregated":
            rollout_busy = m["time/rollout_s"] + m["time/reward_s"] + m["time/sync_s"]
            train, rollout = rollout_busy / m["time/step_s"], 1.0 - rollout_busy / m["time/step_s"]
        else:
            train = rollout = 0.0  # one pool of devices, never idle between phases
        self.idle["train"].append(train)
        self.idle["rollout"].append(rollout)

    def close(self) -> None:
        if hasattr(self.steps, "close"):
            self.steps.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps per round (one asynchronous segment)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, interleaved")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds per mode first (they compile; multi-turn episodes keep meeting new shapes)")
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128, help="model width D (F = 4D)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--slots", type=int, default=None, help="EngineConfig.max_slots (default: the whole batch)")
    p.add_argument("--overlap", default="thread", choices=("thread", "dispatch"),
                   help="AsyncConfig.overlap of the async mode: a rollout thread, or the main thread")
    p.add_argument("--in_flight", default="drain", choices=("drain", "continue"),
                   help="AsyncConfig.in_flight of the async mode")
    p.add_argument("--task", default="addition", choices=("addition", "calculator"),
                   help="one-turn addition, or the calculator environment (tool calls between turns)")
    p.add_argument("--tool-ms", type=float, default=0.0, help="calculator: each tool call waits this long first")
    args = p.parse_args(argv)
    if min(args.steps, args.rounds) < 1 or args.warmup < 0 or args.tool_ms < 0:
        p.error("--steps and --rounds must be >= 1, --warmup and --tool-ms >= 0")
    if args.tool_ms and args.task != "calculator":
        p.error("--tool-ms needs --task calculator")
    return args


def timed_rounds(modes: dict[str, Mode], args) -> dict[str, list[float]]:
    """`args.warmup` untimed rounds per mode, then `args.rounds` timed ones, interleaved."""
    from tpurl.rl.loop import freeze_heap

    for name, mode in modes.items():  # warm-up: compiles the mode's programs
        for _ in range(args.warmup):
            mode.round(args.steps)
        mode.idle, mode.phases = {"train": [], "rollout": []}, []
        print(f"[bench_async] {name}: {args.warmup} warm-up rounds", file=sys.stderr, flush=True)
    freeze_heap()
    rounds: dict[str, list[float]] = {name: [] for name in MODES}
    for r in range(args.rounds):
        for name, mode in modes.items():
            rounds[name].append(mode.round(args.steps))
            print(f"[bench_async] round {r} {name}: {rounds[name][-1]:.2f} s for {args.steps} steps",
                  file=sys.stderr, flush=True)
    return rounds


def summary(args, modes: dict[str, Mode], rounds: dict[str, list[float]]) -> dict:
    """The JSON result (see the module docstring)."""
    import jax

    median = {name: statistics.median(v) for name, v in rounds.items()}
    return {
        "devices": len(jax.devices()), "backend": jax.default_backend(), "steps_per_round": args.steps,
        "rounds": args.rounds, "max_staleness": args.max_staleness,
        "round_seconds": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
        "config": {"hidden": args.hidden, "layers": args.layers, "slots": args.slots, "overlap": args.overlap,
                   "in_flight": args.in_flight, "task": args.task, "tool_ms": args.tool_ms},
        "phases_s": {name: {k: round(statistics.mean(p.get(k, 0.0) for p in mode.phases), 4)
                            for k in sorted({k for p in mode.phases for k in p})} for name, mode in modes.items()},
        "idle_frac": {name: {side: round(statistics.mean(v), 3) for side, v in mode.idle.items()}
                      for name, mode in modes.items()},
        "speedup_async_vs_disaggregated": round(median["disaggregated"] / median["async"], 3),
        "steps_per_hour": {name: round(3600.0 * args.steps / median[name], 1) for name in MODES},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tool_ms:
        slow_tools(args.tool_ms)
    modes = {name: Mode(name, bench_config(name, steps=args.steps, max_staleness=args.max_staleness,
                                           hidden=args.hidden, layers=args.layers, slots=args.slots,
                                           overlap=args.overlap, task=args.task, in_flight=args.in_flight))
             for name in MODES}
    try:
        rounds = timed_rounds(modes, args)
    finally:
        for mode in modes.values():
            mode.close()
    result = summary(args, modes, rounds)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_async")
    main()
