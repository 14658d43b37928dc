"""Two JAX processes (4 fake CPU devices each) on one machine: a "global" MeshConfig spans all 8
devices of both processes, a "local" one only the process's own 4, and the error for a wrong
product names the process layout."""

import json
import textwrap

from multiprocess_helpers import run_workers

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
    jax.distributed.shutdown()
""")


def test_global_and_local_meshes_across_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    outs = [json.loads(out.strip().splitlines()[-1])
            for out in run_workers([str(script)], num_processes=2, devices_per_process=4, timeout=120)]
    for i, o in enumerate(outs):
        assert o["global"] == {"data": 1, "fsdp": 4, "tensor": 2} and o["global_procs"] == [0, 1]
        assert o["local"] == {"data": 1, "fsdp": 2, "tensor": 2} and o["local_procs"] == [i]
        assert "has 6 devices but 8 are available" in o["err"] and "2 processes x 4 local devices" in o["err"]
