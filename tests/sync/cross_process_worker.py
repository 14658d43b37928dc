"""One process of the cross-process sync test (`test_cross_process.py` starts two).

Process 0's 4 devices hold the trainer (fp32 params, `fsdp_tp` on a (1, 2, 2) mesh), process 1's
the rollout side (`tp_replicas` on a (2, 1, 2) mesh). Both processes run the same program: sync,
an update on the train pool, sync again. Each writes what it holds to OUT_DIR for the test to
compare: process 0 the train params of both versions, process 1 the rollout params it received.

    python tests/sync/cross_process_worker.py OUT_DIR   (with the TPURL_* variables set)
"""

import json
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

from sync_helpers import LAYOUTS, no_host_round_trip  # noqa: E402
from tpurl.models import abstract_model, preset  # noqa: E402
from tpurl.models.transformer import Transformer  # noqa: E402
from tpurl.sharding.distributed import DistributedConfig, initialize, leave  # noqa: E402
from tpurl.sharding.layout import MeshConfig  # noqa: E402
from tpurl.sharding.placement import PlacementConfig, make_placement
from tpurl.sync import SyncConfig, sync_weights  # noqa: E402

MODEL = preset("tiny", num_heads=8, num_kv_heads=4, head_dim=8)
# Small buckets: stacked layer weights are cut into pieces, the rest grouped, so both paths cross.
SYNC = SyncConfig(method="auto", bucket_bytes=20_000, rollout_dtype="bfloat16")


def named_leaves(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def local_values(tree) -> dict[str, np.ndarray]:
    """The leaves this process holds whole (as raw bits for bfloat16, which npz cannot store)."""
    out = {}
    for name, x in named_leaves(tree).items():
        value = np.asarray(x)
        out[name] = value.view(np.uint16) if x.dtype == jax.numpy.bfloat16 else value
    return out


def main(out_dir: str) -> None:
    initialize(DistributedConfig(mode="on"))
    pid = jax.process_index()
    placement = make_placement(PlacementConfig(
        mode="disaggregated", train_devices=4, rollout_devices=4, device_split="in_order",
        train_mesh=MeshConfig(shape=(1, 2, 2)), rollout_mesh=MeshConfig(shape=(2, 1, 2))))
    assert {d.process_index for d in placement.train_devices} == {0}
    assert {d.process_index for d in placement.rollout_devices} == {1}
    abstract = nnx.state(abstract_model(MODEL))
    train_shardings = LAYOUTS["fsdp_tp"].param_shardings(abstract, placement.train_mesh)
    rollout_shardings = LAYOUTS["tp_replicas"].param_shardings(abstract, placement.rollout_mesh)
    # Created on the train pool: process 1 never holds the trainer's weights.
    train = jax.jit(lambda: nnx.state(Transformer(MODEL, rngs=nnx.Rngs(params=0))), out_shardings=train_shardings)()
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.5 + 0.01, t), out_shardings=train_shardings)
    reports = []
    for version in (1, 2):
        with no_host_round_trip():  # also refuses reads of the train params on the host
            rollout, report = sync_weights(train, rollout_shardings, SYNC)
        reports.append({"method": report.method, "seconds": report.seconds, "buckets": report.buckets})
        if pid == 0:
            np.savez(os.path.join(out_dir, f"train_v{version}.npz"), **local_values(train))
        else:
            for x, s in zip(jax.tree.leaves(rollout), jax.tree.leaves(rollout_shardings)):
                assert x.is_fully_addressable and x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
            np.savez(os.path.join(out_dir, f"rollout_v{version}.npz"), **local_values(rollout))
        del rollout
        train = update(train)
    print(json.dumps({"process": pid, "reports": reports}))
    leave()  # shutdown, then exit without the teardown that can hang (tpurl.sharding.distributed)


if __name__ == "__main__":
    main(sys.argv[1])
