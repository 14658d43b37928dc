"""`tpurl train`: run RL post-training from gin files (the main job).

    tpurl train --gin_file configs/demo.gin [--gin_file more.gin] [--gin_param 'tpurl.RLConfig.steps=5'] [--resume]

The gin files bind `tpurl.RLConfig` (and the configs nested in it); everything is validated
before any work starts, and a bad config exits with status 2 and a one-line message. A run never
overwrites another: when `LoggingConfig.run_dir` already holds one, a new run writes to a fresh
timestamped sibling (printed); `--resume` continues the run there from its newest checkpoint that
restores, and exits with status 2 when there is none (`--resume-or-start` starts a new run then),
when another process is running in that directory, or when the config differs from the one the
checkpoint was written with (`--resume-changed steps,optimizer.lr` names the changes intended).
Compiled programs are kept between runs (`tpurl.CompileCacheConfig`, JAX's persistent cache), so
a second run of a config compiles almost nothing.
"""

from __future__ import annotations

import os
import sys

import gin

from tpurl.commands.common import EXPECTED_ERRORS, TRACEBACK_ENV, ArgumentParser, fail, one_line
from tpurl.commands.gin_config import check_bindings_used, parse_gin
from tpurl.compile_cache import enable as enable_compile_cache
from tpurl.rl.config import RLConfig
from tpurl.sharding.distributed import initialize
from tpurl.sharding.host import is_writer


def build_config(gin_files, gin_params) -> RLConfig:
    """Parse gin, join the multi-process run if this is one (`tpurl.DistributedConfig`, before any
    JAX computation), and construct the operative `RLConfig`."""
    parse_gin(gin_files, gin_params)
    initialize(gin.get_configurable("tpurl.DistributedConfig")())
    cfg = gin.get_configurable("tpurl.RLConfig")()
    check_bindings_used()
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tpurl train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding 'A.b=c' (repeatable)")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue the run in LoggingConfig.run_dir from its newest checkpoint that restores; "
                             "status 2 when it has none")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="as --resume, but start a new run when there is no checkpoint")
    parser.add_argument("--resume-changed", metavar="FIELDS", default="",
                        help="with --resume (implied) or --resume-or-start: the RLConfig fields, comma-separated "
                             "dotted paths (steps, optimizer.lr, ...), that may differ from the checkpoint's config")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    args = parser.parse_args(argv)
    changed = tuple(name.strip() for name in args.resume_changed.split(",") if name.strip())
    if not args.gin_file:
        parser.error("at least one --gin_file is required (e.g. configs/demo.gin)")
    try:
        return _train(args, changed)
    except KeyboardInterrupt as e:  # Ctrl-C: where the run stopped and how to continue it, not a traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        if is_writer():
            print(f"\ntpurl train: {str(e) or 'interrupted before the run started'}", file=sys.stderr, flush=True)
        return 130


def _train(args, changed: tuple[str, ...]) -> int:
    try:
        cfg = build_config(args.gin_file, args.gin_param)
        enable_compile_cache(cfg.compile_cache)  # before the first program is compiled
        from tpurl.rl.loop import prepare

        spec, task = prepare(cfg)
    except EXPECTED_ERRORS as e:
        return fail("tpurl train", e, "config error")
    for line in task.data_report() if is_writer() else ():  # shown even when --quiet: rows the run will not see
        print(f"[tpurl] {line}", file=sys.stderr, flush=True)
    from tpurl.rl.loop import report, run

    # Errors past this point (a checkpoint that does not fit, nothing to resume, ...) are printed
    # in one line by `tpurl.commands.common.run_command`.
    result = run(cfg, resume=args.resume or args.resume_or_start or bool(changed), or_start=args.resume_or_start,
                 allow_changed=changed, gin_config=gin.config_str(), verbose=not args.quiet, prepared=(spec, task))
    if is_writer():  # the other processes of a multi-process run write and print nothing
        print(report(result, cfg.eval.pass_k), flush=True)
        print(report_files(result.run_dir), flush=True)
    return 0


def report_files(run_dir: str) -> str:
    """Write the finished run's plots and report.md (`tpurl report`) and return one line saying
    where they are, or why they are not: a report that fails never fails the run."""
    try:
        from tpurl.report.write import write_report

        return f"report: {write_report([run_dir])}"
    except Exception as e:  # noqa: BLE001 - any failure here (a plotting library's too) is only reported
        return f"report: not written ({type(e).__name__}: {one_line(e)}); retry with: tpurl report {run_dir}"


if __name__ == "__main__":
    from tpurl.commands.main import main as tpurl_main

    sys.exit(tpurl_main(["train", *sys.argv[1:]]))  # `tpurl train`, host memory set up as it does
