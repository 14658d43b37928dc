"""The report's figures (matplotlib, Agg backend: no display needed), one column per run so that
runs (e.g. colocated vs disaggregated) sit side by side. Each figure is written atomically."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from tpurl.logging import atomic_write_bytes  # noqa: E402
from tpurl.report.data import (PHASE_ORDER, RunLogs, eval_keys, expert_shares, memory_peaks, phase_order,  # noqa: E402
                               phases, reward_components, series)
from tpurl.rl.timeline import steady_steps  # noqa: E402

MIB = 2.0**20


def save(fig, path: str) -> None:
    """Render `fig` as PNG and write it to `path` atomically; the figure is closed."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _columns(n: int, rows: int = 1, **kw):
    fig, axes = plt.subplots(rows, n, figsize=(6.5 * n, 3.6 * rows), squeeze=False, **kw)
    return fig, axes


def phase_colors(names) -> dict[str, object]:
    """One fixed color per phase, the same in every run's panel."""
    cmap = plt.get_cmap("tab10")
    known = list(PHASE_ORDER) + sorted(set(names) - set(PHASE_ORDER))
    return {p: cmap(known.index(p) % 10) for p in phase_order(names)}


def _gantt(ax, logs: RunLogs, last: int, colors) -> None:
    """One row per step (the last `last`, leaving out the first step, which compiles, when there
    are others), each phase a bar from where the previous one ended. A phase that ran more than
    once in a step (dynamic sampling) is drawn as one bar of its total."""
    steps = steady_steps(logs.steps)[-last:]
    for row, r in enumerate(steps):
        t = 0.0
        for p in phases([r]):
            dt = float(r.get(f"time/{p}_s", 0.0))
            ax.barh(row, dt, left=t, color=colors[p], edgecolor="white", linewidth=0.5,
                    label=p if row == 0 else None)
            t += dt
    ax.set_yticks(range(len(steps)), [f"step {r['step']}" for r in steps])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step started")
    ax.set_title(f"{logs.name}: steps {steps[0]['step']}-{steps[-1]['step']}")


def plot_timeline(runs: list[RunLogs], path: str, last: int = 5) -> None:
    """timeline.png: a Gantt of the phases of each run's last `last` steps, runs side by side."""
    colors = phase_colors({p for logs in runs for p in phases(logs.steps)})
    fig, axes = _columns(len(runs), sharex=True)
    for ax, logs in zip(axes[0], runs):
        _gantt(ax, logs, last, colors)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.tight_layout()
    fig.legend(handles, list(colors), loc="upper center", ncol=min(len(colors), 9), bbox_to_anchor=(0.5, 0.0))
    save(fig, path)


def _reward_panel(ax, logs: RunLogs) -> None:
    for c in reward_components(logs.steps):
        x, y = series(logs.steps, f"reward/{c}/mean")
        ax.plot(x, y, marker=".", linewidth=2.0 if c == "total" else 1.0, label=c)
    ax.set_title(f"{logs.name}: reward components (batch mean)")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")


def _eval_panel(ax, logs: RunLogs) -> None:
    for k in eval_keys(logs.evals):
        x, y = series(logs.evals, k)
        ax.plot(x, y, marker="o", label=k[len("eval/"):])
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{logs.name}: held-out (step 0: after warm start)")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logs.evals:
        ax.legend(fontsize="small")


def plot_rewards(runs: list[RunLogs], path: str) -> None:
    """rewards.png: each reward component over steps (top), held-out greedy accuracy and pass@k
    (bottom), one column per run."""
    fig, axes = _columns(len(runs), rows=2)
    for col, logs in enumerate(runs):
        _reward_panel(axes[0][col], logs)
        _eval_panel(axes[1][col], logs)
    fig.tight_layout()
    save(fig, path)


def _memory_panel(ax, logs: RunLogs) -> None:
    """Grouped bars: per phase, the peak device bytes of each memory group."""
    peaks = memory_peaks(logs.steps)
    groups = sorted({g for v in peaks.values() for g in v})
    width = 0.8 / max(len(groups), 1)
    x = np.arange(len(peaks))
    for i, g in enumerate(groups):
        ax.bar(x + i * width, [v.get(g, 0.0) / MIB for v in peaks.values()], width, label=g)
    ax.set_xticks(x + 0.4 - width / 2, list(peaks), rotation=30, ha="right")
    ax.set_ylabel("MiB on device (peak over steps)")
    ax.set_title(f"{logs.name}: device memory per phase")
    if groups:
        ax.legend(fontsize="small")


def plot_experts(runs: list[RunLogs], path: str) -> bool:
    """experts.png, for runs of a mixture-of-experts model: each sparse layer's experts' share of the
    routed tokens over steps (one row per layer, one column per run; 1 / E each when balanced).
    Returns whether any run logged expert shares (nothing is written otherwise)."""
    loads = [expert_shares(logs.steps) for logs in runs]
    rows = max((len(x) for x in loads), default=0)
    if not rows:
        return False
    fig, axes = _columns(len(runs), rows=rows)
    for col, (logs, load) in enumerate(zip(runs, loads)):
        steps = [r["step"] for r in logs.steps]
        for row, (layer, shares) in enumerate(load.items()):
            ax = axes[row][col]
            ax.stackplot(steps, shares.T, labels=[f"expert {j}" for j in range(shares.shape[1])])
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set_ylim(0, 1)
            ax.set_ylabel("share of routed tokens")
            ax.set_title(f"{logs.name}: sparse layer {layer}")
            if row == len(load) - 1:
                ax.set_xlabel("RL step")
        if load:
            axes[0][col].legend(fontsize="x-small", ncol=4, loc="upper right")
    fig.tight_layout()
    save(fig, path)
    return True


def plot_memory(runs: list[RunLogs], path: str) -> None:
    """memory.png: device bytes per phase and group (KV pool, optimizer state, total)."""
    fig, axes = _columns(len(runs))
    for ax, logs in zip(axes[0], runs):
        _memory_panel(ax, logs)
    fig.tight_layout()
    save(fig, path)
