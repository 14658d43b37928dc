"""The JSONL math task: answer extraction and matching, splits, the training stream, chat prompts,
overlong filtering, scoring and its config errors. Data and tokenizer are written here."""

import json

import pytest
import tokenizers

from helpers import CHATML, write_bpe_tokenizer
from tpurl.tasks import AdditionTask, MathConfig, MathTask, TaskConfig, make_task
from tpurl.tasks.math_grading import builtin_match as answers_match
from tpurl.tasks.math_grading import extract_answer, last_boxed
from tpurl.tokenizer import HFTokenizer, load_hf_tokenizer

# GSM8K-shaped rows: a worked solution that ends in "#### <answer>".
ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many now?",
         "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b:,}"} for a in range(3, 30, 2) for b in (4, 900)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("math")
    write_bpe_tokenizer(str(d / "tok"), [r["question"] + r["answer"] for r in ROWS], vocab_size=320,
                        chat_template=CHATML, eos="<|im_end|>")
    with open(d / "train.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # a blank line is skipped
    return d


def _task(files, **changes) -> MathTask:
    cfg = MathConfig(train_file=str(files / "train.jsonl"), reference_format="hash", num_eval=5, **changes)
    return MathTask(cfg, tokenizer=load_hf_tokenizer(str(files / "tok")))


def test_answer_extraction_and_matching():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{a}{b}} done") == r"\frac{a}{b}"
    assert last_boxed(r"cut off \boxed{12") is None and last_boxed("no box") is None
    assert extract_answer("work\n#### 1,234", "hash") == "1,234"
    assert extract_answer("x = 3, then y = -2.5.", "last_number") == "-2.5"
    assert extract_answer("none here", "last_number") is None and extract_answer("a", "hash") is None
    assert answers_match(" $1,234. ", "1234") and answers_match("5.0", "5") and answers_match("0.5", ".5")
    assert not answers_match("12", "13") and not answers_match(None, "1") and not answers_match("1", None)
    assert not answers_match("", "") and not answers_match(" ", "")  # an empty reference grades nothing
    assert answers_match(r"\frac{1}{2}", r"\frac{1}{2}") and not answers_match("x+1", "1+x")


# The grader's normalization, both ways round: (model answer, reference, must they match?).
NORMALIZATION = [
    ("1234", "1234", True), ("1,234", "1234", True), ("$1,234", "1234", True), (" 42 ", "42", True),
    ("42.", "42", True), ("5.0", "5", True), ("0.5", ".5", True), ("-7", "-7", True),
    ("-0.25", "-.25", True), ("18.00", "18", True), ("1,000,000", "1000000", True), ("$ 18 $", "18", True),
    ("-0", "0", True), ("007", "7", True), ("2.50", "2.5", True), ("1000", "1,000.", True),
    ("5$", "5", True), ("3.0000001", "3", True), (r"\frac{1}{2}", r"\frac{1}{2}", True),
    ("10", "10%", True), (r"\frac{1}{2}", "0.5", True), ("1/2", "0.5", True), ("100 apples", "100", True),
    ("12.5%", "12.5", True), ("x = 7", "7", True), (r"1\,000", "1000", True), ("1{,}000", "1000", True),
    ("1,23", "123", False), ("12,34,567", "1234567", False), ("3.001", "3", False), ("99", "99.5", False),
    ("1 000", "1000", False), ("11", "1 1", False), ("-5", "5", False), ("5", "50", False),
    ("0.05", "0.5", False), ("12", "21", False), ("x+1", "1+x", False), ("", "0", False),
]


@pytest.mark.parametrize("got, want, match", NORMALIZATION)
def test_answer_normalization_table(got, want, match):
    assert answers_match(got, want) == match and answers_match(want, got) == match


