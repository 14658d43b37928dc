"""Helpers shared by the sync tests: the five layouts every sync must connect (built from plain
rules so these tests do not depend on the layout presets), placement, and the exactness check."""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tpurl.sharding.layout import Layout

TP = ("heads", "kv_heads", "mlp", "vocab")

LAYOUTS = {
    "dp": Layout(name="dp", rules=(("batch", ("data", "fsdp", "tensor")),)),
    "fsdp": Layout(name="fsdp", rules=(("embed", ("data", "fsdp", "tensor")), ("batch", ("data", "fsdp", "tensor")))),
    "fsdp_tp": Layout(name="fsdp_tp", rules=(("embed", ("fsdp",)), ("batch", ("data", "fsdp")))
                      + tuple((t, ("tensor",)) for t in TP)),
    "tp": Layout(name="tp", rules=tuple((t, ("fsdp", "tensor")) for t in TP)),
    "tp_replicas": Layout(name="tp_replicas", rules=tuple((t, ("tensor",)) for t in TP)),
}


def bf16_reference(x) -> np.ndarray:
    """The independent reference: numpy (ml_dtypes, round-to-nearest-even) cast of the fp32 values."""
    return np.asarray(x).astype(ml_dtypes.bfloat16)


@contextlib.contextmanager
def no_host_round_trip():
    """Fail on any device->host copy (even explicit) and any implicit host->device transfer."""
    with jax.transfer_guard("disallow"), jax.transfer_guard_device_to_host("disallow_explicit"):
        yield


def place(params, layout, mesh):
    return jax.device_put(params, LAYOUTS[layout].param_shardings(params, mesh))


def assert_synced(train, rollout, shardings, dtype=jnp.bfloat16):
    """Every rollout leaf has the target sharding and dtype and equals the numpy cast of its train leaf."""
    for x, y, s in zip(jax.tree.leaves(train), jax.tree.leaves(rollout), jax.tree.leaves(shardings)):
        assert y.dtype == dtype
        assert y.sharding.is_equivalent_to(s, y.ndim), (y.sharding, s)
        expected = bf16_reference(x) if dtype == jnp.bfloat16 else np.asarray(x)
        np.testing.assert_array_equal(np.asarray(y), expected)
