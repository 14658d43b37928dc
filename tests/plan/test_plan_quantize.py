"""The planner on fp8 rollout weights (SyncConfig.quantize="fp8"): the rollout params it predicts
equal, on every rollout device and byte for byte, what the real sync makes (float8 projections
and experts, float32 scales, the rest at the rollout dtype), dense and mixture-of-experts."""

import jax
import pytest

from test_plan_moe import tiny_moe
from test_plan_vs_run import assert_every_device, runtime_and_job, tiny
from tpurl.models.moe import EXPERT_NAMES
from tpurl.models.quant import scale_name
from tpurl.plan.memory import rollout_expert_bytes, state_bytes
from tpurl.sync.config import SyncConfig

FP8 = SyncConfig(rollout_dtype="bfloat16", method="device_put", quantize="fp8")


@pytest.mark.parametrize("make", [tiny, tiny_moe], ids=["dense", "moe"])
@pytest.mark.slow
def test_fp8_rollout_params_are_exact(tmp_path, make):
    rt, job = runtime_and_job(make(tmp_path, sync=FP8))
    plan = state_bytes(job)
    state = rt.new_train_state(rt.init_params(0))
    rt.rollout.load(state.params, version=0)
    params = rt.rollout.params
    assert jax.tree.leaves(params["layers"]["q_proj"])[0].dtype.itemsize == 1
    assert_every_device(params, rt.placement.rollout_devices, plan["rollout_params"])
    _, bf16 = runtime_and_job(make(tmp_path, sync=SyncConfig(rollout_dtype="bfloat16", method="device_put")))
    assert plan["rollout_params"] < state_bytes(bf16)["rollout_params"]
    if job.model.moe is not None:
        experts = {k: params["layers"][k] for n in EXPERT_NAMES for k in (n, scale_name(n))}
        assert_every_device(experts, rt.placement.rollout_devices, rollout_expert_bytes(job))
