"""The embedded demo over several seeds: held-out greedy accuracy before and after RL, per seed.

Runs `python -m tpurl train --gin_file configs/demo.gin` once per seed, one subprocess at a time
(each its own JAX process, exactly the command a user runs, warm start included), into
`<run_root>/seed<N>/` (the command's output goes to `<run_root>/seed<N>.log`); the run root is new
for every invocation (by default `runs/demo_seeds-<time>`), and one that already holds a seed's run
is refused, so no earlier run is replaced.
Prints one JSON object: per seed the held-out greedy accuracy after the warm start and after RL
(percent), the gain in points, the wall seconds of the whole command and whether that fits the
demo's budget; then the minimum and median gain and the longest wall time.

    python scripts/demo_seeds.py [--seeds 0,1,2] [--gin_param 'tpurl.RLConfig.steps=100'] [--run_root DIR]

Exit status 1 if any run failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_seed(seed: int, args) -> dict:
    """One demo run; its accuracies come from the run's `summary.json`."""
    run_dir = os.path.join(os.path.abspath(args.run_root), f"seed{seed}")
    cmd = [sys.executable, "-m", "tpurl", "train", "--quiet", "--gin_file", args.gin_file,
           "--gin_param", f"tpurl.RLConfig.seed={seed}",
           "--gin_param", f"tpurl.LoggingConfig.run_dir={json.dumps(run_dir)}"]
    for param in args.gin_param:
        cmd += ["--gin_param", param]
    start = time.perf_counter()
    with open(run_dir + ".log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    out = {"wall_s": round(wall, 1), "within_budget": wall <= args.budget_s, "run_dir": run_dir}
    if rc != 0:
        return {**out, "error": f"exit status {rc}; see {run_dir}.log"}
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    warm = 100 * summary["warm_start_eval"]["eval/greedy_accuracy"]
    final = 100 * summary["final_eval"]["eval/greedy_accuracy"]
    return {"warm_start_accuracy": round(warm, 1), "final_accuracy": round(final, 1),
            "gain_points": round(final - warm, 1), **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated seeds (default 0-7)")
    parser.add_argument("--gin_file", default="configs/demo.gin")
    parser.add_argument("--gin_param", action="append", default=[], help="extra gin binding, passed to every run")
    parser.add_argument("--run_root", default=time.strftime("runs/demo_seeds-%Y%m%d-%H%M%S"),
                        help="one run directory per seed under it (default: a new one per invocation)")
    parser.add_argument("--budget_s", type=float, default=600.0, help="wall-time budget of one demo run")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    taken = [s for s in seeds if os.path.exists(os.path.join(args.run_root, f"seed{s}"))]
    if taken:
        parser.exit(2, f"demo_seeds.py: --run_root {args.run_root} already holds the run of seed {taken[0]}; "
                       f"pass a new --run_root\n")
    os.makedirs(args.run_root, exist_ok=True)

    results = {}
    for seed in seeds:
        results[str(seed)] = r = run_seed(seed, args)
        print(f"seed {seed}: {json.dumps(r)}", file=sys.stderr, flush=True)
    gains = [r["gain_points"] for r in results.values() if "gain_points" in r]
    report = {
        "command": f"python -m tpurl train --gin_file {args.gin_file} --gin_param tpurl.RLConfig.seed=N",
        "gin_params": args.gin_param,
        "seeds": results,
        "min_gain_points": min(gains) if gains else None,
        "median_gain_points": statistics.median(gains) if gains else None,
        "max_wall_s": max(r["wall_s"] for r in results.values()),
        "failed": [s for s, r in results.items() if "error" in r],
    }
    print(json.dumps(report, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
