"""Dropping an old copy of weights before a sync: `delete_unshared` frees every array it does not
share with the kept tree, even when the two share a buffer without being the same array object
(`device_put` of a single-device array into a replicated sharding aliases the source)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.memory import MemoryAccount
from tpurl.sync import account_metrics, delete_unshared


def test_delete_unshared_keeps_what_the_kept_tree_holds(mesh):
    sharded = NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    kept_leaf = jax.device_put(jnp.arange(16.0), sharded)
    single = jax.device_put(jnp.ones((4,)), mesh.devices.flat[0])
    alias = jax.device_put(single, NamedSharding(mesh, P()))  # shares `single`'s buffer on device 0
    own = jax.device_put(jnp.zeros((8, 2)), sharded)
    old = {"same": kept_leaf, "alias": alias, "own": own}
    freed = delete_unshared(old, keep={"w": kept_leaf, "s": single})
    assert own.is_deleted() and freed == 8 * 2 * 4
    assert not kept_leaf.is_deleted() and not alias.is_deleted() and not single.is_deleted()
    np.testing.assert_array_equal(np.asarray(kept_leaf), np.arange(16.0))
    assert delete_unshared(old, keep={}) > 0 and kept_leaf.is_deleted()  # nothing kept: all go


def test_account_metrics_names_every_group_of_every_phase():
    accounts = [MemoryAccount(phase="offload", live={"device": 10}, groups={"kv_pool": {"device": 6},
                                                                          "opt_state": {"pinned_host": 4}}),
                MemoryAccount(phase="onload:released", live={}, groups={"kv_pool": {}})]
    assert account_metrics(accounts) == {"memory/offload/kv_pool_device_bytes": 6.0,
                                         "memory/offload/opt_state_device_bytes": 0.0,
                                         "memory/onload_released/kv_pool_device_bytes": 0.0}
