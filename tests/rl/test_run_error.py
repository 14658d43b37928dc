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
    assert fail("tpurl train", info.value) == 2
    assert capsys.readouterr().err == f"tpurl train: a shape bug deep in the step (traceback: {path})\n"
