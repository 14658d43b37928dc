"""The numbers of a run's report, computed from its logs, and their Markdown rendering."""

from __future__ import annotations

from tpurl.report.data import RunLogs, memory_peaks, phases, reward_components
from tpurl.rl.timeline import COMPILE_KEY, compile_summary, steady_steps, summarize


def eval_at(logs: RunLogs, which: str) -> dict | None:
    """The held-out evaluation after the warm start (`which="start"`: step 0) or the last one
    (`"end"`); None when the run logged none there."""
    if not logs.evals:
        return None
    if which == "start":
        return next((r for r in logs.evals if r.get("step") == 0), None)
    return logs.evals[-1]


def run_numbers(logs: RunLogs) -> dict:
    """What report.md states for one run: timeline means, steps/hour, held-out accuracy, reward
    and memory peaks."""
    timed = steady_steps(logs.steps)
    timeline = summarize(timed)
    step_s = timeline.get("step", {}).get("mean_s", 0.0)
    first, last = logs.steps[0], logs.steps[-1]
    components = reward_components(logs.steps)
    return {
        "steps": last["step"], "timed_steps": [r["step"] for r in timed],
        "timeline": {p: timeline[p] for p in phases(timed) if p in timeline}, "step_s": step_s,
        "steps_per_hour": 3600.0 / step_s if step_s > 0 else float("nan"),
        "eval_start": eval_at(logs, "start"), "eval_end": eval_at(logs, "end"),
        "reward": {c: (first.get(f"reward/{c}/mean"), last.get(f"reward/{c}/mean")) for c in components},
        "reward_steps": (first["step"], last["step"]),
        "memory": memory_peaks(logs.steps),
        "compile": compile_summary(logs.steps),
        "compile_logged": any(COMPILE_KEY in r for r in logs.steps),
    }


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _timeline_md(n: dict) -> list[str]:
    steps = n["timed_steps"]
    c = n["compile"]
    left_out = (f"those that compiled no program ({c['steps']} steps spent {c['seconds']:.1f} s compiling)"
                if n["compile_logged"] else "the first step, which compiles, left out")
    lines = [f"Timeline: mean over {len(steps)} of steps {steps[0]}-{steps[-1]}, {left_out}: "
             f"{n['step_s']:.4f} s per step, {n['steps_per_hour']:.1f} steps/hour.", "",
             "| phase | mean s | share |", "|---|---:|---:|"]
    lines += [f"| {p} | {v['mean_s']:.4f} | {100 * v['share']:.1f}% |" for p, v in n["timeline"].items()]
    return lines


def _eval_md(n: dict) -> list[str]:
    start, end = n["eval_start"] or {}, n["eval_end"] or {}
    keys = [k for k in sorted({*start, *end}) if k == "eval/greedy_accuracy" or k.startswith("eval/pass@")]
    if not keys:
        return ["Held-out evaluation: none logged (eval.jsonl)."]
    lines = [f"| held-out | after warm start (step 0) | at the end (step {end.get('step', 'n/a')}) |",
             "|---|---:|---:|"]
    for k in keys:
        lines.append(f"| {k[len('eval/'):]} | {_num(start.get(k), '.1%')} | {_num(end.get(k), '.1%')} |")
    return lines


def _reward_md(n: dict) -> list[str]:
    a, b = n["reward_steps"]
    lines = [f"| reward (batch mean) | step {a} | step {b} |", "|---|---:|---:|"]
    lines += [f"| {c} | {_num(s, '.4f')} | {_num(e, '.4f')} |" for c, (s, e) in n["reward"].items()]
    return lines


def _memory_md(n: dict) -> list[str]:
    if not n["memory"]:
        return ["Memory: none logged."]
    groups = sorted({g for v in n["memory"].values() for g in v})
    lines = ["Device memory, peak over the steps (MiB per phase):", "",
             "| phase | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
    for p, v in n["memory"].items():
        lines.append(f"| {p} | " + " | ".join(f"{v[g] / 2**20:.2f}" if g in v else "-" for g in groups) + " |")
    lines.append("")
    for g in groups:
        phase, peak = max(((p, v[g]) for p, v in n["memory"].items() if g in v), key=lambda x: x[1])
        lines.append(f"- peak {g}: {peak / 2**20:.2f} MiB ({phase})")
    return lines


def _trained(extra: dict) -> str | None:
    """What the update trains, when the run froze a base (LoRA): trained parameters, the train state's
    bytes by part."""
    sizes = extra.get("train_state")
    if not isinstance(sizes, dict) or not sizes.get("frozen_params"):
        return None
    mib = lambda k: sizes.get(k, 0) / 2**20  # noqa: E731
    return (f"LoRA ({extra.get('adapters')} in the rollout): {sizes['trained_params']:,} trained parameters, "
            f"{mib('trained_bytes'):.2f} MiB + {mib('optimizer_bytes'):.2f} MiB optimizer state, the base "
            f"{mib('frozen_bytes'):.2f} MiB frozen")


def what_ran(logs: RunLogs) -> str:
    """One line from manifest.json and summary.json (when the run wrote them): commit, backend,
    parameters, seed, wall time."""
    m, s = logs.manifest or {}, logs.summary or {}
    parts = [f"git {str(m['git_commit'])[:12]}{' (dirty)' if m.get('git_dirty') else ''}" if m.get("git_commit")
             else None,
             f"backend {m['backend']}" if "backend" in m else None,
             f"{m['param_count']:,} parameters" if isinstance(m.get("param_count"), int) else None,
             _trained(m.get("extra", {})),
             f"seed {m['seed']}" if "seed" in m else None,
             f"{s['wall_s'] / 60:.1f} min wall" if isinstance(s.get("wall_s"), (int, float)) else None,
             f"resumed from step {s['resumed_from']}" if s.get("resumed_from") is not None else None]
    kept = [p for p in parts if p]
    return "; ".join(kept) + "." if kept else "No manifest.json or summary.json (an unfinished run)."


def run_markdown(logs: RunLogs) -> str:
    """One run's section of report.md."""
    n = run_numbers(logs)
    parts = [f"## {logs.name}", "", f"`{logs.run_dir}`: {n['steps']} RL steps. {what_ran(logs)}", "",
             *_timeline_md(n), "",
             *_eval_md(n), "", *_reward_md(n), "", *_memory_md(n)]
    return "\n".join(parts) + "\n"


def report_markdown(runs: list[RunLogs], images: list[str]) -> str:
    """The whole report.md: the plots, then one section per run."""
    head = ["# tpurl run report", "", *(f"![{i.rsplit('.', 1)[0]}]({i})" for i in images), ""]
    return "\n".join(head) + "\n" + "\n".join(run_markdown(r) for r in runs)