@pytest.mark.parametrize("got, want", [
    ("100 apples", "10"), ("3/4", "3"), ("3", "3/4"), ("1/2", "1"), ("12.5%", "12"), ("2x", "2"),
    ("10-2", "10"), ("4 or 5", "4"), ("-3", "3"), ("1,234", "1"), ("3.1416", "3.14159"), ("x = 7", "x")])
def test_near_misses_do_not_match(got, want):
    """An answer that only starts (or ends) like the reference is wrong, in either role."""
    assert not answers_match(got, want) and not answers_match(want, got)


@pytest.mark.slow
def test_scoring_rejects_a_boxed_near_miss(files):
    task = _task(files, answer_format="boxed")
    p = task.train_problem(0)
    for near_miss in (f"{p.answer} or 5", f"{p.answer}/2", f"{p.answer}0", f"-{p.answer}", f"{p.answer}x"):
        assert task.score(p, f"\\boxed{{{near_miss}}}", "stop").components == {"correct": 0.0, "format": 1.0}
    assert task.score(p, f"\\boxed{{{p.answer}.}}", "stop").components["correct"] == 1.0


def test_splits_stream_and_prompts(files):
    task = _task(files)
    assert task.describe() == {"train": len(ROWS) - 5, "eval": 5, "dropped_overlong": 0, "dropped_no_answer": 0,
                               "dropped_not_text": 0}
    held = {p.prompt for p in task.eval_problems()}
    stream = [task.train_problem(i) for i in range(3 * (len(ROWS) - 5))]
    assert not held & {p.prompt for p in stream}  # held-out problems are never trained on
    n = len(ROWS) - 5
    assert len({p.uid for p in stream[:n]}) == n  # each epoch is a permutation of the training split
    assert [p.uid for p in stream[:n]] != [p.uid for p in stream[n:2 * n]]  # reshuffled per epoch
    assert [p.uid for p in stream] == [_task(files).train_problem(i).uid for i in range(len(stream))]
    p = task.train_problem(0)
    tok = task.tokenizer
    question = next(r["question"] for r in ROWS if r["question"] in p.prompt)
    want = tok.apply_chat_template([{"role": "user", "content": MathConfig().prompt_template.format(question=question)}])
    assert p.prompt == want and p.prompt.endswith("<|im_start|>assistant\n")
    assert task.encode_prompt(p) == tok.encode(want)  # the template's own tokens, no extra BOS
    assert task.max_prompt_len == max(len(task.encode_prompt(q)) for q in stream[:n] + task.eval_problems())
    row = next(r for r in ROWS if r["question"] == question)
    assert p.answer == row["answer"].rsplit("#### ", 1)[1] and task.demonstration(p, 0) == row["answer"]
    plain = _task(files, chat=False, prompt_template="Q: {question}\nA:")
    q = plain.train_problem(0)
    assert q.prompt.startswith("Q: ") and plain.encode_prompt(q)[0] == tok.bos_id


@pytest.mark.slow
def test_scoring(files):
    task = _task(files, answer_format="boxed", format_weight=0.1)
    p = task.train_problem(0)
    right = task.score(p, f"so the total is \\boxed{{{p.answer}}}", "stop")
    assert right.components == {"correct": 1.0, "format": 1.0} and right.total == pytest.approx(1.1)
    assert task.score(p, r"\boxed{0}", "stop").components == {"correct": 0.0, "format": 1.0}
    assert task.score(p, "no box", "stop").components == {"correct": 0.0, "format": 0.0}
    cut = task.score(p, f"\\boxed{{{p.answer}}}", "length")  # ran out of tokens: no credit
    assert cut.components == {"correct": 0.0, "format": 0.0}


def test_rows_without_a_reference_answer_are_dropped(files, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:8] + [{"question": "q?", "answer": "no marker"}]))
    task = MathTask(MathConfig(train_file=str(data), reference_format="hash", num_eval=2),
                    tokenizer=load_hf_tokenizer(str(files / "tok")))
    assert task.describe()["dropped_no_answer"] == 1 and task.describe()["train"] + task.describe()["eval"] == 8


