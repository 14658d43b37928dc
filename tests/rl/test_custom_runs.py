"""Whole runs with the user's own code from outside the package (a temporary module on
sys.path): a task class named by import path, and the `custom` task's reward function that
raises, hangs or returns NaN on some samples while the run completes."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

from algo_helpers import tiny_rl_config
from helpers import CHATML, write_bpe_tokenizer
from tpurl.logging import read_jsonl
from tpurl.rl.loop import run
from tpurl.tasks import CustomConfig, TaskConfig

USER = textwrap.dedent('''
    import dataclasses, math, time

    KINDS = ("ok", "raise", "hang", "nan")

    def kind(completion):
        return KINDS[sum(map(ord, completion)) % 4]

    def graded(prompt, completion, row):
        if kind(completion) == "raise":
            raise RuntimeError("grader service down")
        if kind(completion) == "hang":
            time.sleep(3600)
        if kind(completion) == "nan":
            return {"correct": math.nan, "short": 1.0}
        return {"correct": float(completion.strip() == row["answer"]), "short": float(len(completion) <= 3)}

    class Reverse:
        @dataclasses.dataclass(frozen=True)
        class Config:
            letters: int = 3
            max_new_tokens: int = 4

        name, version, grader = "reverse", "reverse-v1", "exact"
        reward_components = ("correct", "length")
        stop_strings = ()

        def __init__(self, config, *, tokenizer):
            from tpurl.tokenizer import CharTokenizer
            self.cfg, self.tokenizer = config, tokenizer or CharTokenizer("abcdef>")
            self.max_new_tokens, self.max_prompt_len = config.max_new_tokens, config.letters + 2

        def _problem(self, i):
            from tpurl.tasks import Problem
            word = "".join("abcdef"[(i * 7 + j * 5) % 6] for j in range(self.cfg.letters))
            return Problem(uid=str(i), prompt=word + ">", answer=word[::-1])

        def encode_prompt(self, problem):
            return self.tokenizer.encode(problem.prompt, add_bos=True)

        def train_problem(self, index):
            return self._problem(8 + index % 30)

        def eval_problems(self):
            return [self._problem(i) for i in range(8)]

        def demonstration(self, problem, index):
            return problem.answer

        def score(self, problem, completion, finish_reason):
            from tpurl.tasks import Reward
            ok = float(finish_reason == "stop" and completion == problem.answer)
            return Reward(components={"correct": ok, "length": float(len(completion))}, total=ok)

        def data_report(self):
            return []

        data_files = ()
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "team_rl_code.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "team_rl_code"
    sys.modules.pop("team_rl_code", None)


def _run(run_dir, task):
    result = run(tiny_rl_config(run_dir, "grpo", task=task, steps=2), verbose=False)
    manifest = json.load(open(os.path.join(result.run_dir, "manifest.json")))
    return result, manifest, read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))


@pytest.mark.slow
def test_a_task_class_from_outside_the_package_trains(tmp_path, user_module):
    result, manifest, traj = _run(tmp_path / "run", TaskConfig(name=f"{user_module}:Reverse"))
    assert result.steps == 2 and manifest["task"]["name"] == "reverse"
    code = manifest["task"]["code"][f"{user_module}:Reverse"]
    assert code["file"] == str(tmp_path / "team_rl_code.py") and len(code["sha256"]) == 64
    assert traj and all(set(t["rewards"]) == {"correct", "length"} for t in traj)
    assert any(t["rewards"]["length"] > 0 for t in traj)


@pytest.mark.slow
def test_a_reward_function_that_raises_hangs_or_returns_nan_costs_only_its_samples(tmp_path, user_module):
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tmp_path / "tok"
    write_bpe_tokenizer(str(tok), [f"{r['question']}={r['answer']}" for r in rows], vocab_size=290,
                        chat_template=CHATML, eos="<|im_end|>")
    custom = CustomConfig(train_file=str(data), prompt_template="{question}=", answer_key="answer", num_eval=4,
                          max_new_tokens=3, reward_fn=f"{user_module}:graded", score_truncated=True,
                          reward_weights={"correct": 1.0, "short": 0.5}, timeout_s=1.0)
    result, manifest, traj = _run(tmp_path / "run", TaskConfig(name="custom", custom=custom, tokenizer=str(tok)))
    assert result.steps == 2 and manifest["task"]["grader"] == f"{user_module}:graded"
    assert manifest["task"]["code"][f"{user_module}:graded"]["sha256"]
    kind = sys.modules[user_module].kind  # what the function decides by: the completion
    by_kind = {}
    for t in traj:
        by_kind.setdefault(kind(t["completion"]), []).append(t)
    assert set(by_kind) == {"ok", "raise", "hang", "nan"}
    for t in by_kind["ok"]:
        assert "error" not in t["info"] and set(t["rewards"]) == {"correct", "short"}
    want = {"raise": "raised RuntimeError: grader service down", "hang": "timed out after 1 s",
            "nan": "returned correct=nan, not a finite number"}
    for kind, text in want.items():
        for t in by_kind[kind]:
            assert t["info"]["error"] == f"{user_module}:graded {text}"
            assert t["rewards"] == {"correct": 0.0, "short": 0.0}
    metrics = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert all(0 < m["rollout/env_error_frac"] < 1 and np.isfinite(m["train/loss"]) for m in metrics)
