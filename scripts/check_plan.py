"""The planner's predicted phase seconds for the `cpu` preset next to measured runs on this machine.

    python scripts/check_plan.py [--steps 6] [--out /tmp/check_plan]

Two short RL runs of `configs/demo.gin` (RL phase only: no SFT warm start, a small evaluation, no
checkpoints): the demo's ~0.5M-parameter model, and a ~4M-parameter one (hidden 256, 4 layers).
Each runs in its own `tpurl train` process (one device, as `make demo`); its measured seconds per
phase are the medians over its steps that compiled nothing (from its `metrics.jsonl`). The `cpu`
preset is calibrated first (matmul rate, memory bandwidth, launch cost, ...; written to
OUT/<timestamp>/cpu_calibration.json, next to the runs). Prints the two side by side per phase
(rollout, logprobs, update, sync, and the whole step) with their ratio; the target is within 2x.
Last line: `{"runs": {NAME: {PHASE: {"predicted_s": .., "measured_s": ..}}}}`.
Run it on a quiet machine: another process on the same cores stretches the measured seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN = os.path.join(ROOT, "configs", "demo.gin")
PHASES = ("rollout", "logprobs", "update", "sync", "step")
SHORT = ["tpurl.SFTConfig.steps=0", "tpurl.EvalConfig.every_steps=0", "tpurl.EvalConfig.num_problems=8",
         "tpurl.CheckpointConfig.every_steps=0", "tpurl.CheckpointConfig.export_hf=False",
         "tpurl.LoggingConfig.trackers=()"]
RUNS = {
    "demo": [],
    "4m": ["tpurl.model_preset.hidden_size=256", "tpurl.model_preset.intermediate_size=1024",
           "tpurl.model_preset.num_layers=4", "tpurl.model_preset.num_heads=8", "tpurl.model_preset.num_kv_heads=8",
           "tpurl.model_preset.head_dim=32", "tpurl.RLConfig.batch_size=64"],
}


def bindings(name: str, steps: int, out: str) -> list[str]:
    return SHORT + RUNS[name] + [f"tpurl.RLConfig.steps={steps}", f"tpurl.LoggingConfig.run_dir={os.path.join(out, name)!r}"]


def measure(name: str, params: list[str]) -> dict[str, float]:
    """Run `tpurl train` and return its seconds per phase: the median over the steps that compiled
    nothing (a millisecond phase's mean moves by half when one step in five meets a hiccup)."""
    argv = [sys.executable, "-m", "tpurl", "train", "--quiet", "--gin_file", GIN]
    for p in params:
        argv += ["--gin_param", p]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    run_dir = next(p.split("=", 1)[1].strip("'") for p in params if p.startswith("tpurl.LoggingConfig.run_dir"))
    from tpurl.logging import read_jsonl
    from tpurl.rl.timeline import steady_steps

    steps = steady_steps([r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "time/step_s" in r])
    return {phase: statistics.median(r[f"time/{phase}_s"] for r in steps) for phase in PHASES
            if f"time/{phase}_s" in steps[0]}


def predict(params: list[str], calibration: str) -> dict[str, float]:
    from tpurl.plan.calibrate import cpu_hardware
    from tpurl.plan.job import make_job
    from tpurl.plan.plan import make_plan
    from tpurl.commands.train import build_config

    hw = cpu_hardware(calibration)
    plan = make_plan(make_job(build_config([GIN], params), hw.devices), hw)
    seconds = dict(plan.times.seconds)
    return {**{p: seconds[p] for p in PHASES[:-1]}, "step": sum(seconds.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is left out)")
    ap.add_argument("--out", default="/tmp/check_plan",
                    help="where each invocation makes a timestamped folder for its runs and CPU calibration")
    args = ap.parse_args()
    # This invocation's own folder: `tpurl train` never writes into an earlier run's directory (it
    # picks a new one), so reading an earlier invocation's summary would report stale numbers.
    args.out = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(args.out)
    calibration = os.path.join(args.out, "cpu_calibration.json")
    from tpurl.plan.calibrate import cpu_hardware

    chip = cpu_hardware(calibration, devices=1).chip
    print(f"cpu: {chip.peak_flops / 1e9:.1f} GFLOP/s matmul, {chip.hbm_bandwidth / 1e9:.1f} GB/s memory, "
          f"{chip.step_overhead_s * 1e6:.0f} us per launch", flush=True)
    results = {}
    for name in RUNS:
        params = bindings(name, args.steps, args.out)
        predicted = predict(params, calibration)
        measured = measure(name, params)
        results[name] = {p: {"predicted_s": predicted[p], "measured_s": measured.get(p)} for p in PHASES}
        print(f"\n{name}: {'phase':<10}{'predicted s':>14}{'measured s':>14}{'ratio':>8}")
        for p, r in results[name].items():
            ratio = r["predicted_s"] / r["measured_s"] if r["measured_s"] else float("nan")
            print(f"      {p:<10}{r['predicted_s']:>14.4g}{r['measured_s'] or float('nan'):>14.4g}{ratio:>8.2f}",
                  flush=True)
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    os.environ.pop("XLA_FLAGS", None)  # one device, as the runs (before the host memory mode is chosen)
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("check_plan")
    main()
