"""Router replay (tpurl.models.moe, `MoeConfig.router_replay`): the paged engine records every
consumed token's experts per sparse layer (prompt tokens in the prefill, each sampled token at the
step that consumes it, a resumed episode's tokens in the extend), equal to the routes of the full
forward over the sequence; a trainer that replays them keeps its routes when the weights move, so
the rollout/trainer mismatch stays at the continuous change, where without replay flipped routes
make it jump."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.models import init_model, preset
from tpurl.models.moe import MoeConfig
from tpurl.train.logprobs import forward_hidden, logprobs_from_hidden

MOE = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,), router_replay=True)
CFG = preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
             num_kv_heads=2, head_dim=8).replace(model_type="qwen3_moe", qk_norm=True, moe=MOE)


def _sample(model, prompts, n=2, new=10, seed=0):
    engine = Engine(CFG, EngineConfig(max_slots=4, max_seq_len=24, page_size=4, prefill_buckets=(8,)))
    return generate(engine, nnx.state(model, nnx.Param), prompts, n_samples=n,
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=new), seed=seed)


def _forward(model, seq, routes=None):
    """`(logprobs of seq[1:], the forward's own routes [T, Ls, K])` of one sequence."""
    tokens = jnp.asarray([seq], jnp.int32)
    valid = jnp.ones(tokens.shape, bool)
    replay = None if routes is None else jnp.asarray(routes[None])
    hidden, routing = forward_hidden(model, tokens, valid, routes_BTLK=replay, with_routing=True)
    lp, _ = logprobs_from_hidden(hidden, model.unembedding(), tokens, valid)
    return np.asarray(lp[0, 1:]), np.asarray(jnp.transpose(routing.experts[:, 0], (1, 0, 2)))


@pytest.fixture(scope="module")
def sampled():
    model = init_model(CFG, seed=3)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 8, 5)]
    return model, prompts, _sample(model, prompts)


@pytest.mark.slow
def test_the_engine_records_each_consumed_tokens_experts_as_the_full_forward_routes_them(sampled):
    model, prompts, out = sampled
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq = prompt + c.token_ids.tolist()
            assert c.routes.shape == (len(seq), 2, 2)  # two sparse layers, top-2
            _, own = _forward(model, seq)
            np.testing.assert_array_equal(c.routes[:-1], own[:-1])
            assert (c.routes[-1] == -1).all()  # the last token is never consumed
            assert c.routes[:-1].min() >= 0 and c.routes.max() < MOE.num_experts


@pytest.mark.slow
def test_replay_keeps_the_rollouts_routes_when_the_router_moves(sampled):
    """The routers move a little (as an update would): some tokens' top-2 change. Replaying the
    rollout's routes keeps the trainer's logprobs near the rollout's; without, they jump."""
    model, prompts, out = sampled
    graphdef, params = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(9), 8))
    params["layers"]["router"] = params["layers"]["router"].replace(
        params["layers"]["router"][...] + 0.02 * jax.random.normal(next(keys), params["layers"]["router"].shape))
    moved = nnx.merge(graphdef, params)
    flipped, with_replay, without = 0, [], []
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq, n = prompt + c.token_ids.tolist(), len(prompt)
            rollout_lp = c.logprobs
            lp_free, own = _forward(moved, seq)
            lp_replay, kept = _forward(moved, seq, c.routes)
            flipped += int((np.sort(own[:-1], -1) != np.sort(c.routes[:-1], -1)).any(-1).any(-1).sum())
            without.append(np.abs(lp_free[n - 1:] - rollout_lp).max())
            with_replay.append(np.abs(lp_replay[n - 1:] - rollout_lp).max())
            np.testing.assert_array_equal(np.sort(kept[:-1], -1), np.sort(c.routes[:-1], -1))  # the routes followed
    assert flipped >= 3
    assert max(with_replay) < 0.2 * max(without), (max(with_replay), max(without))


@pytest.mark.slow
def test_a_model_without_router_replay_records_no_routes(sampled):
    model, prompts, _ = sampled
    cfg = CFG.replace(moe=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,)))
    engine = Engine(cfg, EngineConfig(max_slots=4, max_seq_len=24, page_size=4, prefill_buckets=(8,)))
    out = generate(engine, nnx.state(model, nnx.Param), prompts[:1], n_samples=1,
                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=4), seed=0)
    assert out[0][0].routes is None


@pytest.mark.slow
def test_a_resumed_episodes_tokens_are_recorded_as_the_extend_routes_them():
    """Multi-turn: stopped turns are answered by an environment and resumed; the model's last token
    and the observation are routed in the extend program, and every consumed token's recorded
    experts are the full forward's."""
    model = init_model(CFG, seed=5)
    stops = tuple(range(48, 64))  # a quarter of the ids end a turn

    def env(i, j, token_ids):
        return None if len(token_ids) > 12 else [3 + (i + j + len(token_ids)) % 40, 7, 11]

    engine = Engine(CFG, EngineConfig(max_slots=4, max_seq_len=40, page_size=4, prefill_buckets=(8,),
                                      max_stop_tokens=16))
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6]]
    out = generate(engine, nnx.state(model, nnx.Param), prompts, n_samples=2, on_turn_end=env, seed=2,
                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=stops))
    resumed = 0
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq = prompt + c.token_ids.tolist()
            _, own = _forward(model, seq)
            resumed += c.turns - 1
            np.testing.assert_array_equal(c.routes[:-1], own[:-1])
            assert (c.routes[:-1] >= 0).all() and (c.routes[-1] == -1).all()
    assert resumed >= 2  # episodes really were resumed
