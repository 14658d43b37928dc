"""Helpers shared by the sync tests: the five layouts every sync must connect (built from plain
rules so these tests do not depend on the layout presets), placement, and the exactness check."""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import host_guard
from tpurl.sharding.layout import Layout
from tpurl.sync import cross_process, reshard

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
    """Fail if the guarded sync moves weights through the host (`host_guard.no_host_round_trip`
    over the programs of `tpurl.sync.reshard` and `tpurl.sync.cross_process`)."""
    with host_guard.no_host_round_trip(reshard, cross_process) as seen:
        yield seen
    # Every guarded sync in these tests casts to bf16, so it runs programs: none checked would
    # mean the check looked at nothing.
    assert seen.programs, "the guarded sync ran no program of tpurl.sync"


def place(params, layout, mesh):
    return jax.device_put(params, LAYOUTS[layout].param_shardings(params, mesh))


def assert_synced(train, rollout, shardings, dtype=jnp.bfloat16):
    """Every rollout leaf has the target sharding and dtype and equals the numpy cast of its train leaf."""
    for x, y, s in zip(jax.tree.leaves(train), jax.tree.leaves(rollout), jax.tree.leaves(shardings)):
        assert y.dtype == dtype
        assert y.sharding.is_equivalent_to(s, y.ndim), (y.sharding, s)
        expected = bf16_reference(x) if dtype == jnp.bfloat16 else np.asarray(x)
        np.testing.assert_array_equal(np.asarray(y), expected)
