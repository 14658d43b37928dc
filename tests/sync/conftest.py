"""Shared fixtures of the sync tests: a tiny model whose head counts divide 4-way tensor
parallelism, and the five layouts every sync must connect (built from plain rules so these tests
do not depend on the layout presets)."""

import numpy as np
import ml_dtypes
import pytest
from flax import nnx

from tpurl.models import init_model, preset
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh

TP = ("heads", "kv_heads", "mlp", "vocab")

LAYOUTS = {
    "dp": Layout(name="dp", rules=(("batch", ("data", "fsdp", "tensor")),)),
    "fsdp": Layout(name="fsdp", rules=(("embed", ("data", "fsdp", "tensor")), ("batch", ("data", "fsdp", "tensor")))),
    "fsdp_tp": Layout(name="fsdp_tp", rules=(("embed", ("fsdp",)), ("batch", ("data", "fsdp")))
                      + tuple((t, ("tensor",)) for t in TP)),
    "tp": Layout(name="tp", rules=tuple((t, ("fsdp", "tensor")) for t in TP)),
    "tp_replicas": Layout(name="tp_replicas", rules=tuple((t, ("tensor",)) for t in TP)),
}


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


def bf16_reference(x) -> np.ndarray:
    """The independent reference: numpy (ml_dtypes, round-to-nearest-even) cast of the fp32 values."""
    return np.asarray(x).astype(ml_dtypes.bfloat16)
