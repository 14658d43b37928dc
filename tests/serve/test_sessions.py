"""Joining a session's calls into training sequences, and which one an agent episode trains;
the chat history an agent sends back, as its template reads it."""

import numpy as np

from tpurl.generate import Completion
from tpurl.serve.protocol import Message, message_dicts
from tpurl.serve.sessions import Call, sequences
from tpurl.tasks import AgentConfig, Problem
from tpurl.tasks.agent import AgentTask, agent_rollouts


def _completion(ids, version=1):
    return Completion(prompt_ids=np.zeros(1, np.int32), token_ids=np.asarray(ids, np.int32),
                      logprobs=-np.arange(1, len(ids) + 1, dtype=np.float32) / 10, finish_reason="stop",
                      prompt_index=0, sample_index=0, versions=np.full(len(ids), version, np.int32))


def _call(prompt, *choices):
    return Call(request={}, prompt_ids=list(prompt), completions=[_completion(c) for c in choices],
                texts=[""] * len(choices), tool_calls=[[]] * len(choices))


def test_a_continuing_call_joins_and_a_branch_starts_its_own():
    calls = [_call([1, 2], [3, 4]),            # A
             _call([1, 2, 3, 4, 9], [5], [6]),  # choice 0 continues A; choice 1 branches (B)
             _call([1, 2, 3, 4, 9, 5, 8], [7]),  # continues A
             _call([1, 7], [2])]                # starts C: its prompt extends nothing
    a, b, c = sequences(calls)
    assert a.prompt == [1, 2] and a.tokens == [3, 4, 9, 5, 8, 7] and a.calls == [0, 1, 2]
    assert a.mask == [True, True, False, True, False, True] and a.versions == [1, 1, -1, 1, -1, 1]
    np.testing.assert_allclose(a.logprobs, [-.1, -.2, 0, -.1, 0, -.1], rtol=1e-6)
    assert b.prompt == [1, 2, 3, 4, 9] and b.tokens == [6] and c.prompt == [1, 7] and c.tokens == [2]


class _Source:
    name, version = "src", "v0"

    def encode_prompt(self, problem):
        return [1, 2]


def _episode(calls, reward):
    from tpurl.serve.agents import AgentEpisode
    return AgentEpisode(session="p0s0", reward=reward, calls=calls)


def test_the_trained_sequence_holds_the_last_call_and_bad_rewards_train_nothing(monkeypatch):
    monkeypatch.setattr("tpurl.tasks.agent.import_object", lambda path, what: (lambda c, p: None))
    task = AgentTask(AgentConfig(agent="x.y:z", reward_weights={"correct": 1.0}), _Source())
    branch_then_continue = [_call([1, 2], [3]), _call([1, 2, 3], [4], [5]), _call([1, 2, 3, 4], [6])]
    problem = Problem(uid="u", prompt="p", answer="a")
    (rows,), _, _ = agent_rollouts(task, [problem], [[_episode(branch_then_continue, {"correct": 1.0})]])
    assert rows[0].token_ids.tolist() == [3, 4, 6]  # not the branch [5], created last
    (rows,), (outcomes,), _ = agent_rollouts(task, [problem], [[_episode(branch_then_continue, {"corect": 1.0})]])
    assert rows[0].token_ids.tolist() == [] and "does not" in outcomes[0].finish("", "stop").error


def test_several_trained_sequences_are_rows_latest_first(monkeypatch):
    """`AgentConfig.trained_sequences` = 3: the episode's sequences are its rows, the one holding
    its last call first, then the others by their last call; rows it has no sequence for hold no
    token, and a failed episode's first row holds its prompt. Shared as a multi-process run
    shares them (a JSON round trip), every row keeps its episode's sample index."""
    import json

    monkeypatch.setattr("tpurl.tasks.agent.import_object", lambda path, what: (lambda c, p: None))
    task = AgentTask(AgentConfig(agent="x.y:z", reward_weights={"correct": 1.0}, trained_sequences=3), _Source())
    branch_then_continue = [_call([1, 2], [3]), _call([1, 2, 3], [4], [5]), _call([1, 2, 3, 4], [6])]
    problem = Problem(uid="u", prompt="p", answer="a")
    episodes = [[_episode(branch_then_continue, {"correct": 1.0}), _episode(branch_then_continue, {"x": 1.0})]]
    for on_writer in (None, lambda fn: json.loads(json.dumps(fn()))):
        (rows,), (outcomes,), (infos,) = agent_rollouts(task, [problem], episodes, on_writer=on_writer)
        assert [r.token_ids.tolist() for r in rows] == [[3, 4, 6], [5], [], [], [], []]
        assert [r.prompt_ids.tolist() for r in rows] == [[1, 2], [1, 2, 3], [], [1, 2], [], []]
        assert [r.sample_index for r in rows] == [0, 0, 0, 1, 1, 1]
        assert [r.model_mask.tolist() for r in rows[:2]] == [[True, True, True], [True]]
        assert infos == [{}, {"agent": {"trained_sequence": 1}}, {}, {}, {}, {}]
        assert outcomes[0].info["agent"]["sequences"] == 2 and outcomes[0].info["agent"]["trained_sequence"] == 0


def test_tool_call_arguments_go_to_the_template_as_objects():
    msgs = message_dicts([Message(role="assistant", content=None, tool_calls=[
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}])])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and msgs[0]["content"] == ""
