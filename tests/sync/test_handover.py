"""Colocated memory handover, asserted from the live-array account: during rollout no optimizer
state (nor, optionally, fp32 master params) on device; during the update no KV pool on device."""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl import memory
from tpurl.memory import live_bytes_by_memory_kind
from tpurl.memory import resident_bytes, tree_bytes_by_memory_kind
from tpurl.sync import ColocatedHandover, HandoverConfig, SyncConfig, sync_weights
from tpurl.sync.handover import device_bytes
from tpurl.sync.offload import to_device_memory, to_host_memory

from sync_helpers import LAYOUTS


def _train_state(params, mesh):
    """fp32 params in the train layout and a non-trivial AdamW state with a replicated count."""
    # A private copy first: device_put of a single-device array into a replicated sharding aliases
    # its buffer, and the handover deletes what it parks (which would delete the shared fixture).
    train = jax.device_put(jax.tree.map(jnp.copy, params), LAYOUTS["fsdp_tp"].param_shardings(params, mesh))
    opt = optax.adamw(1e-3)
    state = opt.init(train)
    state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())) if x.ndim == 0 else x, state)
    # One update makes the moments non-zero (the "gradients" are the params themselves).
    state = jax.jit(lambda s, p: opt.update(p, s, p)[1])(state, train)
    return train, state


def _kv_factory(mesh):
    def make():  # a KV-pool-like pytree: pages [L, K_tp, P, S, H] and a page table
        pages = jax.jit(lambda: jnp.ones((2, 4, 16, 8, 8), jnp.bfloat16),
                        out_shardings=NamedSharding(mesh, P(None, "tensor")))
        table = jax.jit(lambda: jnp.zeros((8, 4), jnp.int32), out_shardings=NamedSharding(mesh, P()))
        return {"k_pages": pages(), "v_pages": pages(), "page_table": table()}
    return make


def _deleter(tree):
    """The release callback of a pool owner that frees `tree`."""
    return lambda: [x.delete() for x in jax.tree.leaves(tree)]


def _snapshot(tree):
    return [(np.asarray(x), x.sharding) for x in jax.tree.leaves(tree)]


def _device(live):
    return live.get("device", 0)


@pytest.mark.slow
@pytest.mark.parametrize("offload_master", [False, True])
def test_colocated_step_hands_memory_over(params, mesh, offload_master):
    train, opt_state = _train_state(params, mesh)
    opt_before, train_before = _snapshot(opt_state), _snapshot(train)
    opt_bytes, train_bytes = device_bytes(opt_state), device_bytes(train)
    assert opt_bytes > 0

    base = live_bytes_by_memory_kind()
    rollout_params, _ = sync_weights(train, LAYOUTS["tp_replicas"].param_shardings(params, mesh),
                                     SyncConfig(rollout_dtype="bfloat16", method="device_put"))
    synced = live_bytes_by_memory_kind()
    assert _device(synced) == _device(base) + device_bytes(rollout_params)

    handover = ColocatedHandover(HandoverConfig(offload_master_params=offload_master))
    kv = handover.start_rollout(opt_state=opt_state, master_params=train, kv_factory=_kv_factory(mesh))
    during = live_bytes_by_memory_kind()
    parked = opt_bytes + (train_bytes if offload_master else 0)
    # Exactly the parked bytes left the device and the KV pool took their place; they sit in pinned host memory.
    assert _device(during) == _device(synced) - parked + device_bytes(kv)
    assert during.get("pinned_host", 0) == synced.get("pinned_host", 0) + parked
    assert all(x.is_deleted() for x in jax.tree.leaves(opt_state))
    account = handover.accounts[-1]
    assert account.phase == "offload"
    assert account.device_bytes("opt_state") == 0 and account.groups["opt_state"]["pinned_host"] == opt_bytes
    assert account.device_bytes("kv_pool") == device_bytes(kv) > 0
    assert ("master_params" in account.groups) == offload_master

    restored = handover.start_update(release=_deleter(kv))
    after = live_bytes_by_memory_kind()
    assert all(x.is_deleted() for x in jax.tree.leaves(kv))
    assert _device(after) == _device(synced)  # KV pool gone, parked tensors back
    assert after.get("pinned_host", 0) == synced.get("pinned_host", 0)  # host copies freed
    assert handover.accounts[-1].phase == "onload" and handover.accounts[-1].device_bytes("kv_pool") == 0
    for (value, sharding), x in zip(opt_before, jax.tree.leaves(restored["opt_state"])):
        np.testing.assert_array_equal(np.asarray(x), value)
        assert x.sharding == sharding
    if offload_master:
        for (value, sharding), x in zip(train_before, jax.tree.leaves(restored["master_params"])):
            np.testing.assert_array_equal(np.asarray(x), value)
            assert x.sharding == sharding
    else:
        assert set(restored) == {"opt_state"} and not any(x.is_deleted() for x in jax.tree.leaves(train))


@pytest.mark.slow
def test_kv_pool_still_referenced_is_a_leak(params, mesh):
    _, opt_state = _train_state(params, mesh)
    handover = ColocatedHandover()
    kv = handover.start_rollout(opt_state=opt_state, kv_factory=_kv_factory(mesh))
    with pytest.raises(RuntimeError, match="KV pool still holds"):
        handover.start_update()  # the caller still holds `kv` and did not release it
    kv_bytes = device_bytes(kv)
    before = live_bytes_by_memory_kind()
    del kv  # dropping the last reference frees it too
    restored = handover.start_update()
    assert _device(live_bytes_by_memory_kind()) == _device(before) - kv_bytes + device_bytes(restored["opt_state"])
    with pytest.raises(RuntimeError, match="twice"):
        handover.start_rollout(opt_state=restored["opt_state"])
        handover.start_rollout(opt_state=restored["opt_state"])