def test_overlong_prompts_are_dropped(files):
    lengths = sorted(len(_task(files).encode_prompt(p)) for p in _task(files).eval_problems())
    task = _task(files, max_prompt_tokens=lengths[0], eval_file=str(files / "train.jsonl"))
    kept = task.describe()
    assert 0 < kept["dropped_overlong"] and kept["train"] + kept["eval"] + kept["dropped_overlong"] == 2 * len(ROWS)
    assert task.max_prompt_len <= lengths[0]


def test_config_errors(files, tmp_path):
    with pytest.raises(ValueError, match="answer_format"):
        MathConfig(answer_format="latex")
    with pytest.raises(ValueError, match="no {question} field"):
        MathConfig(prompt_template="Solve it")
    with pytest.raises(ValueError, match="needs MathConfig.train_file"):
        make_task(TaskConfig(name="math"))
    with pytest.raises(ValueError, match="needs a subword tokenizer"):
        make_task(TaskConfig(name="math", math=MathConfig(train_file=str(files / "train.jsonl"))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no \['question', 'answer'\] field"):
        MathTask(MathConfig(train_file=str(bad)), tokenizer=load_hf_tokenizer(str(files / "tok")))
    with pytest.raises(ValueError, match="num_eval=5 leaves no training problems"):
        MathTask(MathConfig(train_file=str(bad), num_eval=5, question_key="problem", answer_key="solution"),
                 tokenizer=load_hf_tokenizer(str(files / "tok")))
    no_eos = HFTokenizer(tokenizers.Tokenizer.from_file(str(files / "tok" / "tokenizer.json")), chat_template=CHATML)
    with pytest.raises(ValueError, match="MathTask: the tokenizer has no eos_token"):
        MathTask(MathConfig(train_file=str(files / "train.jsonl")), tokenizer=no_eos)
    with pytest.raises(ValueError, match="AdditionTask: the tokenizer has no eos_token"):
        AdditionTask(tokenizer=no_eos)
    no_template = tmp_path / "plain_tok"
    write_bpe_tokenizer(str(no_template), ["abc"], vocab_size=270)
    with pytest.raises(ValueError, match="no chat template"):
        MathTask(MathConfig(train_file=str(files / "train.jsonl")), tokenizer=load_hf_tokenizer(str(no_template)))


@pytest.mark.slow
def test_graders_in_the_task(files):
    """math-verify (the default when installed) scores by value where the builtin cannot, in a batch
    as one by one; the grader in force names itself for the manifest."""
    mv, builtin = _task(files, answer_format="boxed"), _task(files, answer_format="boxed", grader="builtin")
    assert mv.grader.startswith("math-verify-") and builtin.grader == "builtin-v2"
    problems = [mv.train_problem(i) for i in range(4)]
    roots = [f"\\boxed{{\\sqrt{{{int(p.answer.replace(',', '')) ** 2}}}}}" for p in problems]
    completions = roots + [f"\\boxed{{{p.answer}}} or \\boxed{{1}}" for p in problems]
    batch = mv.score_batch(problems * 2, completions, ["stop"] * 8)
    assert batch == [mv.score(p, c, "stop") for p, c in zip(problems * 2, completions)]
    assert [r.components["correct"] for r in batch] == [1.0] * 4 + [0.0] * 4
    assert [r.components["correct"] for r in builtin.score_batch(problems * 2, completions, ["stop"] * 8)] == [0.0] * 8
    with pytest.raises(ValueError, match="MathConfig.grader='sympy'; use one of"):
        MathConfig(grader="sympy")
    with pytest.raises(ValueError, match="MathConfig.grade_timeout_s=0; use a positive"):
        MathConfig(grade_timeout_s=0)
    with pytest.raises(ValueError, match="MathConfig.grade_timeout_s=1e\+300; use a positive number of seconds, at most 600"):
        MathConfig(grade_timeout_s=1e300)
