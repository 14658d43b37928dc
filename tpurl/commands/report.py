"""`tpurl report`: plots and a Markdown summary of runs, from their own logs.

    tpurl report RUN_DIR [RUN_DIR ...] [--out DIR] [--last N]

Writes timeline.png (a Gantt of the phases of the last N steps), rewards.png (reward components,
held-out greedy accuracy and pass@k over steps), memory.png (device bytes per phase: KV pool,
optimizer state, total) and report.md into RUN_DIR/report, or DIR (needed for several runs, which
are then shown side by side).
"""

from __future__ import annotations

from tpurl.commands.common import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tpurl report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (LoggingConfig.run_dir)")
    parser.add_argument("--out", default=None, help="folder to write to (default: RUN_DIR/report; needed for "
                                                    "several runs)")
    parser.add_argument("--last", type=int, default=5, help="steps shown in the timeline (default 5)")
    args = parser.parse_args(argv)
    from tpurl.report.write import write_report  # matplotlib is imported only when a report is made

    print(f"report: {write_report(args.run_dirs, args.out, last=args.last)}", flush=True)
    return 0
