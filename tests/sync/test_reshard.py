"""sync_weights against a numpy cast, for every pair of layouts, both methods, bucketing and the
free path; no host round trip for the `jit` method (`host_guard.no_host_round_trip`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.sharding.layout import MeshConfig, make_mesh
from tpurl.sync import reshard
from tpurl.sync.disk import disk_sync
from tpurl.sync.config import SyncConfig
from tpurl.sync.reshard import sync_weights

from host_guard import HostRoundTrip
from sync_helpers import LAYOUTS, assert_synced, no_host_round_trip, place

# 20 kB buckets: every stacked [L=2, ...] matrix of the tiny model is cut into per-layer pieces.
SMALL_BUCKET = 20_000


@pytest.mark.slow
@pytest.mark.parametrize("src", list(LAYOUTS))
def test_every_layout_pair_is_exact_device_put(params, mesh, src):
    train = place(params, src, mesh)
    n_bytes = sum(x.size * 2 for x in jax.tree.leaves(params))
    for dst in LAYOUTS:
        shardings = LAYOUTS[dst].param_shardings(params, mesh)
        with no_host_round_trip():
            rollout, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="device_put",
                                                                        bucket_bytes=SMALL_BUCKET))
        assert_synced(train, rollout, shardings)
        assert (report.method, report.free, report.leaves_unchanged) == ("device_put", False, 0)
        assert report.leaves_resharded == len(jax.tree.leaves(params))
        assert report.bytes_moved == n_bytes
        # The stacked leaves were sliced: more buckets than a whole-leaf plan would need.
        assert report.buckets > n_bytes // SMALL_BUCKET


@pytest.mark.parametrize("src,dst", [("fsdp_tp", "tp_replicas"), ("fsdp", "tp"), ("tp", "dp"), ("dp", "fsdp_tp"),
                                     ("tp_replicas", "fsdp")])
def test_layout_pairs_are_exact_jit(params, mesh, src, dst):
    train = place(params, src, mesh)
    shardings = LAYOUTS[dst].param_shardings(params, mesh)
    with no_host_round_trip():
        rollout, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="jit", bucket_bytes=SMALL_BUCKET))
    assert_synced(train, rollout, shardings)
    assert report.method == "jit"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["device_put", "jit"])
@pytest.mark.parametrize("bucket", [SMALL_BUCKET, 2**30])
def test_rollout_mesh_of_another_shape_on_the_same_devices(params, mesh, method, bucket):
    """The colocated case where the rollout mesh reshapes the train mesh's devices ((1, 4, 2) ->
    (2, 1, 4), as in configs/test_tiny.gin): every rollout leaf lands in its rollout sharding,
    not replicated, on both the whole-leaf and the sliced path."""
    devices = list(mesh.devices.flat)
    train_mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(1, 4, 2)), devices)
    rollout_mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(2, 1, 4)), devices)
    train = place(params, "fsdp_tp", train_mesh)
    shardings = LAYOUTS["tp"].param_shardings(params, rollout_mesh)
    rollout, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method=method, bucket_bytes=bucket))
    assert_synced(train, rollout, shardings)
    assert report.method == method


def test_a_plain_device_put_relays_a_layout_change_through_the_host(params, mesh):
    """Why the `device_put` method stages the target layout on the source devices first:
    `jax.device_put` into a sharding whose shards are not slices the source already holds
    assembles the whole array on the host (`jax.Array._value`) and uploads it again. The guard
    catches that; the method itself stays on device (test above)."""
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    with pytest.raises(HostRoundTrip, match=r"jax.Array._value"), no_host_round_trip():
        jax.device_put(train, shardings)


@pytest.mark.parametrize("method", ["device_put", "jit"])
def test_whole_leaf_path_and_fp32_rollout(params, mesh, method):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    rollout, report = sync_weights(train, shardings, SyncConfig(method=method, bucket_bytes=2**30,
                                                                rollout_dtype="float32"))
    assert_synced(train, rollout, shardings, dtype=jnp.float32)
    assert report.buckets == 1
    moved = [x for x, y in zip(jax.tree.leaves(train), jax.tree.leaves(rollout)) if x is not y]
    assert report.leaves_unchanged == 3  # the replicated norm scales need neither cast nor move
    assert report.leaves_relaid == report.leaves_resharded == len(jax.tree.leaves(params)) - 3
    assert report.bytes_moved == sum(x.nbytes for x in moved)


def test_bucket_bounds_the_bytes_in_flight(params, mesh):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp"].param_shardings(params, mesh)
    # One layer of the largest stacked bf16 matrix (64 x 128) fits; two do not.
    bucket = 64 * 128 * 2
    _, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="device_put", bucket_bytes=bucket))
    assert report.max_bucket_bytes <= bucket
    # Leaves whose first axis is sharded by a layout cannot be sliced: embed_tokens[V_tp, D_fsdp]
    # (128 x 64 bf16 = 16 kB) moves whole even with a smaller bucket, and the report says so.
    _, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="device_put", bucket_bytes=bucket // 2))
    assert report.max_bucket_bytes == 128 * 64 * 2


def test_a_piece_needs_piece_sized_temporaries(mesh):
    """Why slicing bounds memory: XLA's temporaries for one layer of a stacked [L, D_fsdp, F_tp]
    weight (gather + cast + write into the rollout buffer) are a fraction of those for the whole
    leaf at once, which gathers every layer before writing any (per-device compiled sizes)."""
    src = NamedSharding(mesh, P(None, "fsdp", "tensor"))
    dst = NamedSharding(mesh, P(None, None, "tensor"))
    x = jax.ShapeDtypeStruct((8, 256, 512), jnp.float32, sharding=src)
    out = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16, sharding=dst)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    whole = reshard.cast_then_reshard_program((np.dtype(jnp.bfloat16),), (src,), (dst,)).lower([x])
    whole = whole.compile().memory_analysis()
    piece = reshard._slice_cast_reshard_write_program(0, 1, jnp.bfloat16, src, dst).lower(
        out, x, start).compile().memory_analysis()
    assert piece.alias_size_in_bytes == piece.output_size_in_bytes  # written in place (donated)
    assert 4 * piece.temp_size_in_bytes <= whole.temp_size_in_bytes


def test_free_when_layouts_and_dtypes_coincide(params, mesh):
    train = place(params, "tp_replicas", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    rollout, report = sync_weights(train, shardings, SyncConfig(rollout_dtype=None))
    assert report.free and report.bytes_moved == 0 and report.leaves_resharded == 0
    assert all(x is y for x, y in zip(jax.tree.leaves(train), jax.tree.leaves(rollout)))
    # bf16 train weights already in the rollout layout: also free.
    train_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), train)
    _, report = sync_weights(train_bf16, shardings, SyncConfig(rollout_dtype="bfloat16"))
    assert report.free
    # Same layout, but a cast is needed: not free, every leaf moves.
    _, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="jit"))
    assert not report.free and report.leaves_resharded == len(jax.tree.leaves(params))
    assert report.leaves_relaid == 0  # a cast in place: no leaf changed layout


def test_partially_unchanged_leaves_are_passed_through(params, mesh):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    # Norm scales are replicated in both layouts: with rollout_dtype=None only they stay put.
    rollout, report = sync_weights(train, shardings, SyncConfig(method="device_put", rollout_dtype=None))
    same = [x is y for x, y in zip(jax.tree.leaves(train), jax.tree.leaves(rollout))]
    assert report.leaves_unchanged == sum(same) == 3  # input_layernorm, post_attention_layernorm, norm
    assert_synced(train, rollout, shardings, dtype=jnp.float32)


def test_auto_measures_once_per_backend(params, mesh, monkeypatch):
    monkeypatch.setattr(reshard, "_AUTO_CHOICE", {})
    train = place(params, "fsdp", mesh)
    shardings = LAYOUTS["tp"].param_shardings(params, mesh)
    rollout, report = sync_weights(train, shardings, SyncConfig(rollout_dtype="bfloat16", method="auto"))
    assert report.method in ("device_put", "jit")
    assert reshard.auto_choice() == report.method
    assert_synced(train, rollout, shardings)


@pytest.mark.slow
def test_disk_baseline_is_exact(params, mesh, tmp_path):
    train = place(params, "fsdp_tp", mesh)
    shardings = LAYOUTS["tp_replicas"].param_shardings(params, mesh)
    rollout, report = disk_sync(train, shardings, SyncConfig(rollout_dtype="bfloat16"), directory=str(tmp_path))
    assert report.method == "disk"
    assert_synced(train, rollout, shardings)
    assert list(tmp_path.iterdir()) == []  # the checkpoint is removed


def test_bad_input_is_rejected(params, mesh):
    with pytest.raises(ValueError, match="SyncConfig.method"):
        SyncConfig(method="nccl")
    with pytest.raises(ValueError, match="bucket_bytes"):
        SyncConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="rollout_dtype"):
        SyncConfig(rollout_dtype="int8")
    train = place(params, "dp", mesh)
    shardings = LAYOUTS["tp"].param_shardings(params, mesh)
    with pytest.raises(ValueError, match="structure"):
        sync_weights({"a": jax.tree.leaves(train)[0]}, shardings)
