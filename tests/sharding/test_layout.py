"""Layouts: specs per preset, divisibility errors and the kv_heads fallback, gin files = presets,
RL-job layout and mesh selection by name, and a one-line error for each bad layout config."""

import logging
from pathlib import Path

import gin
import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from gin_presets import assert_scoped_gin_files_equal_presets
from tpurl.commands.gin_config import parse_gin
from tpurl.models import abstract_model, preset
from tpurl.sharding.layout import Layout
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS, MESH_PRESETS, layout_preset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = preset("tiny", num_heads=8, head_dim=8)  # 8 query heads, 2 KV heads


def _mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


def _by_path(layout, mesh, cfg=TINY):
    return {p.path: p for p in layout.placements(abstract_model(cfg), mesh)}


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_train_layout_specs():
    pl = _by_path(layout_preset("fsdp_tp"), _mesh(2, 2, 2))
    assert pl["layers.q_proj"].spec == P(None, "fsdp", "tensor", None)  # W_q[L, D_fsdp, N_tp, H]
    assert pl["layers.o_proj"].spec == P(None, "tensor", None, "fsdp")
    assert pl["layers.down_proj"].spec == P(None, "tensor", "fsdp")
    assert pl["embed_tokens"].spec == P("tensor", "fsdp")
    assert pl["layers.input_layernorm"].spec == P(None, None)
    assert pl["layers.q_proj"].shard_shape == (2, 32, 4, 8)
    assert all(not p.fallbacks for p in pl.values())


def test_compute_spec_drops_gathered_axes_but_keeps_batch():
    lay, mesh = layout_preset("fsdp_tp"), _mesh(2, 2, 2)
    assert lay.spec(("embed", "mlp"), mesh, compute=True) == P(None, "tensor")
    assert lay.spec(("batch", "seq", "embed"), mesh, compute=True) == P(("data", "fsdp"), None, None)
    fsdp = layout_preset("fsdp")
    assert fsdp.spec(("embed", "mlp"), mesh) == P(("fsdp", "tensor"), None)
    assert fsdp.spec(("embed", "mlp"), mesh, compute=True) == P(None, None)


def test_rollout_layouts_replicate_over_replicas():
    mesh = _mesh(2, 2, 2)
    tp = _by_path(layout_preset("tp"), mesh)
    assert tp["layers.gate_proj"].spec == P(None, None, ("fsdp", "tensor"))
    assert tp["embed_tokens"].spec == P(("fsdp", "tensor"), None)
    rep = _by_path(layout_preset("tp_replicas"), mesh)
    assert rep["layers.gate_proj"].spec == P(None, None, "tensor")
    assert layout_preset("tp_replicas").spec(("batch", None), mesh) == P(("data", "fsdp"), None)
    assert all(p.spec == P(*(None,) * len(p.shape)) for p in _by_path(layout_preset("dp"), mesh).values())


def test_axes_missing_from_the_mesh_or_of_size_one_are_dropped():
    lay = layout_preset("fsdp_tp")
    assert lay.spec(("embed", "mlp"), AbstractMesh((8,), ("fsdp",))) == P("fsdp", None)
    assert lay.spec(("embed", "mlp"), _mesh(1, 1, 8)) == P(None, "tensor")


def test_indivisible_dim_is_a_one_line_error_naming_parameter_dim_size_and_axis():
    small = preset("tiny")  # 4 query heads
    with pytest.raises(ValueError) as e:
        layout_preset("tp_replicas").placements(abstract_model(small), _mesh(1, 1, 8))
    msg = _one_line(e)
    for part in ("parameter layers.o_proj", "dim 1 (heads)", "size 4", "('tensor',)", "size 8"):
        assert part in msg, msg


def test_kv_heads_fall_back_to_replication_and_are_reported(caplog, devices):
    # 2 KV heads on tensor=4: the K/V projections are replicated over tensor, nothing else changes.
    pl = _by_path(layout_preset("fsdp_tp"), _mesh(1, 2, 4))
    assert pl["layers.k_proj"].spec == P(None, "fsdp", None, None)
    assert pl["layers.q_proj"].spec == P(None, "fsdp", "tensor", None)
    assert pl["layers.k_proj"].fallbacks == ("kv_heads (size 2) replicated over tensor (size 4): does not divide",)
    # tp over fsdp*tensor = 2*4: KV heads keep the fsdp split (aligned with their query heads).
    tp = _by_path(layout_preset("tp"), _mesh(1, 2, 4))
    assert tp["layers.v_proj"].spec == P(None, None, "fsdp", None)
    assert tp["layers.o_proj"].spec == P(None, ("fsdp", "tensor"), None, None)
    mesh = make_mesh(MeshConfig(shape=(1, 2, 4)))
    with caplog.at_level(logging.WARNING, logger="tpurl.sharding.layout"):
        shardings = layout_preset("fsdp_tp").param_shardings(abstract_model(TINY), mesh)
    assert shardings["layers"]["k_proj"] == NamedSharding(mesh, P(None, "fsdp", None, None))
    assert sum("layers.k_proj" in r.getMessage() for r in caplog.records) == 1