def test_offload_round_trip_keeps_values_and_can_reshard(mesh):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", "tensor")))
    count = jax.device_put(jnp.int32(7), jax.devices()[0])  # optax's count: one device
    tree = {"x": x, "count": count}
    host = to_host_memory(tree)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(host)} == {"pinned_host"}
    assert tree_bytes_by_memory_kind(host) == {"pinned_host": resident_bytes(x) + 4}
    back = to_device_memory(host, {"x": x.sharding, "count": NamedSharding(mesh, P())}, delete_source=True)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(host))
    assert back["count"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 0) and int(back["count"]) == 7
    np.testing.assert_array_equal(np.asarray(back["x"]), np.arange(64.0).reshape(8, 8))
    assert back["x"].sharding.memory_kind == "device"
    with pytest.raises(ValueError, match="deleted"):
        to_host_memory(host)
    # An array that appears twice is moved (and counted) once, and stays shared.
    twice = to_host_memory({"a": back["x"], "b": back["x"]})
    assert twice["a"] is twice["b"] and tree_bytes_by_memory_kind(twice) == {"pinned_host": resident_bytes(x)}


def test_handover_config_is_validated():
    with pytest.raises(ValueError, match="host_memory_kind"):
        HandoverConfig(host_memory_kind="device")


def test_parking_a_tree_that_shares_buffers_is_refused(params, mesh):
    train, opt_state = _train_state(params, mesh)
    handover = ColocatedHandover(HandoverConfig(offload_reference_params=True))
    same_objects = jax.tree.map(lambda x: x, train)
    with pytest.raises(ValueError, match="reference_params and master_params hold the same arrays"):
        handover.start_rollout(opt_state=opt_state, reference_params=same_objects, master_params=train)
    # New Array objects over the same device buffers.
    aliased = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards]), train)
    with pytest.raises(ValueError, match="reference_params shares device buffers"):
        handover.start_rollout(opt_state=opt_state, reference_params=aliased)
    # The rollout params of a free sync are the master params themselves: parking those is refused.
    masters = ColocatedHandover(HandoverConfig(offload_master_params=True))
    with pytest.raises(ValueError, match="master_params and rollout_params hold the same arrays"):
        masters.start_rollout(opt_state=opt_state, master_params=train, protect={"rollout_params": train})
    assert not masters.in_rollout
    assert not any(x.is_deleted() for x in jax.tree.leaves(train) + jax.tree.leaves(opt_state))


@pytest.mark.slow
def test_derived_decode_state_still_referenced_is_a_leak(params, mesh):
    """The engine donates the factory's pool at its first step; the state it returns holds the pool
    now, so an owner that frees the first state but keeps the derived one is caught too."""
    _, opt_state = _train_state(params, mesh)
    handover = ColocatedHandover()
    kv = handover.start_rollout(opt_state=opt_state, kv_factory=_kv_factory(mesh))
    step = jax.jit(lambda s: {k: v + 1 if k == "page_table" else v * 2 for k, v in s.items()}, donate_argnums=0)
    derived = step(kv)
    assert all(x.is_deleted() for x in jax.tree.leaves(kv))
    with pytest.raises(RuntimeError, match="a decode state is still referenced"):
        handover.start_update(release=_deleter(kv))
    restored = handover.start_update(release=_deleter(derived))
    assert handover.accounts[-1].device_bytes("kv_pool") == 0 and not handover.in_rollout
    assert not any(x.is_deleted() for x in jax.tree.leaves(restored["opt_state"]))


@pytest.mark.slow
def test_live_account_follows_deletion_donation_and_new_arrays(devices):
    """The account reads each array's buffers once and keeps them while it lives: a deleted or
    donated array must leave the account, a new array (even at a reused id) must enter it, and a
    per-shard view of an array must not count twice."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    sharded = NamedSharding(mesh, P("x"))

    def device_now():
        return live_bytes_by_memory_kind().get("device", 0)

    base = device_now()
    a = jax.device_put(np.ones((8, 256), np.float32), sharded)
    assert device_now() == base + a.nbytes
    np.asarray(a)  # leaves per-shard views of `a` among the live arrays
    [s.data for s in a.addressable_shards]
    assert device_now() == base + a.nbytes
    b = jax.jit(lambda x: x * 2, donate_argnums=0)(a)  # `a` is donated: its buffers are `b`'s now
    assert a.is_deleted() and device_now() == base + b.nbytes
    b.delete()
    assert device_now() == base
    for n in range(1, 4):  # new arrays of new sizes, each accounted while it lives
        c = jax.device_put(np.ones((8, 64 * n), np.float32), sharded)
        assert device_now() == base + c.nbytes
        del c
    assert device_now() == base


def test_a_kept_entry_of_a_dead_array_is_not_used_for_a_new_one_at_its_id():
    x = jax.device_put(np.ones((4, 4), np.float32))
    dead = jnp.zeros(3)
    stale = (weakref.ref(dead), "device", (((0, 1), 12345),))
    del dead
    memory._BUFFERS[id(x)] = stale  # as if an array that lived at x's id had left its entry behind
    kind, buffers = memory._buffers(x)
    assert kind == "device" and sum(n for _, n in buffers) == x.nbytes
