"""Fixtures of the sync tests: a tiny model whose head counts divide 4-way tensor parallelism, its
fp32 params, and a (data=2, fsdp=2, tensor=2) mesh."""

import pytest
from flax import nnx

from tpurl.models import init_model, preset
from tpurl.sharding.layout import MeshConfig, make_mesh


@pytest.fixture(scope="session")
def model_cfg():
    return preset("tiny", num_heads=8, num_kv_heads=4, head_dim=8)


@pytest.fixture(scope="session")
def params(model_cfg):
    """fp32 params as an `nnx.State` (unsharded; tests place them)."""
    return nnx.split(init_model(model_cfg, 0))[1]


@pytest.fixture(scope="session")
def mesh(devices):
    return make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(2, 2, 2)), devices)
