"""What checkpoints cost a run of the demo's size: the demo (`configs/demo.gin`) run in this process
for `--steps` RL steps with its checkpoint cadence (`CheckpointConfig.every_steps`, 50), every save
timed (orbax's write and the checksums of every file), and one restore timed (checksums verified,
then read). Prints one JSON object:

  steps, every_steps, saved         RL steps run, the cadence, checkpoints saved (the warm start's included)
  checkpoint_bytes                  the bytes of one checkpoint on disk
  save_s_total, save_s_mean         seconds spent saving (checksums included), total and per save
  checksum_s                        of one save, the seconds of hashing its files
  restore_s                         restoring the newest checkpoint (verify + read), best of 3
  run_wall_s, save_share            the whole run's seconds and the saves' share of them
  rl_step_s                         mean seconds of a steady RL step (the run's timeline)

Run: `python scripts/bench_checkpoint.py [--steps 100] [--every 50]` (on the devices `make demo` runs
on; writes under a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tpurl.checkpoint import Checkpointer, file_checksums
from tpurl.commands.train import build_config
from tpurl.rl.loop import prepare, run
from tpurl.rl.runtime import RLRuntime

DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.gin")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "demo")
        cfg = build_config([DEMO], [f"tpurl.RLConfig.steps={args.steps}", f"tpurl.LoggingConfig.run_dir='{run_dir}'",
                                    f"tpurl.CheckpointConfig.every_steps={args.every}",
                                    "tpurl.LoggingConfig.progress_bar=False", "tpurl.CheckpointConfig.export_hf=False"])
        result = run(cfg, verbose=False)
        ck_dir = os.path.join(run_dir, "checkpoints")
        ck = Checkpointer(ck_dir, max_to_keep=cfg.checkpoint.max_to_keep)
        step = ck.latest_step()
        step_dir = os.path.join(ck_dir, str(step))
        start = time.perf_counter()
        file_checksums(step_dir)
        checksum_s = time.perf_counter() - start
        spec, task = prepare(cfg)
        rt = RLRuntime(spec, task)
        train = rt.abstract_train_state()
        like = {"train": train, "ref": train.params} if rt.uses_reference else {"train": train}  # what the run saves
        restores = []
        for _ in range(3):
            start = time.perf_counter()
            ck.restore_latest(like)
            restores.append(time.perf_counter() - start)
        ck.close()
        saves = result.checkpoints
        print(json.dumps({
            "steps": args.steps, "every_steps": args.every, "saved": saves["saved"],
            "checkpoint_bytes": _dir_bytes(step_dir), "save_s_total": round(saves["seconds"], 4),
            "save_s_mean": round(saves["seconds"] / max(saves["saved"], 1), 4), "checksum_s": round(checksum_s, 4),
            "restore_s": round(min(restores), 4), "run_wall_s": round(result.wall_s, 2),
            "save_share": round(saves["seconds"] / result.wall_s, 5),
            "rl_step_s": round(result.timeline.get("step", {}).get("mean_s", float("nan")), 4)}, indent=2))


if __name__ == "__main__":
    main()
