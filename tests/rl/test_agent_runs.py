"""RL with an agent written against the OpenAI API (examples/agent): a short run end to end,
whose update batch holds exactly the tokens the endpoint sampled and the agent sent, with the
agent's calls in `trajectories.jsonl`; a rerun samples the same tokens; a failing agent is its
episodes' zero reward; asynchronous runs, with and without in-flight weight updates."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from algo_helpers import BatchSpy, assert_routes_all_but_last, episode_gae, fresh_state, tiny_rl_config
from tpurl.logging import read_jsonl
from tpurl.rl.loop import prepare, run
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.tasks import AgentConfig, CalculatorConfig, TaskConfig
from tpurl.train.config import algorithm_preset

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent")


@pytest.fixture(autouse=True)
def agents_importable(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE)


def _config(tmp_path, name, agent="my_agents.calculator:solve", algorithm=None, processes=0, **overrides):
    task = TaskConfig(name="agent", calculator=CalculatorConfig(digits=1, num_eval=4),
                      agent=AgentConfig(agent=agent, source="calculator", reward_weights={"correct": 1.0},
                                        max_prompt_tokens=8, max_new_tokens=24, timeout_s=30, processes=processes))
    overrides = {"steps": 2, **overrides}
    return tiny_rl_config(tmp_path / name, algorithm or algorithm_preset("grpo", group_size=4), task=task, **overrides)


def test_rl_with_an_openai_agent(tmp_path):
    result = run(_config(tmp_path, "a"), verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    metrics = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert len(metrics) == 2 and all(np.isfinite(m["train/loss"]) for m in metrics)
    assert len(traj) == 16
    for t in traj:
        calls = t["info"]["agent"]["calls"]
        assert calls and set(t["rewards"]) == {"correct"} and "error" not in t["info"]
        # The row is the first call's prompt, then every token after it: each call's completion
        # (the model's) and what the agent added between calls (the environment's).
        assert t["prompt_ids"] == calls[0]["prompt_ids"]
        model = [i for i, m in zip(t["completion_ids"], t["model_mask"]) if m]
        assert model == [i for c in calls for i in c["choices"][0]["token_ids"]]
        whole = t["prompt_ids"] + t["completion_ids"]
        for c in calls[1:]:
            assert whole[:len(c["prompt_ids"])] == c["prompt_ids"]
    # A rerun of the same config samples the same tokens (the endpoint seeds every call), with the
    # agents in a worker process of their own as on the trainer's thread.
    # (Its first step: the same seeds and weights.)
    again = read_jsonl(os.path.join(run(_config(tmp_path, "b", processes=1, steps=1), verbose=False).run_dir,
                                    "trajectories.jsonl"))
    assert len(again) == 8
    assert [t["completion_ids"] for t in again] == [t["completion_ids"] for t in traj[:8]]
    assert [t["rewards"] for t in again] == [t["rewards"] for t in traj[:8]]


def test_rl_with_a_function_calling_agent(tmp_path):
    """examples/agent's function-calling agent (chat completions with a `multiply` tool) on the
    calculator's chat format, end to end through an RL step: every episode's calls are recorded
    with their requests (tests/tasks/test_calculator_chat.py: a call rendered back continues the
    sequence)."""
    cfg = _config(tmp_path, "fc", agent="my_agents.function_calling:solve", steps=1)
    task = dataclasses.replace(cfg.task, calculator=dataclasses.replace(cfg.task.calculator, chat=True),
                               agent=dataclasses.replace(cfg.task.agent, max_prompt_tokens=7, max_new_tokens=29))
    result = run(dataclasses.replace(cfg, task=task), verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    assert len(traj) == 8 and all("error" not in t["info"] for t in traj)
    for t in traj:
        calls = t["info"]["agent"]["calls"]
        assert calls and calls[0]["request"]["tools"][0]["function"]["name"] == "multiply"
        assert t["prompt_ids"] in [c["prompt_ids"] for c in calls]  # the trained sequence's first call's


def test_the_update_trains_the_sampled_tokens(tmp_path):
    rt = RLRuntime(*prepare(_config(tmp_path, "c", steps=1)))
    spy = BatchSpy(rt)
    sampled = []
    real_sample = rt.rollout.sample
    rt.rollout.sample = lambda *a, **k: sampled.append(real_sample(*a, **k)) or sampled[-1]
    rl_step(rt, fresh_state(rt))
    (ro,) = sampled
    (batch,) = spy.batches
    np.testing.assert_array_equal(batch["tokens"], ro.tokens)
    np.testing.assert_array_equal(batch["loss_mask"] > 0, ro.sampled)
    for b, info in enumerate(ro.infos):
        calls = info["agent"]["calls"]
        model_tokens = ro.tokens[b][ro.sampled[b]].tolist()
        assert model_tokens == [i for c in calls for i in c["choices"][0]["token_ids"]]


def test_a_failing_agent_is_zero_reward_and_the_run_goes_on(tmp_path):
    result = run(_config(tmp_path, "d", agent="my_agents.broken:solve", steps=1), verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    assert all(t["reward"] == 0.0 and "agent: ZeroDivisionError" in t["info"]["error"] for t in traj)
    assert all(not any(t["model_mask"]) for t in traj)


@pytest.mark.parametrize("in_flight", ["drain", "continue"])
def test_an_agent_trains_asynchronously(tmp_path, in_flight):
    """Asynchronous RL (one step of staleness, disaggregated) with an agent task: the endpoint of
    the rollout pool serves the weights each batch was scheduled with; with in-flight updates
    ("continue") a newer version may land during a batch's episodes."""
    from test_async_run import DISAGG
    from tpurl.rl.async_rollout import AsyncConfig
    from tpurl.train.correction import correction_preset

    cfg = _config(tmp_path, in_flight, steps=3, placement=DISAGG,
                  algorithm=algorithm_preset("grpo", group_size=4, correction=correction_preset("tis")),
                  async_rollout=AsyncConfig(max_staleness=1, in_flight=in_flight))
    result = run(cfg, verbose=False)
    metrics = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    lags = [m["staleness/max"] for m in metrics]
    # Drained, every later batch lags one version; in flight, a newer version may land before a
    # batch's first call (the thread timing decides), so a lag is at most one.
    assert lags == [0, 1, 1] if in_flight == "drain" else lags[0] == 0 and max(lags) <= 1, lags
    assert all(np.isfinite(m["train/loss"]) and np.isfinite(m["mismatch/kl_k3"]) for m in metrics)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    assert len(traj) == 24
    for t in traj:
        assert t["info"]["agent"]["calls"] and "error" not in t["info"]
        scheduled = max(0, t["step"] - 2)  # the version the step's batch was scheduled with
        if in_flight == "drain":
            assert t["policy_version"] == scheduled
        else:  # the oldest version among its tokens: the scheduled one, or one landed before it began
            assert scheduled <= t["policy_version"] <= t["step"] - 1


