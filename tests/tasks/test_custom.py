"""Your reward, your task, your data: a reward function and a task class by import path (written
here to a temporary module on sys.path), and Hugging Face datasets read into the math task."""

import json
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import CHATML, write_bpe_tokenizer
from tpurl.tasks import AgentConfig, CustomConfig, CustomTask, MathConfig, MathTask, TaskConfig, make_task, user_code
from tpurl.tasks.base import Problem
from tpurl.tasks.reward_fn import RewardFunction
from tpurl.tokenizer import load_hf_tokenizer

USER_MODULE = '''
import asyncio, math, time

def exact(prompt, completion, row):
    return {"correct": float(completion.strip() == row["answer"]), "length": float(len(completion))}

def number(prompt, completion, row):
    return 0.5

async def later(prompt, completion, row):
    await asyncio.sleep(0.01)
    return float(completion == row["answer"])

def batched(prompts, completions, rows):
    return [float(c == r["answer"]) for c, r in zip(completions, rows)]

def moody(prompt, completion, row):
    if row["kind"] == "raise":
        raise KeyError("no such column")
    if row["kind"] == "hang":
        time.sleep(3600)
    if row["kind"] == "nan":
        return math.nan
    return 1.0

def wrong_keys(prompt, completion, row):
    return {"correctness": 1.0}

class Reverse:
    """A task of the user's own: reverse three letters."""
    import dataclasses as _dc

    @_dc.dataclass(frozen=True)
    class Config:
        letters: int = 3
        num_eval: int = 4
        max_new_tokens: int = 5

    name, version, grader = "reverse", "reverse-v1", "exact"
    reward_components = ("correct",)
    stop_strings = ()

    def __init__(self, config, *, tokenizer):
        from tpurl.tokenizer import CharTokenizer
        self.cfg, self.tokenizer = config, tokenizer or CharTokenizer("abcdef>")
        self.max_new_tokens, self.max_prompt_len = config.max_new_tokens, config.letters + 2

    def _problem(self, i):
        from tpurl.tasks import Problem
        word = "".join("abcdef"[(i * 7 + j * 3) % 6] for j in range(self.cfg.letters))
        return Problem(uid=str(i), prompt=word + ">", answer=word[::-1])

    def encode_prompt(self, problem):
        return self.tokenizer.encode(problem.prompt, add_bos=True)

    def train_problem(self, index):
        return self._problem(self.cfg.num_eval + index % 20)

    def eval_problems(self):
        return [self._problem(i) for i in range(self.cfg.num_eval)]

    def demonstration(self, problem, index):
        return problem.answer

    def score(self, problem, completion, finish_reason):
        from tpurl.tasks import Reward
        ok = float(finish_reason == "stop" and completion == problem.answer)
        return Reward(components={"correct": ok}, total=ok)

    def data_report(self):
        return []

    data_files = ()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_rewards_{int(time.time() * 1e6)}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def call(module, fn, rows, completions, names=("reward",), **kw):
    f = RewardFunction(f"{module}:{fn}", names, batched=kw.pop("batched", False), timeout_s=kw.pop("timeout_s", 5.0),
                       workers=kw.pop("workers", 4))
    return f([f"p{i}" for i in range(len(rows))], completions, rows)


def test_sync_async_and_batched_functions_agree(user_module):
    rows = [{"answer": "12"}, {"answer": "7"}, {"answer": "3"}]
    completions = ["12", "8", "3"]
    want = [{"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0}]
    for fn, kw in (("later", {}), ("batched", {"batched": True})):
        assert [s.components for s in call(user_module, fn, rows, completions, **kw)] == want
    got = call(user_module, "exact", rows, completions, names=("correct", "length"))
    assert [s.components for s in got] == [{"correct": 1.0, "length": 2.0}, {"correct": 0.0, "length": 1.0},
                                           {"correct": 1.0, "length": 1.0}]
    assert all(s.error is None for s in got)


def test_raising_hanging_and_nan_are_that_samples_zero_with_the_error(user_module):
    rows = [{"kind": k} for k in ("ok", "raise", "hang", "nan", "ok")]
    start = time.monotonic()
    got = call(user_module, "moody", rows, ["x"] * 5, timeout_s=0.5)
    assert time.monotonic() - start < 5  # the hung call is left behind, not waited for
    assert [s.components for s in got] == [{"reward": 1.0}, None, None, None, {"reward": 1.0}]
    errors = [s.error for s in got]
    assert errors[1] == f"{user_module}:moody raised KeyError: 'no such column'"
    assert errors[2] == f"{user_module}:moody timed out after 0.5 s"
    assert errors[3] == f"{user_module}:moody returned reward=nan, not a finite number"
    wrong = call(user_module, "wrong_keys", rows[:1], ["x"], names=("correct",))
    assert wrong[0].error == f"{user_module}:wrong_keys returned components ['correctness']; " \
                             "CustomConfig.reward_weights names ['correct']"


def test_a_function_that_keeps_hanging_gets_no_more_work(user_module):
    f = RewardFunction(f"{user_module}:moody", ("reward",), batched=False, timeout_s=0.1, workers=1)
    for _ in range(4):
        f(["p"], ["x"], [{"kind": "hang"}])
    (last,) = f(["p"], ["x"], [{"kind": "ok"}])
    assert last.components is None and "4 calls" in last.error and "still running" in last.error


def test_bad_import_paths_are_one_line(user_module):
    with pytest.raises(ValueError, match=r"cannot import 'no_such_pkg.rewards' \(no module named 'no_such_pkg'\); install"):
        RewardFunction("no_such_pkg.rewards:score", ("reward",), batched=False, timeout_s=1, workers=1)
    with pytest.raises(ValueError, match=f"'{user_module}' has no attribute 'nothing'"):
        RewardFunction(f"{user_module}:nothing", ("reward",), batched=False, timeout_s=1, workers=1)
    with pytest.raises(ValueError, match="is not an import path; write 'package.module:function'"):
        CustomConfig(reward_fn="score")
    with pytest.raises(ValueError, match=r"AgentConfig.processes=-1: need 0 \(agents in the trainer's process\)"):
        AgentConfig(agent="my.agents:solve", processes=-1)
    with pytest.raises(ValueError, match=r"not a known task; use one of .* or the import path of your own task"):
        TaskConfig(name="reverse")
    with pytest.raises(ValueError, match=f"TaskConfig.name='{user_module}:exact' is a function; name a task class"):
        TaskConfig(name=f"{user_module}:exact")
    with pytest.raises(ValueError, match=r"TaskConfig.options=\{'colour': 1\} for .*unexpected keyword"):
        TaskConfig(name=f"{user_module}:Reverse", options={"colour": 1})
    with pytest.raises(ValueError, match="TaskConfig.options are for a task class named by import path"):
        TaskConfig(name="addition", options={"digits": 2})


def test_a_task_class_by_import_path(user_module):
    cfg = TaskConfig(name=f"{user_module}:Reverse", options={"letters": 4})
    task = make_task(cfg)
    assert type(task).__name__ == "Reverse" and task.cfg.letters == 4 and cfg.max_new_tokens == 5
    p = task.eval_problems()[0]
    assert task.score(p, p.answer, "stop").total == 1.0
    (path, source), = user_code(cfg).items()
    assert path == f"{user_module}:Reverse" and source.endswith(f"{user_module}.py")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_bpe_tokenizer(str(d), [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], vocab_size=300,
                        chat_template=CHATML, eos="<|im_end|>")
    return load_hf_tokenizer(str(d))


ROWS = [{"question": f"{a}+{b}", "answer": str(a + b), "kind": "ok"} for a in range(6) for b in range(4)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_custom_task_scores_with_the_users_function(tmp_path, tok, user_module):
    cfg = CustomConfig(train_file=_jsonl(tmp_path / "t.jsonl", ROWS), prompt_template="{question}=",
                       answer_key="answer", reward_fn=f"{user_module}:exact",
                       reward_weights={"correct": 1.0, "length": 0.1}, num_eval=4)
    task = CustomTask(cfg, tokenizer=tok)
    assert task.reward_components == ("correct", "length") and task.grader == f"{user_module}:exact"
    problems = [task.train_problem(i) for i in range(3)]
    assert problems[0].prompt.startswith("<|im_start|>user\n") and "=" in problems[0].prompt
    rewards = task.score_batch(problems, [problems[0].answer, "x", problems[2].answer], ["stop", "stop", "length"])
    assert rewards[0].components == {"correct": 1.0, "length": float(len(problems[0].answer))}
    assert rewards[0].total == pytest.approx(1.0 + 0.1 * len(problems[0].answer))
    assert rewards[1].components == {"correct": 0.0, "length": 1.0}
    assert rewards[2].components == {"correct": 0.0, "length": 0.0}  # cut off: not scored
    assert task.demonstration(problems[0], 0) == problems[0].answer
    with pytest.raises(ValueError, match=r"n.jsonl:1 has no \['question'\] field \(has \['q'\]\); set CustomConfig.prompt_template"):
        CustomTask(CustomConfig(train_file=_jsonl(tmp_path / "n.jsonl", [{"q": "1"}] * 5), reward_fn=cfg.reward_fn,
                                prompt_template="{question}", num_eval=1), tokenizer=tok)


def test_templates_that_cannot_be_filled_are_one_line():
    with pytest.raises(ValueError, match=r"names \{topic\}, which the task does not fill: it fills \{question\} only"):
        MathConfig(prompt_template="{question} about {topic}")
    with pytest.raises(ValueError, match="is not a format string"):
        MathConfig(prompt_template="{question} {")
    with pytest.raises(ValueError, match="has a positional field"):
        CustomConfig(prompt_template="{} {question}")


def _math(tok, **kw):
    return MathTask(MathConfig(reference_format="raw", **kw), tokenizer=tok)


def _problems(task):
    return [(p.prompt, p.answer) for p in task.eval_problems()], [
        (task.train_problem(i).prompt, task.train_problem(i).answer) for i in range(20)]


def test_saved_datasets_parquet_and_arrow_give_the_jsonl_problems(tmp_path, tok):
    import datasets

    train, test = ROWS[:20], ROWS[20:]
    want = _problems(_math(tok, train_file=_jsonl(tmp_path / "train.jsonl", train),
                           eval_file=_jsonl(tmp_path / "test.jsonl", test)))
    saved = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(saved)
    assert _problems(_math(tok, train_file=saved, eval_split="test")) == want
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(test).to_parquet(str(tmp_path / "test.parquet"))
    assert _problems(_math(tok, train_file=str(tmp_path / "train.parquet"),
                           eval_file=str(tmp_path / "test.parquet"))) == want
    arrow = datasets.Dataset.from_list(train)
    arrow.save_to_disk(str(tmp_path / "one"))
    (arrow_file,) = sorted((tmp_path / "one").glob("*.arrow"))
    assert _problems(_math(tok, train_file=str(arrow_file), eval_file=str(tmp_path / "test.parquet"))) == want
    # Columns by another name: the task's key fields map them.
    for name, rows in (("renamed", train), ("renamed_test", test)):
        renamed = [{"problem": r["question"], "solution": r["answer"]} for r in rows]
        datasets.Dataset.from_list(renamed).to_parquet(str(tmp_path / f"{name}.parquet"))
    task = _math(tok, train_file=str(tmp_path / "renamed.parquet"), eval_file=str(tmp_path / "renamed_test.parquet"),
                 question_key="problem", answer_key="solution")
    assert _problems(task) == want


def test_dataset_errors_are_one_line(tmp_path, tok, monkeypatch):
    import datasets

    saved = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:20]),
                          "test": datasets.Dataset.from_list(ROWS[20:])}).save_to_disk(saved)
    with pytest.raises(ValueError, match=r"MathConfig.eval_split='validation': .* has the splits \['test', 'train'\]"):
        _math(tok, train_file=saved, eval_split="validation")
    with pytest.raises(FileNotFoundError, match="openai/gsm8k does not exist; tpurl reads local files only .*"
                                                "save_to_disk"):
        _math(tok, train_file="openai/gsm8k")
    jsonl = _jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match="eval_split='test' names a split, but .* is one file without splits"):
        _math(tok, train_file=jsonl, eval_split="test")
    with pytest.raises(ValueError, match=r"has no \['q'\] column .*; set MathConfig.question_key"):
        _math(tok, train_file=saved, eval_split="test", question_key="q")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the datasets library; pip install 'tpurl\[datasets\]'"):
        _math(tok, train_file=saved, eval_split="test")
