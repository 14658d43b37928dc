"""Process-aware host reads, host batches and process-0 decisions (`tpurl.sharding.host`), in one
process over 8 devices and in 2 processes x 2 CPU devices (gloo), against plain numpy values."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.commands.launch import launch
from tpurl.sharding.host import on_writer, to_host, to_mesh

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_one_process_round_trip(devices):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=devices)
    x_BT = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = to_mesh({"x": x_BT, "n": np.int32(3)}, {"x": NamedSharding(mesh, P(("data", "fsdp"))),
                                                      "n": NamedSharding(mesh, P())})
    assert placed["x"].sharding.spec == P(("data", "fsdp")) and len(placed["x"].addressable_shards) == 8
    back = to_host({"x": placed["x"], "n": placed["n"], "label": "kept"})
    np.testing.assert_array_equal(back["x"], x_BT)
    assert back["n"] == 3 and back["label"] == "kept"
    assert on_writer(lambda: {"dir": "a"}) == {"dir": "a"}
    with pytest.raises(ValueError, match="no such run"):
        on_writer(lambda: (_ for _ in ()).throw(ValueError("no such run")))


WORKER = textwrap.dedent("""
    import json, os
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tpurl.sharding.distributed import DistributedConfig, initialize
    initialize(DistributedConfig())
    from tpurl.sharding.host import all_processes, on_writer, to_host, to_mesh
    pid = jax.process_index()
    # A pool of one device per process (the second of each): agreement and broadcast over it alone.
    pool = jax.sharding.Mesh(np.asarray([jax.devices()[1], jax.devices()[3]]), ("data",))
    agreed = [all_processes(True, pool), all_processes(pid == 0, pool)]
    pool_chosen = on_writer(lambda: {"rewards": [0.5, pid]}, pool)
    # Texts padded to a power of two: 256 bytes exactly (239 + the JSON around it), 257, and 317.
    long_texts = [on_writer(lambda: {"t": "x" * n if pid == 0 else ""}, pool)["t"] == "x" * n for n in (239, 240, 300)]
    try:  # any error of process 0's, not only ValueError / OSError, reaches every process
        on_writer(lambda: {"k": {}["missing"]}, pool)
        pool_error = None
    except (KeyError, ValueError) as e:
        pool_error = f"{type(e).__name__}: {e}"
    try:  # a mesh without a device on every process: refused before any collective, on both
        all_processes(True, jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",)))
        lopsided = None
    except ValueError as e:
        lopsided = str(e)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x_BT = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = to_mesh(x_BT, NamedSharding(mesh, P("data")))
    local_rows = sorted(int(s.data[0, 0]) // 4 for s in placed.addressable_shards)
    doubled = to_host(jax.jit(lambda a: a * 2)(placed))
    chosen = on_writer(lambda: {"dir": f"chosen by {pid}"})
    try:
        on_writer(lambda: (_ for _ in ()).throw(OSError("disk full")))
        error = None
    except (ValueError, OSError) as e:  # OSError on process 0, ValueError on the others
        error = str(e)
    print(json.dumps({"pid": pid, "fully_addressable": placed.is_fully_addressable, "local_rows": local_rows,
                      "doubled_ok": bool(np.array_equal(doubled, 2 * x_BT)), "chosen": chosen, "error": error,
                      "agreed": agreed, "pool_chosen": pool_chosen, "pool_error": pool_error,
                      "lopsided": lopsided, "long_texts": long_texts}))
""")


@pytest.mark.slow
def test_two_processes(tmp_path, capfd):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT}
    status = launch([], num_processes=2, devices_per_process=2, env=env, program=(sys.executable, str(script)))
    out = capfd.readouterr().out
    assert status == 0, out[-3000:]
    results = sorted((json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if '"pid"' in line),
                     key=lambda r: r["pid"])
    assert [r["pid"] for r in results] == [0, 1]
    for r in results:
        assert r["fully_addressable"] is False and r["doubled_ok"]
        assert r["chosen"] == {"dir": "chosen by 0"} and r["error"] == "disk full"
        assert r["agreed"] == [True, False] and r["pool_chosen"] == {"rewards": [0.5, 0]}
        assert r["long_texts"] == [True, True, True]
        assert r["lopsided"] == ("a mesh of 2 devices has none on processes [1]: agreeing or broadcasting over it "
                                 "needs devices on every process")
    assert results[0]["pool_error"] == "KeyError: 'missing'"
    assert results[1]["pool_error"] == "ValueError: process 0: KeyError: 'missing'"
    assert results[0]["local_rows"] == [0, 2] and results[1]["local_rows"] == [4, 6]
