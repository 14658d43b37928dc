"""Mesh construction: sizes, -1, device sets, and a one-line error for each bad config."""

import jax
import pytest

from gin_presets import assert_scoped_gin_files_equal_presets
from tpurl.sharding.mesh import MeshConfig, make_mesh, mesh_devices
from tpurl.sharding.presets import MESH_PRESETS, mesh_preset


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg, msg
    return msg


def test_minus_one_takes_the_rest(devices):
    mesh = make_mesh(MeshConfig(shape=(2, -1, 2)))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_one_and_two_axis_meshes(devices):
    assert dict(make_mesh(MeshConfig(axes=("fsdp",), shape=(-1,))).shape) == {"fsdp": 8}
    assert dict(make_mesh(MeshConfig(axes=("fsdp", "tensor"), shape=(2, 4))).shape) == {"fsdp": 2, "tensor": 4}


def test_device_subset_for_a_disaggregated_pool(devices):
    pool = devices[4:]
    mesh = make_mesh(MeshConfig(shape=(1, 2, 2)), devices=pool)
    assert {d.id for d in mesh.devices.flat} == {d.id for d in pool}


def test_scope_picks_global_or_local_devices(devices):
    assert mesh_devices(MeshConfig()) == jax.devices()
    assert mesh_devices(MeshConfig(scope="local")) == jax.local_devices()
    with pytest.raises(ValueError, match="scope") as e:
        MeshConfig(scope="world")
    _one_line(e)


def test_product_must_match_device_count(devices):
    with pytest.raises(ValueError, match=r"has 12 devices but 8 are available") as e:
        make_mesh(MeshConfig(shape=(2, 2, 3)))
    _one_line(e)


def test_minus_one_must_divide(devices):
    with pytest.raises(ValueError, match="not divisible by 3") as e:
        make_mesh(MeshConfig(shape=(3, -1, 1)))
    _one_line(e)


def test_unknown_axis_name():
    with pytest.raises(ValueError, match="unknown mesh axis 'tensr'") as e:
        MeshConfig(axes=("data", "fsdp", "tensr"), shape=(1, -1, 1))
    _one_line(e)


def test_two_minus_ones():
    with pytest.raises(ValueError, match="more than one -1") as e:
        MeshConfig(shape=(-1, -1, 1))
    _one_line(e)


@pytest.mark.parametrize("kw, match", [
    (dict(axes=("data", "fsdp"), shape=(1, 2, 4)), "differ in length"),
    (dict(axes=("fsdp", "fsdp"), shape=(2, 4)), "repeats an axis"),
    (dict(shape=(1, 0, 8)), "positive or -1"),
    (dict(shape=(1, 2.5, 1)), "integers"),
    (dict(axes="fsdp", shape=(8,)), "must be sequences"),
])
def test_other_bad_mesh_configs(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        MeshConfig(**kw)
    _one_line(e)


def test_gin_mesh_files_equal_python_presets():
    assert_scoped_gin_files_equal_presets("meshes", "tpurl.MeshConfig", MESH_PRESETS, mesh_preset)
    with pytest.raises(ValueError, match="unknown mesh preset 'huge'"):
        mesh_preset("huge")
