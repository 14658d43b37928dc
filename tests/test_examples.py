"""The example package in examples/custom_reward: its gin files build runs whose task class and
reward function come from outside tpurl, found on the import path as the examples' headers say."""

import json
import os

import gin
import pytest

from helpers import CHATML, write_bpe_tokenizer
from tpurl.commands.train import build_config
from tpurl.rl.loop import prepare

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_reward")


def _build(name: str, *bindings: str):
    try:
        return build_config([os.path.join(EXAMPLE, name)], list(bindings))
    finally:
        gin.clear_config()


@pytest.fixture(autouse=True)
def on_the_import_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE)
    monkeypatch.chdir(os.path.join(EXAMPLE, "..", ".."))  # the repository root, where the commands run


def test_the_reverse_task_class_builds_from_its_gin():
    cfg = _build("reverse.gin")
    spec, task = prepare(cfg, 8)
    assert type(task).__module__ == "my_rl.reverse" and task.cfg.length == 5 and len(task.eval_problems()) == 200
    p = task.train_problem(0)
    assert task.score(p, p.answer, "stop").total == pytest.approx(1.5)
    assert task.score(p, p.answer[::-1], "stop").components["correct"] == float(p.answer == p.answer[::-1])


def test_the_custom_reward_builds_from_its_gin_and_scores_with_the_example_function(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(EXAMPLE, "data", "train.jsonl"))]
    write_bpe_tokenizer(str(tmp_path), [r["word"] + r["answer"] for r in rows], vocab_size=300,
                        chat_template=CHATML, eos="<|im_end|>")
    cfg = _build("custom.gin", f"tpurl.TaskConfig.tokenizer='{tmp_path}'")
    spec, task = prepare(cfg, 8)
    assert task.cfg.reward_fn == "my_rl.rewards:exact_and_brief" and task.reward_components == ("correct", "brief")
    p = task.train_problem(0)
    word = next(r for r in rows if r["answer"] == p.answer)["word"]
    assert f"Write the word {word} backwards" in p.prompt
    right, wordy = task.score_batch([p, p], [p.answer, "let me think " * 9 + "\n" + p.answer], ["stop", "stop"])
    assert right.components == {"correct": 1.0, "brief": 1.0} and right.total == pytest.approx(1.1)
    assert wordy.components == {"correct": 1.0, "brief": 0.0}
