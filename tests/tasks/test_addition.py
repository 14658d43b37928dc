"""The addition task: disjoint deterministic splits, answers, every reward component."""

import pytest

from tpurl.tasks import AdditionConfig, AdditionTask, TaskConfig, make_task, train_batch


def _operands(problem):
    a, b = problem.prompt[:-1].split("+")
    return int(a), int(b)


def test_splits_are_disjoint_and_deterministic():
    cfg = AdditionConfig(digits=2, num_eval=300, seed=5)
    task, again = AdditionTask(cfg), AdditionTask(cfg)
    held_out = {p.uid for p in task.eval_problems()}
    assert len(held_out) == 300  # distinct
    train = [task.train_problem(i) for i in range(3000)]
    assert not held_out & {p.uid for p in train}
    assert [p.uid for p in again.eval_problems()] == [p.uid for p in task.eval_problems()]
    assert [again.train_problem(i).uid for i in (0, 17, 2999)] == [train[i].uid for i in (0, 17, 2999)]
    # A different seed gives different problems (the stream is not a constant).
    other = AdditionTask(AdditionConfig(digits=2, num_eval=300, seed=6))
    assert [other.train_problem(i).uid for i in range(20)] != [p.uid for p in train[:20]]
    # The cursor API walks the same stream.
    batch, cursor = train_batch(task, 10, 4)
    assert cursor == 14 and [p.uid for p in batch] == [p.uid for p in train[10:14]]


@pytest.mark.parametrize("reverse", [False, True])
def test_answers_and_prompt_format(reverse):
    task = AdditionTask(AdditionConfig(digits=3, reverse_answer=reverse))
    for i in range(200):
        p = task.train_problem(i)
        a, b = _operands(p)
        assert 0 <= a < 1000 and 0 <= b < 1000
        expected = str(a + b)
        assert p.answer == (expected[::-1] if reverse else expected)
        ids = task.tokenizer.encode(p.prompt, add_bos=True)
        assert len(ids) <= task.max_prompt_len
        assert task.tokenizer.decode(ids) == p.prompt
    assert task.max_new_tokens >= 3 + 1 + 1  # longest answer + eos


def test_padded_operands_have_fixed_positions():
    task = AdditionTask(AdditionConfig(digits=2, pad_operands=True, reverse_answer=True))
    p = task.make_problem(7, 45)
    assert (p.prompt, p.answer) == ("07+45=", "250")
    for i in range(50):
        q = task.train_problem(i)
        a, b = _operands(q)
        assert len(q.prompt) == 6 and len(q.answer) == 3 and int(q.answer[::-1]) == a + b


def test_reward_components():
    task = AdditionTask(AdditionConfig(digits=2, correct_weight=1.0, format_weight=0.25, digits_weight=0.5))
    p = task.make_problem(57, 8)
    assert p.prompt == "57+8=" and p.answer == "65"
    cases = {  # (completion, finish) -> (correct, format, digits)
        ("65", "stop"): (1.0, 1.0, 1.0),
        ("66", "stop"): (0.0, 1.0, 0.5),
        ("6+5", "stop"): (0.0, 0.0, 1 / 3),
        ("", "stop"): (0.0, 0.0, 0.0),
        ("65", "length"): (0.0, 0.0, 0.0),  # never terminated
        ("065", "stop"): (0.0, 1.0, 0.0),
        ("6", "stop"): (0.0, 1.0, 0.5),
    }
    for (text, finish), (correct, fmt, digits) in cases.items():
        r = task.score(p, text, finish)
        assert dict(r.components) == pytest.approx({"correct": correct, "format": fmt, "digits": digits}), text
        assert r.total == pytest.approx(correct + 0.25 * fmt + 0.5 * digits)
    with pytest.raises(ValueError, match="finish_reason"):
        task.score(p, "65", "eos")


def test_bad_configs_one_line_errors():
    for kwargs, field in [(dict(digits=0), "digits"), (dict(digits=1, num_eval=30), "num_eval"),
                          (dict(format_weight=-1.0), "weights"), (dict(extra_new_tokens=0), "extra_new_tokens")]:
        with pytest.raises(ValueError, match=field) as e:
            AdditionConfig(**kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a known task"):
        TaskConfig(name="chess")
    assert isinstance(make_task(TaskConfig()), AdditionTask)


def test_sloppy_teacher_drops_the_overflow_digit_only_in_demonstrations():
    task = AdditionTask(AdditionConfig(digits=2, teacher_overflow_error=0.5, seed=3))
    p = task.make_problem(57, 68)
    assert {task.demonstration(p, i) for i in range(40)} == {"125", "25"}
    assert {task.demonstration(task.make_problem(57, 8), i) for i in range(40)} == {"65"}  # no overflow
    overflowing = [i for i in range(400) if sum(map(int, task.train_problem(i).prompt[:-1].split("+"))) >= 100]
    flawed = [i for i in range(400) if task.demonstration(task.train_problem(i), i) != task.train_problem(i).answer]
    assert set(flawed) <= set(overflowing) and 0.35 < len(flawed) / len(overflowing) < 0.65
    assert task.score(p, "25", "stop").components["correct"] == 0.0  # graders use the true answer
    rev = AdditionTask(AdditionConfig(digits=2, teacher_overflow_error=1.0, pad_operands=True, reverse_answer=True))
    assert rev.demonstration(rev.make_problem(57, 68), 0) == "52"  # 125 reversed is 521
    assert rev.demonstration(rev.make_problem(7, 8), 0) == "510"
    clean = AdditionTask(AdditionConfig(digits=2))
    assert all(clean.demonstration(clean.train_problem(i), i) == clean.train_problem(i).answer for i in range(50))
