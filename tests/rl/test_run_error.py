"""A run that stops on an error past its setup keeps the full traceback in its run directory (the
command line prints the error in one line), and the error still propagates."""

import os

import pytest

import tpurl.rl.loop as loop
from algo_helpers import tiny_rl_config
from tpurl.commands.common import fail
from tpurl.train.config import algorithm_preset


def test_an_error_in_the_step_loop_leaves_its_traceback(tmp_path, monkeypatch, capsys):
    def broken_step(rt, state):
        raise ValueError("a shape bug deep in the step")

    monkeypatch.setattr(loop, "rl_step", broken_step)
    cfg = tiny_rl_config(tmp_path / "run", algorithm_preset("grpo", group_size=4))
    with pytest.raises(ValueError, match="a shape bug") as info:
        loop.run(cfg, verbose=False)
    path = os.path.join(tmp_path / "run", loop.TRACEBACK_FILE)
    text = open(path).read()
    assert text.startswith("Traceback") and "broken_step" in text and "a shape bug deep in the step" in text
    # The command line's one line names the file.
    capsys.readouterr()  # what the run said before it failed
    assert fail("tpurl train", info.value) == 2
    assert capsys.readouterr().err == f"tpurl train: a shape bug deep in the step (traceback: {path})\n"


@pytest.mark.parametrize("where", ["_fresh_state", "rl_step"])
def test_a_failed_run_closes_its_logs_and_checkpointer(tmp_path, monkeypatch, where):
    """However the run ends (here: an error in its setup, or in the step loop), the writers and
    the checkpointer it opened are closed."""
    closed = []

    def closing(cls):
        class Recorded(cls):
            def close(self):
                closed.append(cls.__name__)
                super().close()
        return Recorded
    for name in ("Checkpointer", "MetricsLogger", "TrajectoryLogger"):
        monkeypatch.setattr(loop, name, closing(getattr(loop, name)))

    def broken(*args, **kwargs):
        raise ValueError(f"{where} broke")
    monkeypatch.setattr(loop, where, broken)
    cfg = tiny_rl_config(tmp_path / "run", algorithm_preset("grpo", group_size=4))
    with pytest.raises(ValueError, match=f"{where} broke"):
        loop.run(cfg, verbose=False)
    assert sorted(closed) == ["Checkpointer", "MetricsLogger", "TrajectoryLogger"]
