"""Mixture-of-experts RL runs (tpurl.models.moe): with router replay the rollout's routes reach the
update batch and the trajectory log, packed with their tokens, the trainer follows them (route
agreement and the rollout/trainer mismatch at step one), the routers' load-balancing and z-losses
are logged per layer; asynchronous runs with in-flight updates keep recording them."""

import os

import jax
import numpy as np
import pytest

from algo_helpers import MESH3, BatchSpy, assert_routes_all_but_last, fresh_state, tiny_rl_config
from tpurl.logging import read_jsonl
from tpurl.models import preset
from tpurl.models.moe import MoeConfig
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.loop import prepare, run
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.train.config import algorithm_preset
from tpurl.train.correction import correction_preset

pytestmark = pytest.mark.slow  # whole RL steps and runs

MOE = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=32, dense_layers=(1,), router_replay=True,
                balance_loss_coef=0.01, z_loss_coef=0.001)
MODEL = preset("tiny-moe", hidden_size=32, intermediate_size=64, head_dim=8, num_heads=4, num_kv_heads=2,
               num_layers=3, moe=MOE)


def moe_config(run_dir, **overrides):
    algo = overrides.pop("algorithm", algorithm_preset("grpo", group_size=4, kl_coef=0.01))
    return tiny_rl_config(run_dir, algo, model=MODEL, **overrides)


def test_a_step_replays_the_rollouts_routes_and_logs_the_routers(tmp_path):
    rt = RLRuntime(*prepare(moe_config(tmp_path)))
    spy = BatchSpy(rt)
    state, m, records, _ = rl_step(rt, fresh_state(rt))
    # The update batch carries the rollout's routes: every prompt and completion token but each
    # sequence's last, for the two sparse layers, top-2 (-1 elsewhere).
    batch = spy.batches[0]
    assert_routes_all_but_last(batch)
    routes, valid = batch["routes"], batch["valid"]
    for b in range(valid.shape[0]):
        n = int(valid[b].sum())
        np.testing.assert_array_equal(routes[b, :n], records[b]["routes"])  # the trajectory log's
    # On policy (the same weights sample and train): the trainer keeps the rollout's every route.
    assert m["train/moe/route_agreement"] == pytest.approx(1.0, abs=1e-6)
    assert m["mismatch/abs_diff_max"] < 1e-4
    for i in (0, 2):  # the sparse layers, by their index in the model (layer 1 is dense)
        assert 0 < m[f"train/moe/l{i}/share_min"] <= 0.25 <= m[f"train/moe/l{i}/share_max"] <= 1
        shares = [m[f"train/moe/l{i}/e{j}"] for j in range(4)]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
    # The mean over the sparse layers of each layer's loss (K = 2 when balanced), and no dense layer's.
    assert m["train/moe/balance_loss"] == pytest.approx((m["train/moe/l0/balance"] + m["train/moe/l2/balance"]) / 2)
    assert 1.9 < m["train/moe/balance_loss"] < 4 and "train/moe/l1/balance" not in m
    assert m["train/moe/z_loss"] > 0 and np.isfinite(m["train/loss"])



def test_the_reference_pass_routes_its_own_way(tmp_path):
    """The reference policy's logprobs ignore the batch's replayed routes (they are the rollout
    policy's): equal to the reference routing every token itself, where replaying routes that
    differ from its own would change them."""
    from tpurl.train.logprobs import make_logprob_fn

    rt = RLRuntime(*prepare(moe_config(tmp_path)))
    spy = BatchSpy(rt)
    loop, _, _, _ = rl_step(rt, fresh_state(rt, ref_seed=5))
    batch = dict(spy.batches[0])
    routes = batch["routes"]
    batch["routes"] = np.where(routes >= 0, (routes + 1) % 4, routes).astype(routes.dtype)  # not its own
    placed = rt.place_batch({k: v for k, v in batch.items() if not k.startswith("_")})
    got = np.asarray(rt.reference_logprobs(loop.train, loop.ref_params, placed))
    own = make_logprob_fn(rt.graphdef, temperature=rt.cfg.algorithm.temperature)
    want = np.asarray(own(jax.device_get(loop.ref_params), batch["tokens"], batch["valid"])[0])
    mask = batch["loss_mask"] > 0
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-5)
    replayed = np.asarray(rt.logprob_fn.on_batch(loop.ref_params, placed)[0])
    assert np.abs(replayed[mask] - want[mask]).max() > 1e-3

def test_a_run_logs_routes_in_its_trajectories(tmp_path):
    result = run(moe_config(tmp_path, steps=2), verbose=False)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    for t in traj:
        n = len(t["prompt_ids"]) + len(t["completion_ids"])
        assert np.asarray(t["routes"]).shape == (n, 2, 2)


def test_an_async_in_flight_run_records_and_replays_routes(tmp_path):
    placement = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4,
                                train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 2)),
                                rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 2)))
    cfg = moe_config(tmp_path, steps=3, placement=placement,
                     async_rollout=AsyncConfig(max_staleness=1, in_flight="continue"),
                     algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.01,
                                                correction=correction_preset("tis")))
    result = run(cfg, verbose=False)
    metrics = read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
    assert len(metrics) == 3 and all(0 < m["train/moe/route_agreement"] <= 1 for m in metrics)
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    assert all("routes" in t for t in traj)


def test_the_report_plots_the_experts_load(tmp_path):
    """`tpurl report` of a mixture-of-experts run draws each sparse layer's expert shares
    (experts.png, linked from report.md); a dense run's report has no such figure."""
    from tpurl.report.data import expert_shares, load_run
    from tpurl.report.write import write_report

    result = run(moe_config(tmp_path / "moe", steps=2), verbose=False)
    shares = expert_shares(load_run(result.run_dir).steps)
    assert sorted(shares) == [0, 2] and all(s.shape == (2, 4) for s in shares.values())
    assert all(np.allclose(s.sum(axis=1), 1.0, atol=1e-5) for s in shares.values())
    report = write_report([result.run_dir])
    out = os.path.dirname(report)
    assert os.path.getsize(os.path.join(out, "experts.png")) > 1000
    assert "![experts](experts.png)" in open(report).read()