def test_batch_that_does_not_divide(devices):
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    assert layout_preset("fsdp_tp").batch_sharding(mesh, 3, batch_size=8).spec == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match=r"batch dim 0 \(batch\) of size 6 does not divide over mesh axes "
                                         r"\('data', 'fsdp', 'tensor'\) \(size 8\)") as e:
        layout_preset("dp").batch_sharding(mesh, 2, batch_size=6)
    _one_line(e)


def test_compute_constraint_on_an_odd_batch_drops_axes_instead_of_failing(devices):
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    constrain = layout_preset("dp").compute_constrain(mesh)
    x = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    y = jax.jit(lambda x: constrain(2 * x, ("batch", None)))(x)
    np.testing.assert_array_equal(np.asarray(y), 2 * x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)  # 6 rows: data=2 divides, data*fsdp=4 does not


def test_no_fallback_when_disabled():
    strict = Layout(name="strict", rules=layout_preset("fsdp_tp").rules, replicate_indivisible=())
    with pytest.raises(ValueError, match=r"parameter layers.k_proj dim 2 \(kv_heads\) of size 2") as e:
        strict.placements(abstract_model(TINY), _mesh(1, 2, 4))
    _one_line(e)


def test_param_shardings_match_placements(devices):
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    state = abstract_model(TINY)
    lay = layout_preset("fsdp_tp")
    shardings = lay.param_shardings(state, mesh)
    for p in lay.placements(state, mesh):
        sharding = shardings
        for key in p.path.split("."):
            sharding = sharding[key]
        assert sharding == NamedSharding(mesh, p.spec)
        assert sharding.shard_shape(p.shape) == p.shard_shape


@pytest.mark.parametrize("kw, match", [
    (dict(rules=(("embd", ("fsdp",)),)), "unknown logical axis 'embd'"),
    (dict(rules=(("embed", ("fsdpp",)),)), "unknown mesh axis 'fsdpp'"),
    (dict(rules=(("embed", "fsdp"),)), "must be a tuple of mesh axes"),
    (dict(rules=(("embed", ("fsdp",)), ("embed", ("tensor",)))), "has two rules"),
    (dict(rules=(("embed", ("fsdp", "fsdp")),)), "repeats a mesh axis"),
    (dict(gathered_at_use=("fdsp",)), "gathered_at_use names unknown mesh axis"),
    (dict(replicate_indivisible=("kv_head",)), "replicate_indivisible names unknown logical axis"),
    (dict(rules=("embed",)), "pairs"),
])
def test_bad_layout_configs(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        Layout(name="bad", **kw)
    _one_line(e)


def test_unknown_layout_preset():
    with pytest.raises(ValueError, match="unknown layout preset 'zero3'"):
        layout_preset("zero3")


def test_gin_layout_files_equal_python_presets():
    assert_scoped_gin_files_equal_presets("layouts", "tpurl.Layout", LAYOUT_PRESETS, layout_preset)


def test_rl_job_layouts_and_meshes_from_gin_by_name_and_by_file():
    try:
        parse_gin([], ['tpurl.RLConfig.train_layout = "fsdp"', 'tpurl.RLConfig.rollout_layout = "tp_replicas"'])
        cfg = gin.get_configurable("tpurl.RLConfig")()
        assert (cfg.train_layout, cfg.rollout_layout) == (LAYOUT_PRESETS["fsdp"], LAYOUT_PRESETS["tp_replicas"])
        parse_gin([str(CONFIGS / "layouts" / "tp_replicas.gin"), str(CONFIGS / "meshes" / "fsdp_tp4.gin")],
                  ["tpurl.RLConfig.rollout_layout = @tp_replicas/tpurl.Layout()",
                   "tpurl.RLConfig.placement = @tpurl.PlacementConfig()",
                   "tpurl.PlacementConfig.rollout_mesh = @fsdp_tp4/tpurl.MeshConfig()"])
        cfg = gin.get_configurable("tpurl.RLConfig")()
        assert cfg.rollout_layout == LAYOUT_PRESETS["tp_replicas"]
        assert cfg.placement.rollout_mesh == MESH_PRESETS["fsdp_tp4"]
        assert cfg.train_layout == LAYOUT_PRESETS["fsdp_tp"]  # the default train layout
        assert cfg.placement.train_mesh == MESH_PRESETS["fsdp"]  # the default mesh
    finally:
        gin.clear_config()


@pytest.mark.parametrize("kw, match", [
    (dict(train_layout="fsdp-tp"), r"RLConfig.train_layout: unknown layout preset 'fsdp-tp'"),
    (dict(rollout_layout=3), r"RLConfig.rollout_layout=3 must be a Layout or a str"),
])
def test_bad_rl_job_layouts(kw, match):
    from tpurl.rl.config import RLConfig

    with pytest.raises(ValueError, match=match) as e:
        RLConfig(**kw)
    _one_line(e)
