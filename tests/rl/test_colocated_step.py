"""The colocated step's memory handover, checked from its logged metrics: the KV pool is allocated
by the handover after the optimizer state (and optionally the fp32 master weights) left the
device, it is accounted for while alive, and it is gone in the update phase; the previous rollout
weights are freed before the sync. Also the config check that goes with it (master-weight offload
needs a copying sync)."""

import jax
import numpy as np
import pytest

from algo_helpers import count_scoring_calls, fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import TaskLengths, resolve_run
from tpurl.rl.step import rl_step
from tpurl.sync import ColocatedHandover, HandoverConfig, SyncConfig
from tpurl.train.config import algorithm_preset


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    # A bf16 sync copies every weight, so no rollout param aliases a train param (master offload).
    cfg = tiny_rl_config(tmp_path_factory.mktemp("colocated"), algorithm_preset("grpo", group_size=4),
                         sync=SyncConfig(rollout_dtype="bfloat16"))
    return RLRuntime(*prepare(cfg))


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_kv_pool_lives_only_in_the_rollout_and_is_accounted(rt):
    rt.rollout.handover = ColocatedHandover(HandoverConfig())
    state = fresh_state(rt)
    old_rollout = rt.rollout.params
    new, m, _, _ = rl_step(rt, state)
    assert m["memory/offload/opt_state_device_bytes"] == 0  # parked in host memory
    assert m["memory/offload/kv_pool_device_bytes"] > 0  # accounted once the pool is allocated
    assert m["memory/onload/kv_pool_device_bytes"] == 0  # released before the update
    assert m["memory/onload_released/kv_pool_device_bytes"] == 0
    assert m["memory/onload/opt_state_device_bytes"] > 0  # back on device
    assert "memory/offload/master_params_device_bytes" not in m  # not offloaded by default
    # The decode program's footprint while it runs covers the KV pool's share of a device (the
    # pool is one of its donated arguments), plus temporaries the live-array account cannot see.
    devices = len(rt.rollout_mesh.devices.flat)
    assert m["memory/rollout/program_peak_bytes"] >= m["memory/offload/kv_pool_device_bytes"] / devices
    assert m["memory/rollout/program_temp_bytes"] > 0
    # The update's program takes the optimizer state (back on device) among its arguments; the
    # reference logprobs pass (KL) holds its activations as temporaries.
    train_devices = len(rt.train_mesh.devices.flat)
    assert m["memory/update/program_peak_bytes"] >= m["memory/onload/opt_state_device_bytes"] / train_devices
    assert m["memory/logprobs/program_temp_bytes"] > 0
    # The previous rollout weights were freed before the sync built the new ones.
    assert all(x.is_deleted() for x in jax.tree.leaves(old_rollout))
    assert not any(x.is_deleted() for x in jax.tree.leaves(rt.rollout.params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new.train.params))


@pytest.mark.slow
def test_on_policy_step_skips_the_old_policy_forward(rt):
    """One epoch of one minibatch: the logprobs phase computes only the reference's logprobs; the
    update measures the rollout mismatch itself (non-zero here: the rollout runs in bf16)."""
    rt.rollout.handover = ColocatedHandover(HandoverConfig())
    on_batch = rt.logprob_fn.on_batch
    calls = count_scoring_calls(rt)
    try:
        _, m, _, _ = rl_step(rt, fresh_state(rt))
    finally:
        rt.logprob_fn.on_batch = on_batch
    assert not rt.cfg.algorithm.needs_old_logprobs and rt.uses_reference
    assert len(calls) == 1
    assert 0 < m["mismatch/abs_diff_mean"] <= m["mismatch/abs_diff_max"] < 0.5 and m["mismatch/kl_k3"] >= 0
    assert m["train/ratio_mean"] == pytest.approx(1.0)


@pytest.mark.slow
def test_offloaded_master_params_come_back_and_train_the_same(rt):
    rt.rollout.handover = ColocatedHandover(HandoverConfig())
    plain, _, _, _ = rl_step(rt, fresh_state(rt))
    rt.rollout.handover = ColocatedHandover(HandoverConfig(offload_master_params=True))
    state = fresh_state(rt)
    params0 = _host(state.train.params)
    offloaded, m, _, _ = rl_step(rt, state)
    assert m["memory/offload/master_params_device_bytes"] == 0
    assert m["memory/onload/master_params_device_bytes"] > 0
    assert m["memory/offload/opt_state_device_bytes"] == 0
    after = _host(offloaded.train.params)
    assert any(not np.array_equal(a, b) for a, b in zip(params0, after))  # the update ran on them
    for a, b in zip(_host(plain.train.params), after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(_host(plain.train.opt_state), _host(offloaded.train.opt_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


LENGTHS = TaskLengths(prompt_len=8, new_tokens=4, vocab_size=16)


def test_master_offload_with_an_aliasing_sync_is_rejected(tmp_path):
    cfg = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), sync=SyncConfig(rollout_dtype=None),
                         handover=HandoverConfig(offload_master_params=True))
    with pytest.raises(ValueError, match="offload_master_params.*aliased") as e:
        resolve_run(cfg, LENGTHS, 8)
    assert "\n" not in str(e.value)
    ok = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), sync=SyncConfig(rollout_dtype="bfloat16"),
                        handover=HandoverConfig(offload_master_params=True))
    resolve_run(ok, LENGTHS, 8)


