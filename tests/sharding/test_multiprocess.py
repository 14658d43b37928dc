"""Two JAX processes (4 fake CPU devices each) on one machine: a "global" MeshConfig spans all 8
devices of both processes, a "local" one only the process's own 4, and the error for a wrong
product names the process layout."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

WORKER = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_global_and_local_meshes_across_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    addr = f"127.0.0.1:{_free_port()}"
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, str(script), addr, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=root) for i in range(2)]
    outs = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"process {i} failed:\n{err[-2000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for i, o in enumerate(outs):
        assert o["global"] == {"data": 1, "fsdp": 4, "tensor": 2} and o["global_procs"] == [0, 1]
        assert o["local"] == {"data": 1, "fsdp": 2, "tensor": 2} and o["local_procs"] == [i]
        assert "has 6 devices but 8 are available" in o["err"] and "2 processes x 4 local devices" in o["err"]