async def rewrites_history(client, problem):
    """Two calls; when the first completion's ids have an even sum, the second's prompt is that
    completion, then the problem: it extends no sequence, so the episode has two (else one). The
    reward: the parity of the first completion's last id."""
    first = await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=6)
    prompt, ids = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    await client.completions.create(model="policy", prompt=ids + prompt if sum(ids) % 2 == 0 else prompt + ids + prompt,
                                    max_tokens=6)
    return {"correct": float(ids[-1] % 2)}


def _two_row_step(run_dir, packed: bool, algorithm=None):
    """One RL step of `rewrites_history` with `trained_sequences` = 2: the new state, the
    metrics, the trajectory records and the update batch."""
    from tpurl.train.packing import PackingConfig

    cfg = _config(run_dir, "run", agent="test_agent_runs:rewrites_history", steps=1, algorithm=algorithm,
                  packing=PackingConfig(enabled=packed))
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(
        cfg.task, agent=dataclasses.replace(cfg.task.agent, trained_sequences=2)))
    rt = RLRuntime(*prepare(cfg))
    spy = BatchSpy(rt)
    state, m, records, _ = rl_step(rt, fresh_state(rt))
    (batch,) = spy.batches
    return state, m, records, batch


@pytest.mark.parametrize("packed", [True, False])
def test_every_sequence_of_an_episode_trains(tmp_path, packed):
    """`AgentConfig.trained_sequences` = 2 with an agent whose calls make two sequences or one:
    each episode is two rows of the update batch, its second call's sequence first, every token
    the endpoint sampled trained once, both rows with the episode's advantage; an episode of one
    sequence has a second row without a token, which the packed update skips and the unpacked
    one computes on without harm (a finite loss)."""
    state, m, records, batch = _two_row_step(tmp_path / f"two{packed}", packed)
    assert batch["tokens"].shape[0] == 16 and np.isfinite(m["train/loss"])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.train.params))
    rows = {(r["group_id"], r["sample_index"]): [] for r in records}
    for r in records:
        rows[r["group_id"], r["sample_index"]].append(r)
    assert len(rows) == 8 and {len(v) for v in rows.values()} == {1, 2}, "episodes of one and of two sequences"
    for e, (first, *second) in enumerate(rows.values()):
        calls = first["info"]["agent"]["calls"]
        assert len(calls) == 2 and first["info"]["agent"]["sequences"] == 1 + len(second)
        trained = [calls[1]["choices"][0]["token_ids"], calls[0]["choices"][0]["token_ids"]]
        if not second:  # one sequence: both calls' tokens in the first row, nothing in the second
            trained = [trained[1] + trained[0], []]
        for s, want in enumerate(trained):
            assert batch["tokens"][2 * e + s][batch["loss_mask"][2 * e + s] > 0].tolist() == want
        assert [r["advantage"] for r in second] == [first["advantage"]] * len(second)
        assert batch["advantages"][2 * e] == batch["advantages"][2 * e + 1] == pytest.approx(first["advantage"])
        assert second == [] or second[0]["info"] == {"agent": {"trained_sequence": 0}}
    assert len({r["advantage"] for r in records}) > 1  # some groups differ in reward