def _window(rollout) -> dict:
    """What a rollout-side call sees of the colocated handover while it runs."""
    account = rollout.handover.account("offload")
    train, _ = rollout._lent
    return {"in_rollout": rollout.handover.in_rollout, "pool_alive": rollout._pool is not None and rollout._pool.alive,
            "opt_state_device_bytes": account.device_bytes("opt_state"),
            "opt_state_host_bytes": account.groups["opt_state"].get("pinned_host", 0),
            "kv_pool_device_bytes": account.device_bytes("kv_pool"),
            "opt_state_arrays_deleted": all(x.is_deleted() for x in jax.tree.leaves(train.opt_state))}


@pytest.mark.slow
def test_evaluation_and_the_warm_start_probe_roll_out_under_the_handover(tmp_path, monkeypatch):
    """Held-out evaluation and the SFT probe run like a step's rollout: while the KV pool is alive
    the optimizer state has no device bytes (it waits in pinned host memory)."""
    from tpurl.rl import evaluation, loop, sft
    from tpurl.rl.config import EvalConfig, SFTConfig

    seen = {"eval": [], "probe": []}

    def spy(kind, real):
        def call(rollout, *args, **kw):
            seen[kind].append(_window(rollout))
            return real(rollout, *args, **kw)
        return call

    monkeypatch.setattr(loop, "evaluate", spy("eval", evaluation.evaluate))
    monkeypatch.setattr(sft, "greedy_accuracy", spy("probe", evaluation.greedy_accuracy))
    cfg = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), steps=2,
                         sft=SFTConfig(steps=2, batch_size=8, stop_at_accuracy=1.0, check_every=1, probe_problems=4),
                         eval=EvalConfig(every_steps=1, pass_k=2))
    loop.run(cfg, verbose=False)
    assert len(seen["eval"]) == 3 and len(seen["probe"]) == 2  # warm start, after step 1, final; 2 probes
    for window in seen["eval"] + seen["probe"]:
        assert window["in_rollout"] and window["pool_alive"] and window["opt_state_arrays_deleted"]
        assert window["opt_state_device_bytes"] == 0 and window["opt_state_host_bytes"] > 0
        assert window["kv_pool_device_bytes"] > 0


@pytest.mark.slow
def test_the_run_fetches_at_most_one_parameter_to_the_host_at_a_time(tmp_path, monkeypatch):
    """The manifest's checksum and the final export fetch parameters one by one (as `hf_export`
    does): no `jax.device_get` of the run moves more bytes than the largest parameter."""
    from tpurl.checkpoint import CheckpointConfig
    from tpurl.rl import loop

    fetched = []
    real = jax.device_get

    def spy(tree):
        out = real(tree)
        fetched.append(sum(np.asarray(x).nbytes for x in jax.tree.leaves(out)))
        return out

    monkeypatch.setattr(jax, "device_get", spy)
    cfg = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), steps=0,
                         checkpoint=CheckpointConfig(every_steps=0, export_hf=True))
    result = loop.run(cfg, verbose=False)
    params = _exported_params(result.export_dir)
    assert result.export_dir and len(fetched) > len(params)
    assert max(fetched) <= max(x.nbytes for x in params) < sum(x.nbytes for x in params)


def _exported_params(export_dir) -> list[np.ndarray]:
    from flax import nnx

    from tpurl.models.hf import load_hf_checkpoint

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(load_hf_checkpoint(export_dir), nnx.Param))]


@pytest.mark.slow
def test_a_failed_rollout_closes_its_window(rt, monkeypatch):
    # An error while rolling out (a task bug, an interrupt) frees the KV pool and ends the window,
    # so the runtime can roll out again (a second `open` of an open window is an error).
    import tpurl.rl.step as step

    rt.rollout.handover = ColocatedHandover(HandoverConfig())

    def broken(*a, **kw):
        assert rt.rollout._pool is not None  # the window is open, the pool alive
        raise KeyboardInterrupt

    monkeypatch.setattr(step, "collect_rollouts", broken)
    with pytest.raises(KeyboardInterrupt):
        rl_step(rt, fresh_state(rt))
    assert rt.rollout._lent is None and rt.rollout._pool is None
    monkeypatch.undo()
    _, m, _, _ = rl_step(rt, fresh_state(rt))
    assert np.isfinite(m["train/loss"])
