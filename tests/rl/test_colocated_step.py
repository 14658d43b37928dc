"""The colocated step's memory handover, checked from its logged metrics: the KV pool is allocated
by the handover after the optimizer state (and optionally the fp32 master weights) left the
device, it is accounted for while alive, and it is gone in the update phase; the previous rollout
weights are freed before the sync. Also the config checks that go with it (master-weight offload
needs a copying sync; RL rejects truncated sampling)."""

import jax
import numpy as np
import pytest

from algo_helpers import fresh_state, tiny_rl_config
from tpurl.generate import SamplingConfig
from tpurl.rl.config import validate
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sync import ColocatedHandover, HandoverConfig, SyncConfig
from tpurl.train.config import algorithm_preset


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    # A bf16 sync copies every weight, so no rollout param aliases a train param (master offload).
    cfg = tiny_rl_config(tmp_path_factory.mktemp("colocated"), algorithm_preset("grpo", group_size=4),
                         sync=SyncConfig(rollout_dtype="bfloat16"))
    return RLRuntime(cfg, prepare(cfg))


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_kv_pool_lives_only_in_the_rollout_and_is_accounted(rt):
    rt.handover = ColocatedHandover(HandoverConfig())
    state = fresh_state(rt)
    old_rollout = state.rollout_params
    new, m, _, _ = rl_step(rt, state)
    assert m["memory/rollout/opt_state_device_bytes"] == 0  # parked in host memory
    assert m["memory/rollout/kv_pool_device_bytes"] > 0  # accounted while the pool is alive
    assert m["memory/update/kv_pool_device_bytes"] == 0  # released before the update
    assert m["memory/rollout_end/kv_pool_device_bytes"] == 0
    assert m["memory/update/opt_state_device_bytes"] > 0  # back on device
    assert "memory/rollout/master_params_device_bytes" not in m  # not offloaded by default
    # The previous rollout weights were freed before the sync built the new ones.
    assert all(x.is_deleted() for x in jax.tree.leaves(old_rollout))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new.rollout_params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new.train.params))


def test_on_policy_step_skips_the_old_policy_forward(rt):
    """One epoch of one minibatch: the logprobs phase computes only the reference's logprobs; the
    update measures the rollout mismatch itself (non-zero here: the rollout runs in bf16)."""
    rt.handover = ColocatedHandover(HandoverConfig())
    calls, logprob_fn = [], rt.logprob_fn
    rt.logprob_fn = lambda *args: calls.append(args) or logprob_fn(*args)
    try:
        _, m, _, _ = rl_step(rt, fresh_state(rt))
    finally:
        rt.logprob_fn = logprob_fn
    assert not rt.cfg.algorithm.needs_old_logprobs and rt.uses_reference
    assert len(calls) == 1
    assert 0 < m["mismatch/abs_diff_mean"] <= m["mismatch/abs_diff_max"] < 0.5 and m["mismatch/kl"] >= 0
    assert m["train/ratio_mean"] == pytest.approx(1.0)


def test_offloaded_master_params_come_back_and_train_the_same(rt):
    rt.handover = ColocatedHandover(HandoverConfig())
    plain, _, _, _ = rl_step(rt, fresh_state(rt))
    rt.handover = ColocatedHandover(HandoverConfig(offload_master_params=True))
    state = fresh_state(rt)
    params0 = _host(state.train.params)
    offloaded, m, _, _ = rl_step(rt, state)
    assert m["memory/rollout/master_params_device_bytes"] == 0
    assert m["memory/update/master_params_device_bytes"] > 0
    assert m["memory/rollout/opt_state_device_bytes"] == 0
    after = _host(offloaded.train.params)
    assert any(not np.array_equal(a, b) for a, b in zip(params0, after))  # the update ran on them
    for a, b in zip(_host(plain.train.params), after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(_host(plain.train.opt_state), _host(offloaded.train.opt_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_master_offload_with_an_aliasing_sync_is_rejected(tmp_path):
    cfg = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), sync=SyncConfig(rollout_dtype=None),
                         handover=HandoverConfig(offload_master_params=True))
    with pytest.raises(ValueError, match="offload_master_params.*aliased") as e:
        validate(cfg, 8, vocab_size=16)
    assert "\n" not in str(e.value)
    ok = tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), sync=SyncConfig(rollout_dtype="bfloat16"),
                        handover=HandoverConfig(offload_master_params=True))
    validate(ok, 8, vocab_size=16)


@pytest.mark.parametrize("sampling", [SamplingConfig(top_k=5), SamplingConfig(top_p=0.9)])
def test_truncated_sampling_is_rejected_for_rl(tmp_path, sampling):
    with pytest.raises(ValueError, match="importance ratios; set top_k=0 and top_p=1.0") as e:
        tiny_rl_config(tmp_path, algorithm_preset("grpo", group_size=4), sampling=sampling)
    assert "\n" not in str(e.value)
