"""`tpurl train`: run RL post-training from gin files (the main job).

    tpurl train --gin_file configs/demo.gin [--gin_file more.gin] [--gin_param 'tpurl.RLConfig.steps=5'] [--resume]

The gin files bind `tpurl.RLConfig` (and the configs nested in it); everything is validated
before any work starts, and a bad config exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys

import gin

from tpurl.configurables import parse_gin
from tpurl.rl.config import RLConfig


def build_config(gin_files, gin_params) -> RLConfig:
    """Parse gin and construct the operative `RLConfig`."""
    parse_gin(gin_files, gin_params)
    return gin.get_configurable("tpurl.RLConfig")()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpurl train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding 'A.b=c' (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    args = parser.parse_args(argv)
    if not args.gin_file:
        parser.error("at least one --gin_file is required (e.g. configs/demo.gin)")
    try:
        cfg = build_config(args.gin_file, args.gin_param)
        from tpurl.rl.loop import prepare

        prepare(cfg)
    except (ValueError, TypeError, OSError) as e:
        print(f"tpurl train: config error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    from tpurl.rl.loop import report, run

    result = run(cfg, resume=args.resume, gin_config=gin.config_str(), verbose=not args.quiet)
    print(report(result, cfg.eval.pass_k), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
