"""`tpurl report`: plots and report.md from a real (tiny) run's own logs; the numbers in the report
are checked against values computed here, independently, from the JSONL logs."""

import json
import os
import shutil
import struct
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "rl"))

from algo_helpers import tiny_rl_config  # noqa: E402
from tpurl.commands.main import main as tpurl_main  # noqa: E402
from tpurl.rl.config import EvalConfig  # noqa: E402
from tpurl.train.config import algorithm_preset  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMAGES = ("timeline.png", "rewards.png", "memory.png")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 3-step GRPO run with a held-out evaluation after every step."""
    import tpurl.rl.loop as loop

    path = tmp_path_factory.mktemp("report") / "run"
    cfg = tiny_rl_config(path, algorithm_preset("grpo", group_size=4), steps=3,
                         eval=EvalConfig(every_steps=1, pass_k=2))
    return loop.run(cfg, verbose=False).run_dir


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def png_width(path) -> int:
    data = open(path, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, path
    return struct.unpack(">I", data[16:20])[0]  # IHDR width


@pytest.mark.slow
def test_report_numbers_equal_the_logs(run_dir, capsys):
    assert tpurl_main(["report", run_dir]) == 0
    out = os.path.join(run_dir, "report")
    assert capsys.readouterr().out == f"report: {os.path.join(out, 'report.md')}\n"
    for name in IMAGES:
        png_width(os.path.join(out, name))
    text = open(os.path.join(out, "report.md")).read()
    steps = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    timed = steps[1:]  # the first step compiles
    update = sum(r["time/update_s"] for r in timed) / len(timed)
    step = sum(r["time/step_s"] for r in timed) / len(timed)
    assert f"| update | {update:.4f} | {100 * update / step:.1f}% |" in text
    assert f"{step:.4f} s per step, {3600 / step:.1f} steps/hour" in text
    evals = jsonl(os.path.join(run_dir, "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 1, 2, 3]
    acc0, acc = evals[0]["eval/greedy_accuracy"], evals[-1]["eval/greedy_accuracy"]
    assert f"| greedy_accuracy | {acc0:.1%} | {acc:.1%} |" in text
    assert f"| pass@2 | {evals[0]['eval/pass@2']:.1%} | {evals[-1]['eval/pass@2']:.1%} |" in text
    manifest = json.load(open(os.path.join(run_dir, "manifest.json")))
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert (f"git {manifest['git_commit'][:12]}" in text and f"{manifest['param_count']:,} parameters" in text
            and f"{summary['wall_s'] / 60:.1f} min wall" in text)
    r0, r1 = steps[0]["reward/total/mean"], steps[-1]["reward/total/mean"]
    assert f"| total | {r0:.4f} | {r1:.4f} |" in text
    kv = max(v for r in steps for k, v in r.items() if k.endswith("/kv_pool_device_bytes"))
    opt = max(v for r in steps for k, v in r.items() if k.endswith("/opt_state_device_bytes"))
    total = max(v for r in steps for k, v in r.items() if k.startswith("memory/") and k.endswith("/device_bytes")
                and k.count("/") == 2 and k.split("/")[2] == "device_bytes")
    assert f"- peak KV pool: {kv / 2**20:.2f} MiB (offload)" in text
    assert f"- peak optimizer state: {opt / 2**20:.2f} MiB" in text and f"- peak total: {total / 2**20:.2f} MiB" in text


@pytest.mark.slow
def test_report_numbers_follow_the_logs_not_the_summary(run_dir, tmp_path):
    """A distinctive held-out accuracy written into the log shows up in the report."""
    from tpurl.report.summary import run_numbers
    from tpurl.report.data import load_run

    copy = shutil.copytree(run_dir, tmp_path / "edited")
    evals = jsonl(copy / "eval.jsonl")
    evals[-1]["eval/greedy_accuracy"] = 0.625
    (copy / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    numbers = run_numbers(load_run(str(copy)))
    assert numbers["eval_end"]["eval/greedy_accuracy"] == 0.625 and numbers["steps"] == 3
    assert tpurl_main(["report", str(copy)]) == 0
    assert "| greedy_accuracy | 0.0% | 62.5% |" in (copy / "report" / "report.md").read_text()


@pytest.mark.slow
def test_two_runs_side_by_side(run_dir, tmp_path, capsys, monkeypatch):
    import tpurl.report.plots as plots

    panels = {}  # image name -> the figure's panels, as (left edge, title)
    save = plots.save

    def spy(fig, path):
        panels[os.path.basename(path)] = sorted((ax.get_position().x0, ax.get_title()) for ax in fig.axes)
        save(fig, path)

    monkeypatch.setattr(plots, "save", spy)
    other = shutil.copytree(run_dir, tmp_path / "disaggregated")
    out = tmp_path / "compare"
    assert tpurl_main(["report", run_dir, str(other), "--out", str(out), "--last", "2"]) == 0
    text = (out / "report.md").read_text()
    assert f"## {os.path.basename(run_dir)}" in text and "## disaggregated" in text
    # The timeline: one panel per run, side by side, each with the last 2 steps.
    (x0, title0), (x1, title1) = panels["timeline.png"]
    assert x0 < x1 and title0 == f"{os.path.basename(run_dir)}: steps 2-3" and title1 == "disaggregated: steps 2-3"
    assert len(panels["rewards.png"]) == 4 and len(panels["memory.png"]) == 2
    for name in IMAGES:
        png_width(out / name)
    capsys.readouterr()
    # Several runs need a folder of their own; a run directory is not one.
    assert tpurl_main(["report", run_dir, str(other)]) == 2
    assert tpurl_main(["report", run_dir, "--out", str(other)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "needs --out" in err[0] and "is a run directory" in err[1]


@pytest.mark.slow
def test_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path, capsys):
    assert tpurl_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"tpurl report: {tmp_path} has no metrics.jsonl")
    assert os.listdir(tmp_path) == []
    damaged = shutil.copytree(run_dir, tmp_path / "damaged", ignore=shutil.ignore_patterns("report"))
    with open(damaged / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert tpurl_main(["report", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{damaged / 'metrics.jsonl'}:4 is not a JSON record" in err
    assert not (damaged / "report").exists()


@pytest.mark.slow
def test_end_of_run_report_line_never_fails_the_run(run_dir, monkeypatch):
    import tpurl.report.write as write
    from tpurl.commands.train import report_files

    assert report_files(run_dir) == f"report: {os.path.join(run_dir, 'report', 'report.md')}"

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts\nsecond line")

    monkeypatch.setattr(write, "write_report", broken)
    assert report_files(run_dir) == (f"report: not written (RuntimeError: no fonts); retry with: tpurl report "
                                     f"{run_dir}")
