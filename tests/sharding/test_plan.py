"""Layout arithmetic (bytes per device, sync traffic) against JAX's own index maps, and the CLI."""

from pathlib import Path

import gin
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from tpurl.models import abstract_model, preset
from tpurl.sharding import cli
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.plan import device_coords, human_bytes, layout_bytes_per_device, shard_bounds, sync_cost
from tpurl.sharding.presets import ShardingConfig, layout_preset

TINY = preset("tiny", num_heads=8, head_dim=8)


def _abstract(*sizes):
    return AbstractMesh(tuple(sizes), ("data", "fsdp", "tensor"))


def _reference_sync_bytes(src, dst, mesh, itemsize):
    """Per device: elements of its rollout shard it did not hold in the train layout (numpy masks)."""
    total, per_device = 0, {d: 0 for d in mesh.devices.flat}
    for p, q in zip(src, dst):
        have = NamedSharding(mesh, p.spec).devices_indices_map(p.shape)
        want = NamedSharding(mesh, q.spec).devices_indices_map(q.shape)
        for dev in mesh.devices.flat:
            h, w = np.zeros(p.shape, bool), np.zeros(q.shape, bool)
            h[have[dev]] = True
            w[want[dev]] = True
            n = int((w & ~h).sum()) * itemsize
            per_device[dev] += n
            total += n
    return total, max(per_device.values())


@pytest.mark.parametrize("shape, train, rollout", [
    ((2, 2, 2), "fsdp_tp", "tp"),
    ((1, 2, 4), "fsdp_tp", "tp_replicas"),
    ((4, 1, 2), "fsdp", "tp"),
])
def test_sync_cost_matches_jax_index_maps(devices, shape, train, rollout):
    mesh = make_mesh(MeshConfig(shape=shape))
    state = abstract_model(TINY)
    src, dst = layout_preset(train).placements(state, mesh), layout_preset(rollout).placements(state, mesh)
    cost = sync_cost(src, dst, dict(mesh.shape), dst_dtype="bfloat16")
    assert (cost.total_bytes, cost.max_device_bytes) == _reference_sync_bytes(src, dst, mesh, 2)
    assert cost.total_bytes > 0
    assert "layers.input_layernorm" in cost.local_only  # replicated in both: no traffic


def test_shard_bounds_match_jax_index_maps(devices):
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    sizes = dict(mesh.shape)
    for name in ("tp", "fsdp", "fsdp_tp"):
        for p in layout_preset(name).placements(abstract_model(TINY), mesh):
            index_map = NamedSharding(mesh, p.spec).devices_indices_map(p.shape)
            for coords, dev in zip(device_coords(sizes), mesh.devices.flat):
                want = [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index_map[dev], p.shape)]
                assert shard_bounds(p, sizes, coords) == want, (name, p.path)


def test_same_layout_sync_moves_nothing():
    placements = layout_preset("fsdp_tp").placements(abstract_model(TINY), _abstract(2, 2, 2))
    cost = sync_cost(placements, placements, {"data": 2, "fsdp": 2, "tensor": 2})
    assert cost.total_bytes == 0 and len(cost.local_only) == len(placements)


def test_bytes_per_device():
    mesh = _abstract(1, 8, 1)
    state = abstract_model(TINY)
    full = TINY.num_params() * 4
    assert layout_bytes_per_device(layout_preset("dp").placements(state, mesh)) == full
    # fsdp shards every matrix (all have an embed dim) 8 ways; only the norms stay whole.
    norms = (2 * TINY.num_layers + 1) * TINY.hidden_size * 4
    assert layout_bytes_per_device(layout_preset("fsdp").placements(state, mesh)) == (full - norms) // 8 + norms


def test_cli_prints_specs_bytes_and_sync(capsys):
    rc = cli.main(["--model", "tiny", "--mesh", "2,2,2", "--devices", "8", "--train", "fsdp_tp",
                   "--rollout", "tp_replicas", "--rollout_dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "train layout 'fsdp_tp'" in out and "rollout layout 'tp_replicas'" in out
    assert "P(None, 'fsdp', 'tensor', None)" in out  # q_proj in the train layout
    state = abstract_model(preset("tiny"))
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    cost = sync_cost(layout_preset("fsdp_tp").placements(state, _abstract(2, 2, 2)),
                     layout_preset("tp_replicas").placements(state, _abstract(2, 2, 2)), sizes, "bfloat16")
    assert f"moves {human_bytes(cost.total_bytes)} in total" in out


def test_cli_reads_gin(tmp_path, capsys):
    configs = Path(__file__).resolve().parents[2] / "configs"
    job = tmp_path / "job.gin"
    job.write_text(f'include "{configs / "layouts" / "tp.gin"}"\n'
                   'tpurl.model_preset.name = "tiny"\n'
                   'tpurl.model_preset.num_heads = 8\n'
                   'tpurl.model_preset.head_dim = 8\n'
                   'tpurl.ShardingConfig.mesh = "fsdp_tp2"\n'
                   'tpurl.ShardingConfig.rollout_layout = @tp/tpurl.Layout()\n')
    try:
        assert cli.main(["--gin_file", str(job), "--devices", "8"]) == 0
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    assert "mesh data=1 x fsdp=4 x tensor=2 (8 devices)" in out
    assert "rollout layout 'tp'" in out and "P(None, None, ('fsdp', 'tensor'))" in out
    assert "note: kv_heads (size 2) replicated over fsdp*tensor (size 8)" in out  # 2 KV heads, 8-way TP


@pytest.mark.parametrize("argv, match", [
    (["--model", "tiny", "--mesh", "2,2,3", "--devices", "8"], "has 12 devices but 8"),
    (["--model", "tiny", "--mesh", "1,1,8", "--devices", "8", "--rollout", "tp"], "parameter layers.o_proj dim 1"),
    (["--model", "tiny", "--mesh", "big"], "neither a mesh preset"),
    (["--mesh", "fsdp"], "no model"),
    (["--model", "tiny", "--rollout", "vllm"], "unknown layout preset 'vllm'"),
])
def test_cli_bad_input_is_one_line(capsys, argv, match):
    try:
        assert cli.main(argv) == 2
    finally:
        gin.clear_config()
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err, err


def test_sharding_config_default_is_train_fsdp_tp_rollout_tp():
    cfg = ShardingConfig()
    assert (cfg.train_layout.name, cfg.rollout_layout.name, cfg.mesh.shape) == ("fsdp_tp", "tp", (1, -1, 1))
