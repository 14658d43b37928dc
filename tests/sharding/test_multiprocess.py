"""Two JAX processes (4 fake CPU devices each) on one machine: a "global" MeshConfig spans all 8
devices of both processes, a "local" one only the process's own 4, and the error for a wrong
product names the process layout; restoring the newest checkpoint is decided by both processes
together."""

import pytest
import os
import textwrap

from multiprocess_helpers import last_json, run_workers

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

WORKER = textwrap.dedent("""
    import json
    import jax
    from tpurl.sharding.distributed import DistributedConfig, initialize
    initialize(DistributedConfig(mode="on"))
    from tpurl.sharding.mesh import MeshConfig, make_mesh
    g = make_mesh(MeshConfig(shape=(1, -1, 2)))
    l = make_mesh(MeshConfig(shape=(1, -1, 2), scope="local"))
    try:
        make_mesh(MeshConfig(shape=(1, 3, 2)))
        err = None
    except ValueError as e:
        err = str(e)
    print(json.dumps({"global": dict(g.shape), "global_procs": sorted({d.process_index for d in g.devices.flat}),
                      "local": dict(l.shape), "local_procs": sorted({d.process_index for d in l.devices.flat}),
                      "err": err}))
    from tpurl.sharding.distributed import leave
    leave()  # shutdown, then exit without the teardown that can hang
""")


def test_global_and_local_meshes_across_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    outs = [last_json(out)
            for out in run_workers([str(script)], num_processes=2, devices_per_process=4, timeout=120)]
    for i, o in enumerate(outs):
        assert o["global"] == {"data": 1, "fsdp": 4, "tensor": 2} and o["global_procs"] == [0, 1]
        assert o["local"] == {"data": 1, "fsdp": 2, "tensor": 2} and o["local_procs"] == [i]
        assert "has 6 devices but 8 are available" in o["err"] and "2 processes x 4 local devices" in o["err"]


RESTORE_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    from tpurl.sharding.distributed import DistributedConfig, initialize
    initialize(DistributedConfig(mode="on"))
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpurl.checkpoint import Checkpointer
    from tpurl.sharding.host import to_host, to_mesh
    from tpurl.sharding.mesh import MeshConfig, make_mesh
    sharding = NamedSharding(make_mesh(MeshConfig(shape=(1, -1, 2))), P("fsdp"))
    ck = Checkpointer(sys.argv[1])
    for step in (1, 2):
        ck.save(step, {"w": to_mesh(np.full(8, step, np.float32), sharding)}, {"step": step})
    if sys.argv[2] == "flipped" and jax.process_index() == 0:  # the newest checkpoint's bytes change on disk
        import glob, os
        path = max((p for p in glob.glob(sys.argv[1] + "/2/arrays/**", recursive=True)
                    if os.path.isfile(p) and "/d/" in p), key=os.path.getsize)
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(len(data) // 2)
            f.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 16]))
    if sys.argv[2] == "unreadable" and jax.process_index() == 1:  # only this process fails on the newest
        restore = ck.restore        # checkpoint, after reading it collectively (e.g. out of memory placing its shards)
        def failing(step, like):
            out = restore(step, like)
            if step == 2:
                raise OSError("unreadable here")
            return out
        ck.restore = failing
    like = {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)}
    step, tree, meta = ck.restore_latest(like, say=lambda m: None)
    print(json.dumps({"step": step, "w": to_host(tree["w"]).tolist(), "meta": meta["step"]}))
    from tpurl.sharding.distributed import leave
    leave()  # shutdown, then exit without the teardown that can hang
""")


@pytest.mark.parametrize("damage", ["unreadable", "flipped"])
def test_a_checkpoint_one_process_cannot_read_is_skipped_by_both(tmp_path, damage):
    """Process 1 alone fails on step 2 (`unreadable`), or process 0 alone finds its checksums
    changed (`flipped`: only process 0 verifies): both resume from step 1 (each deciding alone, one
    would go on from step 2 while the other waits in a collective), and step 2 is moved aside."""
    script = tmp_path / "worker.py"
    script.write_text(RESTORE_WORKER)
    outs = [last_json(out)
            for out in run_workers([str(script), str(tmp_path / "ck"), damage], num_processes=2,
                                   devices_per_process=4, timeout=120)]
    assert outs == [{"step": 1, "w": [1.0] * 8, "meta": 1}] * 2
    assert os.listdir(tmp_path / "ck.damaged") == ["2"] and os.listdir(tmp_path / "ck") == ["1"]
