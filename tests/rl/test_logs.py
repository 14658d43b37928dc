"""Log writers: append-safe JSONL, atomic writes, metrics/eval/trajectory files, the timeline."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.logging import (EVAL_FILE, METRICS_FILE, TRAJECTORIES_FILE, JsonlWriter, LoggingConfig, MetricsLogger,
                           TrajectoryLogger, atomic_write_json, read_jsonl, to_jsonable)
from tpurl.rl.timeline import Timeline, summarize


def test_jsonl_is_append_safe_and_torn_line_is_dropped(tmp_path):
    path = str(tmp_path / "x.jsonl")
    with JsonlWriter(path) as w:
        w.write({"step": 1, "a": np.float32(1.5), "b": jnp.arange(3), "c": float("nan")})
    with JsonlWriter(path) as w:  # reopening appends
        w.write({"step": 2})
    with open(path, "a") as f:
        f.write('{"step": 3, "a"')  # a writer killed mid-record
    recs = read_jsonl(path)
    assert recs == [{"step": 1, "a": 1.5, "b": [0, 1, 2], "c": None}, {"step": 2}]


def test_atomic_write_replaces_whole_file(tmp_path):
    path = str(tmp_path / "m.json")
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": np.int64(2), "t": (1, 2)})
    assert json.load(open(path)) == {"a": 2, "t": [1, 2]}
    assert os.listdir(tmp_path) == ["m.json"]  # no temp files left behind
    assert to_jsonable({"k": np.bool_(True)}) == {"k": True}


def test_metrics_eval_trajectories_and_resume_truncation(tmp_path):
    run = str(tmp_path)
    log = MetricsLogger(run, LoggingConfig(trackers=("tensorboard",)))
    for step in range(1, 5):
        log.log_step(step, {"reward/total/mean": step * 0.1})
    log.log_eval(2, {"eval/greedy_accuracy": 0.5})
    log.log_eval(4, {"eval/greedy_accuracy": 0.7})
    log.close()
    assert [r["step"] for r in read_jsonl(os.path.join(run, METRICS_FILE))] == [1, 2, 3, 4]
    assert any(f.startswith("events") for f in os.listdir(os.path.join(run, "tb")))
    # Resuming from the step-2 checkpoint forgets the killed run's steps 3 and 4.
    MetricsLogger(run, LoggingConfig(trackers=()), resume_from_step=2).close()
    assert [r["step"] for r in read_jsonl(os.path.join(run, METRICS_FILE))] == [1, 2]
    assert [r["step"] for r in read_jsonl(os.path.join(run, EVAL_FILE))] == [2]

    traj = TrajectoryLogger(run, sample_rate=0.5)
    recs = [{"group_id": g, "sample_index": 0} for g in range(200)]
    n = traj.log(3, 2, recs)
    traj.close()
    assert 60 < n < 140  # about half of the groups
    again = TrajectoryLogger(str(tmp_path / "other"), sample_rate=0.5)
    assert again.log(3, 2, recs) == n  # deterministic per (step, group)
    again.close()
    written = read_jsonl(os.path.join(run, TRAJECTORIES_FILE))
    assert all(r["step"] == 3 and r["policy_version"] == 2 for r in written)


def test_timeline_phases_block_and_add_up(monkeypatch):
    """Each phase's device work is finished inside it, and every second of the step is either in
    a phase or in `other`. A fake clock makes the accounting exact (a busy machine cannot stretch
    it); the device work is real and dispatched asynchronously, so it is only ready at the end of
    the phase if the phase blocked on it."""
    now = [0.0]

    def advance(seconds):  # binary fractions: the sums below are exact
        now[0] += seconds

    monkeypatch.setattr(Timeline, "clock", staticmethod(lambda: now[0]))
    f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
    x = jnp.ones((512, 512)) * 0.01
    f(x).block_until_ready()
    dispatched = []
    ready_at_end = []

    def on_phase_end(name):
        ready_at_end.append((name, all(y.is_ready() for y in dispatched)))
        advance(0.5)  # the hook runs after the phase's clock stops: timed as `memory_account`

    tl = Timeline(on_phase_end=on_phase_end)
    advance(0.25)  # before the first phase
    with tl.phase("compute") as res:
        dispatched[:] = [f(x) for _ in range(5)]  # asynchronous dispatch, finished inside the phase
        res.value = dispatched
        advance(1.0)
    advance(0.125)  # between phases
    with tl.phase("host"):
        advance(2.0)
    with tl.phase("compute") as res:  # a repeated phase accumulates
        dispatched[:] = [f(x)]
        res.value = dispatched
        advance(1.0)
    wall = tl.finish()
    advance(4.0)  # after the step: not part of it
    m = tl.metrics()
    assert ready_at_end == [("compute", True), ("host", True), ("compute", True)]
    assert tl.order == ["compute", "memory_account", "host"]
    compile_s = m.pop("compile/seconds")  # real seconds (JAX's compile events), not the fake clock's
    assert compile_s >= 0
    assert m == {"time/compute_s": 2.0, "time/host_s": 2.0, "time/memory_account_s": 1.5, "time/step_s": 5.875,
                 "time/other_s": 0.375}
    assert wall == m["time/step_s"]
    assert summarize([m, m])["host"] == {"mean_s": 2.0, "share": 2.0 / 5.875}
