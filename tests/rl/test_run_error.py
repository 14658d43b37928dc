"""A run that stops on an error past its setup keeps the full traceback in its run directory (the
command line prints the error in one line), and the error still propagates."""

import os

import pytest

import tpurl.rl.loop as loop
from algo_helpers import tiny_rl_config
from tpurl.commands.common import fail
from tpurl.train.config import algorithm_preset


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("where", ["fresh_state", "rl_step"])
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


@pytest.mark.slow  # whole runs
@pytest.mark.parametrize("every, hint", [
    (1, "continue it with --resume (from checkpoint step 2, in {run_dir})"),
    (0, "checkpoints are off (CheckpointConfig.every_steps=0), so it cannot be resumed"),
])
def test_ctrl_c_is_one_line_with_the_step_and_how_to_continue(tmp_path, monkeypatch, capsys, every, hint):
    """Ctrl-C during step 3 (KeyboardInterrupt where the signal lands): status 130 and one line, not
    a traceback."""
    from tpurl.commands import train

    real = loop.rl_step

    def interrupted_step(rt, state):
        if state.step == 2:
            raise KeyboardInterrupt
        return real(rt, state)

    monkeypatch.setattr(loop, "rl_step", interrupted_step)
    run_dir = tmp_path / "run"
    gin = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")
    argv = ["--quiet", "--gin_file", gin, "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'",
            "--gin_param", "tpurl.RLConfig.steps=4", "--gin_param", f"tpurl.CheckpointConfig.every_steps={every}"]
    assert train.main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"tpurl train: interrupted after RL step 2 of 4; {hint.format(run_dir=run_dir)}"