@pytest.mark.parametrize("packed", [True, False])
def test_ppo_trains_an_episode_of_two_sequences_as_one_trajectory(tmp_path, packed):
    """PPO (a critic, GAE) with `trained_sequences` = 2: every sampled token trains once, and an
    episode's returns are those of one trajectory over its rows in the order of their last calls
    (float64 GAE of the batch's own values and KL)."""
    state, m, records, batch = _two_row_step(tmp_path / f"ppo{packed}", packed,
                                             algorithm_preset("ppo", kl_coef=0.05))
    assert np.isfinite(m["train/loss"]) and all(np.isfinite(np.asarray(x)).all()
                                                for x in jax.tree.leaves(state.train.params))
    mask = batch["loss_mask"] > 0
    assert mask[::2].any(axis=1).all() and mask[1::2].any() and not mask[1::2].all(axis=1).any()
    rewards = {r["group_id"] * 1000 + r["sample_index"]: r["reward"] for r in records}
    kl = 0.05 * (batch["old_logprobs"].astype(np.float64) - batch["ref_logprobs"])
    for e, reward in enumerate(rewards.values()):
        rows, cols = zip(*[(2 * e + s, c) for s in (1, 0) for c in range(mask.shape[1]) if mask[2 * e + s, c]])
        values = batch["old_values"][rows, cols].astype(np.float64)
        _, want = episode_gae(reward, kl[rows, cols], values, 1.0, 0.95)
        np.testing.assert_allclose(batch["returns"][rows, cols], want, rtol=1e-4, atol=1e-4)


async def two_calls(client, problem):
    """Two calls whatever the model writes: the second's prompt is the first's, its completion and a
    tool's answer (an agent for the router replay test, whose untrained model calls no tool)."""
    first = await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=6)
    prompt = first.model_extra["prompt_token_ids"]  # ids in and out: the model may write anything
    await client.completions.create(model="policy", prompt=prompt + first.choices[0].model_extra["token_ids"] + prompt,
                                    max_tokens=6)
    return {"correct": 0.0}


def test_router_replay_trains_the_routes_each_call_used(tmp_path):
    """A mixture-of-experts model with router replay: each row carries the experts that routed each
    of its tokens in the call that consumed it first (`tpurl.serve.sessions`), the last one
    excepted; on policy the trainer, replaying them, routes every token as the rollout did and
    computes the rollout's logprobs."""
    from tpurl.models import preset
    from tpurl.models.moe import MoeConfig

    moe = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, router_replay=True)
    model = preset("tiny-moe", num_layers=2, moe=moe)
    rt = RLRuntime(*prepare(_config(tmp_path, "moe", agent="test_agent_runs:two_calls", model=model, steps=1)))
    spy = BatchSpy(rt)
    _, m, records, _ = rl_step(rt, fresh_state(rt))
    assert_routes_all_but_last(spy.batches[0])
    assert all(len(r["info"]["agent"]["calls"]) == 2 and r["info"]["agent"]["sequences"] == 1 for r in records)
    assert m["train/moe/route_agreement"] == pytest.approx(1.0, abs=1e-6)
    assert m["mismatch/abs_diff_max"] < 1e-4
