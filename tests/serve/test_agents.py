"""Agents as rollouts: agent functions written against the real `openai` client, run against the
endpoint on an engine in this process. The trainer's sequences hold exactly the ids the engine
sampled and the agent sent; failures stay the episode's."""

import asyncio
import threading

import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, KVPool, Weights, WeightSlot
from tpurl.models.hf import load_hf_checkpoint
from tpurl.serve.agent_loop import reward_components
from tpurl.serve.agents import AgentLimits, run_agents
from tpurl.tasks import Problem
from tpurl.tokenizer import load_hf_tokenizer

pytestmark = pytest.mark.slow
PROBLEMS = [Problem(uid="a", prompt="the quick brown", answer=""), Problem(uid="b", prompt="hello world", answer="")]


@pytest.fixture(scope="module")
def setup(random_dir):
    model = load_hf_checkpoint(random_dir)
    graphdef, params = nnx.split(model)
    engine = Engine(model.config, EngineConfig(max_slots=4, max_seq_len=96, page_size=8, prefill_buckets=(32, 96)),
                    graphdef=graphdef)
    return engine, WeightSlot(Weights(params, 3)), load_hf_tokenizer(random_dir)


def _run(setup, agent, problems=PROBLEMS, n=2, **limits):
    engine, weights, tok = setup
    with KVPool(engine) as pool:
        out = run_agents(agent, problems, n, engine=engine, weights=weights, pool=pool, tokenizer=tok,
                         context_length=96, limits=AgentLimits(**limits))
        assert [engine.free_pages(r) for r in range(engine.replicas)] == [engine.num_pages] * engine.replicas
        assert not engine.page_book.used_slots()
    return out


def test_token_in_token_out_continues_one_sequence(setup):
    tok = setup[2]
    seen = {}

    async def agent(client, problem):
        first = await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=6, seed=1,
                                                extra_body={"ignore_eos": True})
        ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        obs = tok.encode(" ok:")
        second = await client.completions.create(model="policy", prompt=ids + obs, max_tokens=5, seed=2,
                                                 extra_body={"ignore_eos": True})
        seen[problem.uid] = (first, obs, second)
        return {"correct": 1.0, "format": 0.5}

    before, resumes = set(threading.enumerate()), setup[0].stats["session_resumes"]
    episodes = _run(setup, agent, n=1)
    assert set(threading.enumerate()) <= before
    # Each second call extended its episode's first: it resumed the first call's KV pages.
    assert setup[0].stats["session_resumes"] == resumes + len(PROBLEMS)
    for problem, (episode,) in zip(PROBLEMS, episodes):
        assert episode.error is None and episode.reward == {"correct": 1.0, "format": 0.5}
        first, obs, second = seen[problem.uid]
        (seq,) = episode.sequences
        c1, c2 = first.choices[0].model_extra["token_ids"], second.choices[0].model_extra["token_ids"]
        assert seq.prompt == first.model_extra["prompt_token_ids"]
        assert seq.tokens == c1 + obs + c2
        assert seq.mask == [True] * 6 + [False] * len(obs) + [True] * 5
        assert seq.versions == [3] * 6 + [-1] * len(obs) + [3] * 5  # the weights' policy version
        got = seq.completion(0, 0)
        np.testing.assert_allclose(got.logprobs[:6], [c1_lp for c1_lp in episode.calls[0].completions[0].logprobs])
        assert [c.request["prompt"] for c in episode.calls][0] == problem.prompt


def test_retokenised_text_is_not_what_was_sampled_and_the_trainer_keeps_the_samples(setup):
    tok = setup[2]

    async def agent(client, problem):  # a text agent: it sends back what it read, as text
        first = await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=8, seed=5,
                                                extra_body={"ignore_eos": True})
        await client.completions.create(model="policy", prompt=problem.prompt + first.choices[0].text + " ok",
                                        max_tokens=4, seed=6, extra_body={"ignore_eos": True})
        return 1.0

    (episode, *_), *_ = _run(setup, agent, problems=PROBLEMS[:1], n=1)
    first = episode.calls[0]
    sampled = first.completions[0].token_ids.tolist()
    retokenised = tok.encode(first.texts[0])
    assert retokenised != sampled, "this seed's completion re-tokenises to itself; pick another"
    seqs = episode.sequences
    assert len(seqs) == 2  # the second prompt does not extend the first sequence token for token
    assert seqs[0].tokens == sampled and seqs[0].prompt == first.prompt_ids
    assert seqs[1].prompt == episode.calls[1].prompt_ids
    assert seqs[1].tokens == episode.calls[1].completions[0].token_ids.tolist()


def test_failing_agents_get_no_reward_and_the_others_go_on(setup):
    async def agent(client, problem):
        if problem.uid == "a":
            raise RuntimeError("tool crashed")
        if problem.uid == "b":
            await asyncio.sleep(30)
        if problem.uid == "c":
            return "five"
        if problem.uid == "d":
            return {"reward": float("nan")}
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
        return float(len(r.choices[0].model_extra["token_ids"]))

    problems = [Problem(uid=u, prompt="x", answer="") for u in "abcde"]
    episodes = _run(setup, agent, problems=problems, n=1, timeout_s=2.0)
    errors = {p.uid: row[0].error for p, row in zip(problems, episodes)}
    assert "tool crashed" in errors["a"] and "timeout_s=2" in errors["b"]
    assert "returned str" in errors["c"] and "not a finite number" in errors["d"]
    assert errors["e"] is None and 1 <= episodes[4][0].reward["reward"] <= 3 and len(episodes[4][0].calls) == 1


