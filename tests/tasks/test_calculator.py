"""The calculator environment: tool calls answered by observation tokens, explicit termination,
graded answers, imperfect teacher traces whose tool results are not trained on."""

import pytest

from tpurl.tasks import EpisodeLimits
from tpurl.rl.batch import sft_batch
from tpurl.tasks import CalculatorConfig, CalculatorEnv


@pytest.fixture(scope="module")
def env():
    return CalculatorEnv(CalculatorConfig(limits=EpisodeLimits(max_turns=3, max_tool_calls=2)))


def _turn(env, episode, text):
    ids = env.tokenizer.encode(text)
    out = episode.observe(ids, text)
    return None if out is None else env.tokenizer.decode(out)


def test_tool_calls_results_and_the_graded_answer(env):
    p = env.make_problem(47, 86)
    ep = env.start(p)
    assert _turn(env, ep, "[47*86]") == "4042|"
    assert _turn(env, ep, "4042") is None  # an answer ends the episode
    r = ep.finish("[47*86]4042|4042", "stop")
    assert r.components == {"correct": 1.0, "format": 1.0, "tool_calls": 1.0, "tool_error": 0.0} and r.total == 1.1
    assert ep.info == {"tool_calls": 1, "tool_errors": 0, "turns": 2}

    wrong = env.start(p)
    assert _turn(env, wrong, "[47*8*]") == "?|"  # malformed call
    assert _turn(env, wrong, "4000") is None
    r = wrong.finish("...", "stop")
    assert r.components["correct"] == 0 and r.components["tool_error"] == 1 and r.components["format"] == 1


def test_termination_by_limits_and_budget(env):
    p = env.make_problem(12, 34)
    ep = env.start(p)
    assert _turn(env, ep, "[12*34]") == "408|" and _turn(env, ep, "[1*1]") == "1|"
    assert _turn(env, ep, "[2*2]") is None  # the third turn reaches max_turns: over, unanswered
    assert ep.finish("", "stop").components["correct"] == 0
    out_of_budget = env.start(p)
    assert _turn(env, out_of_budget, "[12*34]") == "408|"
    assert out_of_budget.finish("", "length").total == 0  # the budget ran out before an answer


def test_splits_are_disjoint_and_demonstrations_mask_the_tool_result(env):
    held_out = {p.uid for p in env.eval_problems()}
    assert len(held_out) == 200 and not held_out & {env.train_problem(i).uid for i in range(2000)}
    problems = [env.train_problem(i) for i in range(64)]
    batch = sft_batch(env, problems, env.max_prompt_len + env.max_new_tokens, 0)
    calls = 0
    for b, p in enumerate(problems):
        demo = env.demonstration(p, b)
        text = "".join(t for t, _ in demo)
        trained = "".join(t for t, own in demo if own)
        ids, mask = batch["tokens"][b], batch["loss_mask"][b]
        n = int(batch["valid"][b].sum())
        assert env.tokenizer.decode(ids[len(env.encode_prompt(p)):n - 1]) == text
        assert env.tokenizer.decode(ids[:n][mask[:n] > 0][:-1]) == trained  # the tool result is not trained on
        calls += len(demo) > 1
        if len(demo) == 1:
            assert demo[0][0] != p.answer  # the teacher's estimate is wrong
    assert 0.15 < calls / 64 < 0.5  # teacher_tool_rate 0.3
