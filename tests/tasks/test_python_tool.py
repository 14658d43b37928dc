"""The Python-tool environment: code turns run in the sandbox and their output comes back as a
chat-templated tool turn (stdout, or the error), answers graded by the math grader, limits end the
episode. The dataset and tokenizer are written here."""

import pytest

from helpers import jsonl_task_files, nothing_left_behind  # noqa: F401 (a fixture)
from tpurl.sandbox import SandboxConfig
from tpurl.tasks import EpisodeLimits, PythonToolConfig, PythonToolEnv
from tpurl.tokenizer import load_hf_tokenizer

ROWS = [{"question": f"What is {a} times {b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(3, 7)]
SANDBOX = SandboxConfig(timeout_s=2.0, memory_mb=256, max_processes=8, workers=2)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("pytool")
    jsonl_task_files(d, ROWS, [r["question"] + " print(" + r["answer"] + ")" for r in ROWS], vocab_size=320)
    cfg = PythonToolConfig(train_file=str(d / "train.jsonl"), num_eval=4, answer_format="last_number",
                           sandbox=SANDBOX, limits=EpisodeLimits(max_turns=3, max_tool_calls=2))
    return PythonToolEnv(cfg, tokenizer=load_hf_tokenizer(str(d / "tok")))


pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def _turn(env, episode, text):
    out = episode.observe(env.tokenizer.encode(text), text)
    return None if out is None else env.tokenizer.decode(out, skip_special=False)


def test_code_runs_in_the_sandbox_and_its_output_comes_back_as_a_tool_turn(env):
    p = env.train_problem(0)
    ep = env.start(p)
    obs = _turn(env, ep, f"Let me compute. <python>print({p.answer} - 1 + 1)</python>")
    assert obs == f"<|im_end|>\n<|im_start|>tool\n{p.answer}\n<|im_end|>\n<|im_start|>assistant\n"
    assert _turn(env, ep, f"The answer is {p.answer}.") is None
    r = ep.finish("...", "stop")
    assert r.components == {"correct": 1.0, "format": 1.0, "tool_calls": 1.0, "tool_error": 0.0}
    assert ep.info == {"tool_calls": 1, "tool_errors": 0, "turns": 2}


def test_failing_code_limits_and_a_missing_answer(env):
    p = env.train_problem(1)
    ep = env.start(p)
    assert "ZeroDivisionError" in _turn(env, ep, "<python>1 / 0</python>")
    assert "SyntaxError" in _turn(env, ep, "<python>def (</python>")
    assert _turn(env, ep, "<python>print(1)</python>") is None  # the third turn reaches max_turns
    r = ep.finish("...", "stop")
    assert r.components["correct"] == 0 and r.components["tool_error"] == 1 and r.components["tool_calls"] == 2
    slow = env.start(p)
    assert "timeout" in _turn(env, slow, "<python>while True: pass</python>")
    assert slow.info["tool_errors"] == 1


def test_the_tool_has_no_network_and_sees_no_secrets(env, monkeypatch):
    monkeypatch.setenv("TPURL_TEST_SECRET", "hunter2")
    ep = env.start(env.train_problem(2))
    out = _turn(env, ep, "<python>import os; print(os.environ.get('TPURL_TEST_SECRET'))</python>")
    assert "None" in out and "hunter2" not in out
    net = _turn(env, ep, "<python>import socket; socket.create_connection(('127.0.0.1', 9), 1)</python>")
    assert "Error" in net