def test_an_agent_that_blocks_the_agents_thread_fails_at_the_deadline_and_the_rollout_goes_on(setup, monkeypatch):
    """processes = 0: an agent blocks the agents' event loop (a synchronous call) while another
    episode's call may be in flight. The rollout returns at the share's deadline: the unfinished
    episodes fail, the ended one keeps its reward, every page comes back, the endpoint's thread
    ends; only the loop's threads are left, until the agent returns."""
    from tpurl.serve import agent_loop

    monkeypatch.setattr(agent_loop, "DEADLINE_GRACE_S", 1.0)
    release, calling = threading.Event(), []

    async def agent(client, problem):
        if problem.uid == "b":
            calling.append(True)
            await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=80,
                                            extra_body={"ignore_eos": True})
        if problem.uid == "c":
            while not calling:
                await asyncio.sleep(0)
            await asyncio.sleep(0.02)
            release.wait(60)
        return 1.0

    problems = [Problem(uid=u, prompt="x", answer="") for u in "abc"]
    before = set(threading.enumerate())
    episodes = _run(setup, agent, problems=problems, n=1, timeout_s=1.0)
    a, b, c = (row[0] for row in episodes)
    assert a.error is None and a.reward == {"reward": 1.0}
    assert c.reward is None and "event loop ran past its deadline" in c.error
    assert b.error is None or "event loop ran past its deadline" in b.error
    left = set(threading.enumerate()) - before  # the loop's thread and its loop's executor thread
    assert "tpurl-agents-loop" in {t.name for t in left} and len(left) <= 2
    release.set()
    for thread in left:
        thread.join(10)
    assert set(threading.enumerate()) <= before


def test_reward_components():
    assert reward_components(1) == {"reward": 1.0}
    assert reward_components({"a": 0.5}) == {"a": 0.5}
    for bad in (None, True, "1", [1], {"a": "x"}, {"a": float("inf")}):
        with pytest.raises(ValueError):
            reward_components(bad)


def test_nothing_of_a_rollout_stays_alive(setup):
    """Each rollout's endpoint, calls and episodes are freed once it returns (a process-wide cache
    of FastAPI's once kept every rollout's endpoint, and the step time grew with the run)."""
    import gc

    from tpurl.serve.agents import AgentEpisode
    from tpurl.serve.app import Endpoint

    async def agent(client, problem):
        await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=2)
        return 1.0

    for _ in range(2):
        _run(setup, agent, n=1)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, (AgentEpisode, Endpoint))]


def test_a_streamed_tool_call_is_recorded_with_the_id_the_agent_got(scripted_dir):
    """The trajectory keeps each call as the agent saw it: a streamed tool call's id too (the id
    the agent's next message refers to in `tool_call_id`)."""
    model = load_hf_checkpoint(scripted_dir)
    graphdef, params = nnx.split(model)
    engine = Engine(model.config, EngineConfig(max_slots=2, max_seq_len=512, page_size=16, prefill_buckets=(512,)),
                    graphdef=graphdef)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    streamed = {}

    async def agent(client, problem):
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "what is two plus three"}], tools=tools,
            max_tokens=10, stream=True)
        streamed[problem.uid] = [d.id async for chunk in stream for c in chunk.choices
                                 for d in (c.delta.tool_calls or [])]
        return 1.0

    with KVPool(engine) as pool:
        (episodes,) = run_agents(agent, PROBLEMS[:1], 1, engine=engine, weights=WeightSlot(Weights(params, 0)),
                                 pool=pool, tokenizer=load_hf_tokenizer(scripted_dir), context_length=512,
                                 limits=AgentLimits(), temperature=0.0)
    (episode,) = episodes
    assert episode.error is None and len(streamed["a"]) == 1
    (call,) = episode.calls
    assert [c["id"] for c in call.tool_calls[0]] == streamed["a"]


def test_a_worker_process_that_dies_fails_its_unfinished_episodes_and_the_run_goes_on(setup):
    import worker_agents

    problems = [Problem(uid=u, prompt="the quick brown", answer="") for u in "xyzw"]
    episodes = _run(setup, worker_agents.dies_on_x, problems=problems, n=1, processes=2)
    errors = [row[0].error for row in episodes]  # process 0 ran x and z, process 1 y and w
    assert "worker process 0 failed" in errors[0] and "worker process 0 failed" in errors[2]
    assert errors[1] is None and errors[3] is None and episodes[1][0].reward["correct"] == 4.0


def test_an_agent_that_cannot_reach_a_worker_process_is_refused_before_anything_starts(setup):
    async def closure(client, problem):
        return 1.0

    before = setup[0].stats["prefill_prompts"]
    with pytest.raises(ValueError, match="processes=1: the agent .*closure.* module-level function"):
        _run(setup, closure, processes=1)
    assert setup[0].stats["prefill_prompts"] == before and not setup[0].page_book.used_slots()
