"""The no-host-round-trip check fails when it should: syncs that work but go through the host.

Each plant replaces the sync's cast-and-reshard step (`reshard._cast_then_reshard`, used by both
methods for whole leaves) with one that produces the right rollout weights by way of the host. The
plants are real syncs (checked exact without the guard), so the guard is what tells them apart
from the device-only one; on CPU, `jax.transfer_guard` alone lets all of them through.
"""

import functools

import jax
import numpy as np
import pytest

from host_guard import HostRoundTrip, host_ops, no_host_round_trip
from tpurl.sync import reshard
from tpurl.sync.config import SyncConfig
from tpurl.sync.reshard import sync_weights

from sync_helpers import LAYOUTS, assert_synced, place


def via_numpy(xs, *, dtypes, src, dst):
    return [jax.device_put(np.asarray(x).astype(dt), d) for x, dt, d in zip(xs, dtypes, dst)]


def via_device_get(xs, *, dtypes, src, dst):
    return [jax.device_put(jax.device_get(x).astype(dt), d) for x, dt, d in zip(xs, dtypes, dst)]


def via_shard_buffers(xs, *, dtypes, src, dst):
    """Reads each single-device shard, which on CPU numpy can view without calling jax."""
    out = []
    for x, dt, d in zip(xs, dtypes, dst):
        host = np.empty(x.shape, dt)
        for shard in x.addressable_shards:
            host[shard.index] = np.asarray(shard.data)
        out.append(jax.device_put(host, d))
    return out


def via_pinned_host(xs, *, dtypes, src, dst):
    return [jax.device_put(jax.device_put(x.astype(dt), s.with_memory_kind("pinned_host")), d)
            for x, dt, s, d in zip(xs, dtypes, src, dst)]


def _host_cast(dtype, a):
    return np.asarray(a).astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtypes", "src", "dst"))
def via_callback(xs, *, dtypes, src, dst):
    """Device arrays in, device arrays out, the cast in a Python callback: only the program shows it."""
    return [jax.lax.with_sharding_constraint(
        jax.pure_callback(functools.partial(_host_cast, dt), jax.ShapeDtypeStruct(x.shape, dt), x), d)
        for x, dt, d in zip(xs, dtypes, dst)]


@functools.partial(jax.jit, static_argnames=("dtypes", "src", "dst"))
def via_host_memory(xs, *, dtypes, src, dst):
    """The cast result is staged in host memory inside the program."""
    return [jax.lax.with_sharding_constraint(jax.device_put(x.astype(dt), s.with_memory_kind("pinned_host")), d)
            for x, dt, s, d in zip(xs, dtypes, src, dst)]


PLANTS = {"numpy": via_numpy, "device_get": via_device_get, "shard_buffers": via_shard_buffers,
          "pinned_host_device_put": via_pinned_host, "callback": via_callback, "host_memory": via_host_memory}


# Both sync methods for the plain numpy round trip; one each for the rest (compiles dominate).
@pytest.mark.parametrize("plant,method", [("numpy", "device_put"), ("numpy", "jit"), ("device_get", "device_put"),
                                          ("shard_buffers", "jit"), ("pinned_host_device_put", "device_put"),
                                          ("callback", "jit"), ("host_memory", "device_put")])
def test_a_sync_through_the_host_is_caught(params, mesh, monkeypatch, plant, method):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    cfg = SyncConfig(rollout_dtype="bfloat16", method=method, bucket_bytes=2**30)  # whole leaves: every leaf goes through the plant
    monkeypatch.setattr(reshard, "_cast_then_reshard", PLANTS[plant])
    rollout, _ = sync_weights(train, shardings, cfg)
    assert_synced(train, rollout, shardings)  # a working sync ...
    with pytest.raises(HostRoundTrip), no_host_round_trip(reshard):
        sync_weights(train, shardings, cfg)  # ... that the check refuses


def test_the_device_only_sync_passes_and_its_programs_are_checked(params, mesh):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    with no_host_round_trip(reshard) as seen:
        rollout, _ = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="jit", bucket_bytes=20_000))
    assert_synced(train, rollout, shardings)
    assert {"tpurl.sync.reshard.cast_then_reshard_program", "tpurl.sync.reshard._slice_cast_reshard_write_program"} <= set(
        seen.programs)


def test_guards_are_lifted_on_exit(params, mesh):
    x = jax.tree.leaves(place(params, "fsdp_tp", mesh))[0]
    factory = reshard.cast_then_reshard_program
    with no_host_round_trip(reshard):
        assert reshard.cast_then_reshard_program is not factory
    assert reshard.cast_then_reshard_program is factory
    assert np.asarray(x).shape == x.shape and jax.device_get(x).shape == x.shape and x.tolist()


def test_host_ops_names_what_it_found():
    x = jax.numpy.ones(4)
    callback = jax.jit(lambda a: jax.pure_callback(np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a))
    assert any("callback" in f for f in host_ops(callback.lower(x).as_text()))
    assert host_ops(jax.jit(lambda a: -a).lower(x).as_text()) == []
