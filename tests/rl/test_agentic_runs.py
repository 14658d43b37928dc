"""Short RL runs of the agentic tasks end to end (learning not required): the code task (rewards
from the sandbox) and the Python-tool environment (code turns run in the sandbox, their output
appended as observations), with every reward component, the tool errors and the per-token model
masks in `trajectories.jsonl`. Tiny models from scratch on a tokenizer written here."""

import json
import os

import numpy as np
import pytest

from algo_helpers import tiny_rl_config
from helpers import CHATML, write_bpe_tokenizer
from tpurl.logging import read_jsonl
from tpurl.rl.loop import run
from tpurl.sandbox import SandboxConfig
from tpurl.tasks import CodeConfig, EpisodeLimits, PythonToolConfig, TaskConfig
from tpurl.train.config import algorithm_preset

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

SANDBOX = SandboxConfig(timeout_s=2.0, memory_mb=256, max_processes=8, workers=4)
CODE_ROWS = [{"prompt": f"Write f{i}(x) returning x + {i}.", "reference": f"def f{i}(x):\n    return x + {i}",
              "tests": [f"assert f{i}(1) == {1 + i}", f"assert f{i}(0) == {i}"]} for i in range(12)]
MATH_ROWS = [{"question": f"{a} times {b}?", "answer": str(a * b)} for a in range(2, 8) for b in range(3, 6)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("agentic")
    corpus = [r["prompt"] + r["reference"] for r in CODE_ROWS] + [r["question"] + r["answer"] for r in MATH_ROWS]
    write_bpe_tokenizer(str(d / "tok"), corpus, vocab_size=320, chat_template=CHATML, eos="<|im_end|>")
    (d / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CODE_ROWS))
    (d / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    return d


def _run(tmp_path, data, task: TaskConfig):
    cfg = tiny_rl_config(tmp_path / "run", algorithm_preset("grpo", group_size=4), steps=1,
                         task=task.replace(tokenizer=str(data / "tok")))
    result = run(cfg, verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    (metrics,) = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert np.isfinite(metrics["train/loss"]) and len(traj) == cfg.batch_size
    return traj, metrics


def test_rl_on_the_code_task(tmp_path, data):
    code = CodeConfig(train_file=str(data / "code.jsonl"), num_eval=2, sandbox=SANDBOX, max_new_tokens=16,
                      max_prompt_tokens=128)
    traj, metrics = _run(tmp_path, data, TaskConfig(name="code", code=code))
    assert {"reward/correct/mean", "reward/passed_frac/mean", "reward/grader_error/mean"} <= set(metrics)
    for t in traj:
        assert set(t["rewards"]) == {"correct", "passed_frac", "format", "grader_error"}
        assert t["turns"] == 1 and all(t["model_mask"])


def test_rl_on_the_python_tool_environment(tmp_path, data):
    # A turn that ends with "1" is a tool call here, so that a random policy calls the tool (its
    # code fails): the sandbox runs, the error comes back as a tool turn, the episode goes on.
    tool = PythonToolConfig(train_file=str(data / "math.jsonl"), num_eval=2, sandbox=SANDBOX, max_new_tokens=96,
                            max_prompt_tokens=96, answer_format="last_number", tool_stop="1", max_output_chars=16,
                            limits=EpisodeLimits(max_turns=3, max_tool_calls=2))
    traj, metrics = _run(tmp_path, data, TaskConfig(name="python_tool", python_tool=tool))
    assert {"reward/tool_calls/mean", "reward/tool_error/mean", "rollout/turns/mean"} <= set(metrics)
    called = [t for t in traj if t["turns"] > 1]
    assert called, "no episode called the tool"
    for t in called:
        assert t["info"]["tool_calls"] >= 1 and t["rewards"]["tool_error"] == 1.0  # random code fails
        env_text = [i for i, m in zip(t["completion_ids"], t["model_mask"]) if not m]
        assert env_text and t["model_mask"][0] == 1  # tool turns are masked out of the loss
    for t in traj:
        assert set(t["rewards"]) == {"correct", "format", "tool_calls", "tool_error"}


def test_a_tool_that_raises_is_the_samples_not_the_runs(tmp_path, data, monkeypatch, capsys):
    # Every tool call raises (a broken sandbox): those episodes end with zero reward and the error
    # in their trajectory, the step's env_error_frac counts them, the run says so once and goes on.
    import tpurl.tasks.python_tool as python_tool

    def broken(code, *, config):
        raise RuntimeError("sandbox unavailable")

    monkeypatch.setattr(python_tool, "run_python", broken)
    tool = PythonToolConfig(train_file=str(data / "math.jsonl"), num_eval=2, sandbox=SANDBOX, max_new_tokens=96,
                            max_prompt_tokens=96, answer_format="last_number", tool_stop="1",
                            limits=EpisodeLimits(max_turns=3, max_tool_calls=2))
    traj, metrics = _run(tmp_path, data, TaskConfig(name="python_tool", python_tool=tool))
    failed = [t for t in traj if "error" in t["info"]]
    assert failed and all("sandbox unavailable" in t["info"]["error"] and t["reward"] == 0.0 for t in failed)
    assert metrics["rollout/env_error_frac"] == len(failed) / len(traj)
    err = capsys.readouterr().err
    assert err.count("failed in their tool, environment or grader") == 1 and "sandbox unavailable" in err
