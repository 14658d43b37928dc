"""Write a report (plots + report.md) for one or more runs into one folder."""

from __future__ import annotations

import os

from tpurl.logging import METRICS_FILE, atomic_write_text
from tpurl.report.data import load_run
from tpurl.report.plots import plot_experts, plot_memory, plot_rewards, plot_timeline
from tpurl.report.summary import report_markdown

REPORT_DIR = "report"  # under the run directory, by default
IMAGES = ("timeline.png", "rewards.png", "memory.png")
EXPERTS_IMAGE = "experts.png"
REPORT_FILE = "report.md"


def output_dir(run_dirs: list[str], out: str | None) -> str:
    """Where the report goes: `out`, or `RUN_DIR/report` for a single run. A comparison of several
    runs needs `out` (it belongs to none of them), and `out` must not be a run directory itself
    (its logs are never mixed with a report)."""
    if out is None:
        if len(run_dirs) != 1:
            raise ValueError(f"a report of {len(run_dirs)} runs needs --out DIR (a folder of its own; each run's "
                             f"own report goes to RUN_DIR/{REPORT_DIR})")
        out = os.path.join(run_dirs[0], REPORT_DIR)
    if os.path.exists(os.path.join(out, METRICS_FILE)):
        raise ValueError(f"--out {out} is a run directory (it holds {METRICS_FILE}); choose a folder of its own, "
                         f"e.g. {os.path.join(out, REPORT_DIR)}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a directory; choose another path")
    return out


def write_report(run_dirs: list[str], out: str | None = None, *, last: int = 5) -> str:
    """Load each run's logs, write timeline.png, rewards.png, memory.png (experts.png for a
    mixture-of-experts run) and report.md into `output_dir(run_dirs, out)`, and return the path
    of report.md. Bad input (a folder without metrics.jsonl, a damaged log) raises a one-line ValueError before anything is written."""
    if last < 1:
        raise ValueError(f"--last {last} must be at least 1 (steps shown in the timeline)")
    out = output_dir(run_dirs, out)
    runs = [load_run(d) for d in run_dirs]
    os.makedirs(out, exist_ok=True)
    timeline, rewards, memory = (os.path.join(out, name) for name in IMAGES)
    plot_timeline(runs, timeline, last=last)
    plot_rewards(runs, rewards)
    plot_memory(runs, memory)
    images = list(IMAGES)
    if plot_experts(runs, os.path.join(out, EXPERTS_IMAGE)):  # a mixture-of-experts run's routing load
        images.append(EXPERTS_IMAGE)
    path = os.path.join(out, REPORT_FILE)
    atomic_write_text(path, report_markdown(runs, images))
    return path
