"""`scripts/demo_seeds.py` on the tiny test config: one run per seed, the JSON report agrees with
each run's own `summary.json`, gin parameters reach every run, and a failing run is reported."""

import pytest
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "demo_seeds.py")


def _run(tmp_path, *args):
    proc = subprocess.run([sys.executable, SCRIPT, "--gin_file", "configs/test_tiny.gin",
                           "--run_root", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_report_matches_each_runs_summary(tmp_path):
    rc, report = _run(tmp_path, "--seeds", "3", "--gin_param", "tpurl.RLConfig.steps=1")
    assert rc == 0 and report["failed"] == []
    assert sorted(report["seeds"]) == ["3"]
    for seed, r in report["seeds"].items():
        with open(os.path.join(tmp_path, f"seed{seed}", "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(tmp_path, f"seed{seed}", "manifest.json")) as f:
            assert json.load(f)["seed"] == int(seed)
        assert summary["steps"] == 1  # the --gin_param reached the run
        warm = 100 * summary["warm_start_eval"]["eval/greedy_accuracy"]
        final = 100 * summary["final_eval"]["eval/greedy_accuracy"]
        assert r["warm_start_accuracy"] == round(warm, 1) and r["final_accuracy"] == round(final, 1)
        assert r["gain_points"] == round(final - warm, 1)
        assert r["within_budget"] == (r["wall_s"] <= 600)
        # `tpurl train` ends by writing the run's report (`tpurl report`) and saying where it is.
        report_md = os.path.join(tmp_path, f"seed{seed}", "report", "report.md")
        assert os.path.getsize(report_md) > 0 and f"report: {report_md}" in open(r["run_dir"] + ".log").read()
    gains = [r["gain_points"] for r in report["seeds"].values()]
    assert report["min_gain_points"] == min(gains)
    assert report["median_gain_points"] == statistics.median(gains)


@pytest.mark.slow
def test_failed_run_is_reported(tmp_path):
    rc, report = _run(tmp_path, "--seeds", "0", "--gin_param", "tpurl.RLConfig.steps=-1")
    assert rc == 1 and report["failed"] == ["0"]
    assert "exit status 2" in report["seeds"]["0"]["error"]
    assert report["min_gain_points"] is None


def test_rerun_into_the_same_root_is_refused(tmp_path):
    (tmp_path / "seed3").mkdir()
    (tmp_path / "seed3" / "summary.json").write_text("{}")
    proc = subprocess.run([sys.executable, SCRIPT, "--seeds", "3", "--run_root", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "already holds the run of seed 3" in proc.stderr
    assert (tmp_path / "seed3" / "summary.json").read_text() == "{}"  # the earlier run is untouched
