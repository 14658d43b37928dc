"""Orbax checkpoints of a run's state: exact round trip into shardings, atomic latest, structure checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.checkpoint import Checkpointer
from tpurl.models import init_model, preset
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes


def test_round_trip_sharded_state(tmp_path):
    mesh = make_mesh(MeshConfig(axes=("fsdp",), shape=(8,)))
    layout = Layout(name="fsdp", rules=(("embed", ("fsdp",)),))
    _, params = nnx.split(init_model(preset("tiny", vocab_size=16), seed=1))
    params = jax.device_put(params, layout.param_shardings(params, mesh))
    opt_state = optax.adam(1e-3).init(params)
    tree = {"params": params, "opt": opt_state, "rng": jax.random.key_data(jax.random.key(3)),
            "step": jnp.asarray(7, jnp.int32)}
    ck = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=1)
    for step in (2, 3):
        ck.save(step, tree, {"cursor": 10 * step, "policy_version": step})
    assert ck.all_steps() == [3] and ck.latest_step() == 3  # older ones are pruned
    restored, meta = ck.restore(3, tree)
    assert meta == {"cursor": 30, "policy_version": 3}
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(a, jax.Array) and a.ndim:
            assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
    # Restoring into a different layout (e.g. fewer devices) re-shards.
    single = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                          tree)
    restored_r, _ = ck.restore(3, single)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(restored_r))
    np.testing.assert_array_equal(np.asarray(restored_r["params"]["embed_tokens"][...]),
                                  np.asarray(params["embed_tokens"][...]))
    with pytest.raises(ValueError, match="different structure"):
        ck.restore(3, {"params": params})
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 9"):
        ck.restore(9, tree)
    ck.close()
