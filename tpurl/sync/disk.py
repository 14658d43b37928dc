"""The disk baseline: weight sync through an orbax checkpoint, for benchmarks only.

This is what a trainer + separate inference server does: write the (rollout-dtype) weights to a
checkpoint, then restore them into the inference engine's shardings. tpurl syncs with
`tpurl.sync.reshard.sync_weights` instead; this module exists so `scripts/bench_sync.py` can
measure the gap. The cast to the rollout dtype happens on device before the write (a real
pipeline exports bf16), so the disk path moves the same bytes as the reshard.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import jax
import orbax.checkpoint as ocp

from tpurl.sync.config import SyncConfig, SyncReport
from tpurl.sync.reshard import cast_to, flatten_with_shardings, rollout_dtype_of


def disk_sync(train_params, rollout_shardings, cfg: SyncConfig = SyncConfig(), directory: str | None = None):
    """Sync through a checkpoint in `directory` (default: a fresh temporary directory, removed
    afterwards). Returns `(rollout_params, report)` like `sync_weights`, with `method="disk"`."""
    if cfg.quantize is not None:
        raise ValueError("disk_sync does not quantize (SyncConfig.quantize); compare it with sync_weights unquantized")
    arrays, targets, treedef = flatten_with_shardings(train_params, rollout_shardings)
    dtypes = [rollout_dtype_of(x, cfg) for x in arrays]
    root = tempfile.mkdtemp(prefix="tpurl_disk_sync_", dir=directory)
    path = os.path.join(root, "weights")
    start = time.perf_counter()
    # Orbax keys must be strings; a flat dict keeps the checkpoint independent of pytree node types.
    to_save = {str(i): x if x.dtype == dt else cast_to(x, dtype=dt, sharding=x.sharding)
               for i, (x, dt) in enumerate(zip(arrays, dtypes))}
    target = {str(i): jax.ShapeDtypeStruct(x.shape, dt, sharding=s)
              for i, (x, dt, s) in enumerate(zip(arrays, dtypes, targets))}
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path, to_save)
        checkpointer.wait_until_finished()
        del to_save
        restored = checkpointer.restore(path, target)
        jax.block_until_ready(restored)
    finally:
        checkpointer.close()
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - start
    out = [restored[str(i)] for i in range(len(arrays))]
    nbytes = sum(x.size * dt.itemsize for x, dt in zip(arrays, dtypes))
    relaid = sum(not x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(arrays, targets))
    report = SyncReport(method="disk", bytes_moved=int(nbytes), leaves_resharded=len(arrays), leaves_relaid=relaid,
                        leaves_unchanged=0, buckets=1, max_bucket_bytes=int(nbytes), seconds=seconds, free=False)
    return jax.tree.unflatten(treedef, out), report
