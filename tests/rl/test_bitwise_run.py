"""Bitwise mode in RL steps (ModelConfig.consistency="bitwise"): on every step the rollout engine's
logprob of every sampled token equals the trainer's old-policy logprob bit for bit
(`mismatch/abs_diff_max` exactly 0), in float32 and bfloat16 compute, with the update's rows packed
or padded; the same steps in fast mode do not (the check can fail); and configs it cannot hold
for are refused in one line."""

import pytest

from algo_helpers import tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sharding.mesh import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.generate import EngineConfig
from tpurl.sync import SyncConfig
from tpurl.train.config import algorithm_preset
from tpurl.train.packing import PackingConfig

from algo_helpers import fresh_state

# One device per pool (of the 8 fake ones: disaggregated, one trains and one generates).
ONE = PlacementConfig(mode="disaggregated", train_devices=1, rollout_devices=1,
                      train_mesh=MeshConfig(axes=("data", "fsdp", "tensor"), shape=(1, 1, 1)),
                      rollout_mesh=MeshConfig(axes=("data", "fsdp", "tensor"), shape=(1, 1, 1)))


def _config(tmp_path, consistency, dtype, packing=PackingConfig(), **overrides):
    algo = algorithm_preset("grpo", group_size=4, minibatches=2)  # two minibatches: an old-logprob pass
    cfg = tiny_rl_config(tmp_path, algo, placement=ONE, packing=packing, batch_size=16, **overrides)
    return cfg.replace(model=cfg.model.replace(consistency=consistency, dtype=dtype, max_position_embeddings=32))


def _max_diffs(cfg, steps=2) -> list[float]:
    rt = RLRuntime(*prepare(cfg))
    state, out = fresh_state(rt), []
    for _ in range(steps):
        state, m, _, _ = rl_step(rt, state)
        out.append(m["mismatch/abs_diff_max"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_logprobs_are_the_trainers_bit_for_bit(tmp_path, dtype):
    assert _max_diffs(_config(tmp_path / "bitwise", "bitwise", dtype)) == [0.0, 0.0]
    fast = _max_diffs(_config(tmp_path / "fast", "fast", dtype), steps=1)
    assert fast[0] > 0  # what the mode removes


@pytest.mark.slow
def test_bitwise_without_packing(tmp_path):
    assert _max_diffs(_config(tmp_path, "bitwise", "float32", packing=PackingConfig(enabled=False)), steps=1) == [0.0]


@pytest.mark.parametrize("overrides,message", [
    (dict(sync=SyncConfig(quantize="fp8")), "with SyncConfig.quantize"),
    (dict(sync=SyncConfig(rollout_dtype="bfloat16")), "rollout_dtype='bfloat16'"),
    (dict(placement=None), "one device per pool"),
    (dict(engine=EngineConfig(cache_dtype="bfloat16")), "EngineConfig.cache_dtype='bfloat16'"),
    (dict(engine=EngineConfig(attention_impl="pallas_gpu")), "only the reference paged attention"),
])
def test_configs_bitwise_cannot_hold_for_are_one_line(tmp_path, overrides, message):
    placement = overrides.pop("placement", ONE)
    cfg = _config(tmp_path, "bitwise", "float32", **overrides)
    if placement is None:
        cfg = cfg.replace(placement=tiny_rl_config(tmp_path, cfg.algorithm).placement)
    with pytest.raises(ValueError, match=message):
        prepare(cfg)


def test_a_run_sizes_the_window_to_its_sequences(tmp_path):
    """The attention window is the run's sequence length rounded up to 64 slots (not the model's
    whole context), for the trainer and the engine alike; a window set on the model is kept."""
    cfg = _config(tmp_path, "bitwise", "float32")
    cfg = cfg.replace(model=cfg.model.replace(max_position_embeddings=512))
    spec, _ = prepare(cfg)
    assert spec.lengths.seq_len <= 64
    assert spec.model.attention_window == spec.rollout_model.attention_window == 64
    kept = cfg.replace(model=cfg.model.replace(bitwise_window=128))
    assert prepare(kept)[0].model.attention_window == 128
