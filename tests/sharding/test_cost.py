"""Layout arithmetic (bytes per device, sync traffic) against JAX's own index maps, and the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import gin
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from tpurl.commands import layouts as cli
from tpurl.models import abstract_model, preset
from tpurl.sharding.cost import device_coords, human_bytes, layout_bytes_per_device, shard_bounds, sync_cost
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset

TINY = preset("tiny", num_heads=8, head_dim=8)


def _abstract(*sizes):
    return AbstractMesh(tuple(sizes), ("data", "fsdp", "tensor"))


def _reference_sync_bytes(src, dst, src_mesh, dst_mesh, itemsize):
    """Per rollout device: elements of its shard that the same device did not hold in the train
    layout, from JAX's own index maps and numpy masks."""
    per_device = {d.id: 0 for d in dst_mesh.devices.flat}
    for p, q in zip(src, dst):
        have = {d.id: idx for d, idx in NamedSharding(src_mesh, p.spec).devices_indices_map(p.shape).items()}
        want = NamedSharding(dst_mesh, q.spec).devices_indices_map(q.shape)
        for dev, idx in want.items():
            h, w = np.zeros(p.shape, bool), np.zeros(q.shape, bool)
            if dev.id in have:
                h[have[dev.id]] = True
            w[idx] = True
            per_device[dev.id] += int((w & ~h).sum()) * itemsize
    return sum(per_device.values()), max(per_device.values())


@pytest.mark.parametrize("train_shape, rollout_shape, train, rollout, split", [
    ((2, 2, 2), None, "fsdp_tp", "tp", None),
    ((1, 2, 4), None, "fsdp_tp", "tp_replicas", None),
    ((4, 1, 2), None, "fsdp", "tp", None),
    ((1, 4, 2), (2, 1, 4), "fsdp_tp", "tp_replicas", None),  # colocated, two mesh shapes
    ((1, 2, 2), (2, 1, 2), "fsdp_tp", "tp", 4),  # disaggregated: 4 train + 4 rollout devices
])
def test_sync_cost_matches_jax_index_maps(devices, train_shape, rollout_shape, train, rollout, split):
    src_devs, dst_devs = (devices, devices) if split is None else (devices[:split], devices[split:])
    src_mesh = make_mesh(MeshConfig(shape=train_shape), src_devs)
    dst_mesh = src_mesh if rollout_shape is None else make_mesh(MeshConfig(shape=rollout_shape), dst_devs)
    state = abstract_model(TINY)
    src, dst = layout_preset(train).placements(state, src_mesh), layout_preset(rollout).placements(state, dst_mesh)
    cost = sync_cost(src, dst, src_mesh, dst_mesh, dst_dtype="bfloat16")
    assert (cost.total_bytes, cost.max_device_bytes) == _reference_sync_bytes(src, dst, src_mesh, dst_mesh, 2)
    if split is None:
        assert "layers.input_layernorm" in cost.local_only  # replicated in both: no traffic
    else:
        assert cost.total_bytes == 4 * sum(p.bytes_per_device // 2 for p in dst) and not cost.local_only


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
    cost = sync_cost(placements, placements, _abstract(2, 2, 2))
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
    cost = sync_cost(layout_preset("fsdp_tp").placements(state, _abstract(2, 2, 2)),
                     layout_preset("tp_replicas").placements(state, _abstract(2, 2, 2)), _abstract(2, 2, 2),
                     dst_dtype="bfloat16")
    assert f"moves {human_bytes(cost.total_bytes)} in total" in out


def test_cli_reads_gin(tmp_path, capsys):
    configs = Path(__file__).resolve().parents[2] / "configs"
    job = tmp_path / "job.gin"
    job.write_text(f'include "{configs / "layouts" / "tp.gin"}"\n'
                   'tpurl.RLConfig.model = @tpurl.model_preset()\n'
                   'tpurl.model_preset.name = "tiny"\n'
                   'tpurl.model_preset.num_heads = 8\n'
                   'tpurl.model_preset.head_dim = 8\n'
                   'tpurl.RLConfig.rollout_layout = @tp/tpurl.Layout()\n')
    try:
        assert cli.main(["--gin_file", str(job), "--devices", "8", "--mesh", "fsdp_tp2"]) == 0
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    assert "on mesh data=1 x fsdp=4 x tensor=2 (8 devices)" in out
    assert "rollout layout 'tp'" in out and "P(None, None, ('fsdp', 'tensor'))" in out
    assert "note: kv_heads (size 2) replicated over fsdp*tensor (size 8)" in out  # 2 KV heads, 8-way TP


def test_cli_plans_a_disaggregated_rl_job(tmp_path, capsys):
    """An `RLConfig` job (the rl package's config) is planned with its own meshes and device split."""
    job = tmp_path / "rl.gin"
    job.write_text('''
tpurl.RLConfig.model = "tiny"
tpurl.RLConfig.train_layout = "fsdp_tp"
tpurl.RLConfig.rollout_layout = "tp_replicas"
tpurl.RLConfig.placement = @tpurl.PlacementConfig()
tpurl.PlacementConfig.mode = "disaggregated"
tpurl.PlacementConfig.train_devices = 4
tpurl.PlacementConfig.train_mesh = @train/tpurl.MeshConfig()
train/tpurl.MeshConfig.shape = (1, 2, 2)
tpurl.PlacementConfig.rollout_mesh = @rollout/tpurl.MeshConfig()
rollout/tpurl.MeshConfig.shape = (2, 1, 2)
''')
    try:
        assert cli.main(["--gin_file", str(job), "--devices", "8"]) == 0
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    assert "disaggregated" in out
    assert "train layout 'fsdp_tp' on mesh data=1 x fsdp=2 x tensor=2 (4 devices)" in out
    assert "rollout layout 'tp_replicas' on mesh data=2 x fsdp=1 x tensor=2 (4 devices)" in out
    rollout = layout_preset("tp_replicas").placements(abstract_model(preset("tiny")), _abstract(2, 1, 2))
    # Disjoint pools: every rollout device receives its whole shard.
    assert f"moves {human_bytes(4 * layout_bytes_per_device(rollout))} in total" in out


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


@pytest.mark.slow
def test_cli_from_flags_imports_no_other_subsystem():
    """`tpurl layouts` from flags only needs models + sharding: it must not import the rollout
    engine, the RL loop, ... (through `tpurl.commands.gin_config`), so a broken subsystem cannot break it."""
    code = ("import sys; from tpurl.commands import layouts as cli; "
            "rc = cli.main(['--model', 'tiny', '--mesh', '1,2,2', '--devices', '4']); "
            "bad = [m for m in ('tpurl.commands.gin_config', 'tpurl.rl', 'tpurl.generate', 'tpurl.sync', 'tpurl.train') "
            "if m in sys.modules]; "
            "assert rc == 0 and not bad, (rc, bad)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
