"""The calculator in a chat format (`CalculatorConfig.chat`): what the warm start teaches is, token
for token, what the endpoint renders from an agent's OpenAI messages, so a function-calling
agent's calls continue one sequence; a call the model writes parses into OpenAI's tool call."""

import json

import numpy as np
import pytest

from tpurl.serve.protocol import Message, message_dicts
from tpurl.serve.tool_calls import parse
from tpurl.tasks.calculator import CalculatorConfig, CalculatorEnv


@pytest.fixture(scope="module")
def env():
    return CalculatorEnv(CalculatorConfig(chat=True, teacher_tool_rate=0.5))


def _demo_ids(env, problem, index):
    ids = list(env.encode_prompt(problem))
    for text, _ in env.demonstration(problem, index):
        ids += env.tokenizer.encode(text)
    return ids + [env.tokenizer.eos_id]


def _called(env):
    """(index, problem) of a training problem whose demonstration calls the tool."""
    return next((i, env.train_problem(i)) for i in range(100) if len(env.demonstration(env.train_problem(i), i)) > 1)


def test_a_demonstration_is_what_the_agents_messages_render_to(env):
    index, problem = _called(env)
    tok = env.tokenizer
    call_ids = tok.encode(env.demonstration(problem, index)[0][0])
    content, calls = parse(tok.decode(call_ids))  # the endpoint's reading of the model's call
    assert content is None and [c.name for c in calls] == ["multiply"]
    a, b = (int(x) for x in problem.prompt[:-1].split("*"))
    assert json.loads(calls[0].arguments) == {"a": a, "b": b}
    # The messages as an OpenAI client sends them (arguments a JSON string), read as the endpoint does.
    messages = message_dicts([Message.model_validate(m) for m in (
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "tool_calls": [calls[0].to_openai()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": str(a * b)},
        {"role": "assistant", "content": problem.answer})])
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    assert rendered == _demo_ids(env, problem, index)
    # The second call's prompt extends the first's prompt and the call the model sampled.
    second = tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=True)
    first = list(env.encode_prompt(problem)) + call_ids
    assert second[:len(first)] == first and len(first) <= env.max_prompt_len + len(call_ids)


def test_the_budget_holds_two_calls_and_the_answer(env):
    index, problem = _called(env)
    tok = env.tokenizer
    call, result, answer = env.demonstration(problem, index)
    one = len(tok.encode(call[0])) + len(tok.encode(result[0]))
    assert 2 * one + len(tok.encode(answer[0])) + 1 <= env.cfg.max_new_tokens
    assert len(env.encode_prompt(problem)) <= env.max_prompt_len
    # Demonstrations without a call are the answer alone; the bracket format is untouched.
    plain = CalculatorEnv(CalculatorConfig(teacher_tool_rate=0.5))
    assert plain.demonstration(problem, index)[0][0] == f"[{problem.prompt[:-1]}]"
    guesses = [i for i in range(40) if len(env.demonstration(env.train_problem(i), i)) == 1]
    assert guesses and all(env.demonstration(env.train_problem(i), i) == plain.demonstration(plain.train_problem(i), i)
                           for i in guesses)


def test_the_environment_path_refuses_the_chat_format(env):
    with pytest.raises(ValueError, match="chat=True is the calculator for agents"):
        env.start(env.train_problem(0))
    assert np.all(np.asarray(env.encode_prompt(env.train_problem(0))) < env.tokenizer.vocab_size)


def test_a_character_outside_the_alphabet_is_a_question_mark(env):
    tok = env.tokenizer
    assert tok.encode("4{2'") == tok.encode("4?2?")  # never dropped: a rendering that drifts shows
