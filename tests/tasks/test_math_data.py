"""What the math task does with bad data: dropped rows counted per reason and reported (and
printed by `tpurl train`), null fields never trained on as "None", and unreadable lines named by
file and line."""

import json
import os

import pytest

from helpers import CHATML, write_bpe_tokenizer
from tpurl.commands import main as cli
from tpurl.tasks import MathConfig, MathTask
from tpurl.tokenizer import load_hf_tokenizer

GOOD = [{"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(10)]
GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_bpe_tokenizer(str(d), [r["question"] + r["answer"] for r in GOOD] + ["None"], vocab_size=300,
                        chat_template=CHATML, eos="<|im_end|>")
    return str(d)


def _write(path, rows):
    path.write_bytes(b"".join(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode() for r in rows))
    return str(path)


def _task(train, tok, **kw):
    return MathTask(MathConfig(train_file=train, reference_format="hash", num_eval=1, **kw),
                    tokenizer=load_hf_tokenizer(tok))


def test_dropped_rows_are_reported_per_reason(tmp_path, tok):
    no_answer = [{"question": f"q{i}?", "answer": "no marker"} for i in range(7)]
    nulls = [{"question": None, "answer": "#### 3"}, {"question": "q?", "answer": None}, {"question": ["x"], "answer": "#### 1"}]
    train = _write(tmp_path / "train.jsonl", GOOD[:2] + no_answer + nulls + GOOD[2:5])  # 10 of 15 dropped
    task = _task(train, tok)
    assert task.data_report() == [
        f"math task: dropped 10 of the 15 rows of {train}: 7 with no reference answer that "
        "MathConfig.reference_format='hash' can extract, 3 with a null or non-text question or answer"]
    assert task.describe() == {"train": 4, "eval": 1, "dropped_overlong": 0, "dropped_no_answer": 7,
                               "dropped_not_text": 3}
    prompts = [task.train_problem(i).prompt for i in range(8)] + [p.prompt for p in task.eval_problems()]
    assert not any("None" in p or "['x']" in p for p in prompts)  # a null is never trained on as text
    assert task.data_files == (train,)


def test_numbers_are_text(tmp_path, tok):
    task = _task(_write(tmp_path / "t.jsonl", GOOD[:3] + [{"question": 12, "answer": "#### 24"}]), tok)
    assert task.data_report() == [] and task.describe()["train"] + task.describe()["eval"] == 4


def test_every_row_dropped_names_the_reasons(tmp_path, tok):
    train = _write(tmp_path / "t.jsonl", [{"question": f"q{i}?", "answer": "#### "} for i in range(5)])
    with pytest.raises(ValueError) as e:
        _task(train, tok)
    msg = str(e.value)
    assert "reference_format='hash'" in msg and "max_prompt_tokens" not in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"5 with a prompt longer than MathConfig.max_prompt_tokens=2$"):
        _task(_write(tmp_path / "u.jsonl", GOOD[:6]), tok, max_prompt_tokens=2)
    with pytest.raises(ValueError, match=r"holds no problems: all 2 rows have a null"):
        _task(_write(tmp_path / "v.jsonl", [{"question": None, "answer": None}] * 2), tok)


@pytest.mark.parametrize("line, match", [
    (b"[1, 2]\n", r"t.jsonl:3 is a JSON list, not an object with 'question' and 'answer' fields"),
    (b'"question answer"\n', r"t.jsonl:3 is a JSON str, not an object"),
    (b'{"question": "caf\xe9?", "answer": "#### 1"}\n', r"t.jsonl:3 is not valid UTF-8 \(invalid continuation byte"),
    (b"{oops\n", r"t.jsonl:3 is not valid JSON"),
])
def test_unreadable_lines_name_file_and_line(tmp_path, tok, line, match):
    train = _write(tmp_path / "t.jsonl", GOOD[:2] + [line] + GOOD[2:])
    with pytest.raises(ValueError, match=match) as e:
        _task(train, tok)
    assert "\n" not in str(e.value)


def test_train_prints_the_report(tmp_path, tok, monkeypatch, capsys):
    train = _write(tmp_path / "train.jsonl", GOOD + [{"question": "q?", "answer": None}] * 2)

    def stop(*args, **kwargs):
        raise ValueError("stopped before training")

    monkeypatch.setattr("tpurl.rl.loop.run", stop)
    rc = cli.main(["train", "--quiet", "--gin_file", GIN, "--gin_param", "tpurl.TaskConfig.name='math'",
                   "--gin_param", f"tpurl.TaskConfig.tokenizer='{tok}'",
                   "--gin_param", "tpurl.TaskConfig.math=@tpurl.MathConfig()",
                   "--gin_param", f"tpurl.MathConfig.train_file='{train}'",
                   "--gin_param", "tpurl.MathConfig.reference_format='hash'",
                   "--gin_param", "tpurl.MathConfig.num_eval=2", "--gin_param", "tpurl.MathConfig.max_new_tokens=8",
                   "--gin_param", f"tpurl.LoggingConfig.run_dir='{tmp_path / 'run'}'"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err == [
        f"[tpurl] math task: dropped 2 of the 12 rows of {train}: 2 with a null or non-text question or answer",
        "tpurl train: stopped before training"]
