"""Multi-turn episodes across processes (2 processes x 4 CPU devices, gloo) against one process over
the same 8 devices: only process 0 runs the environment (a tool that answers every stopped turn);
before each decode round, which waiting episodes answered and their observations go from process 0
to the other over the rollout devices, so both resume the same sequences with the same tokens at
the same step as the one-process run. Process 1's environment would answer later (a delay) and
differently: it must never be asked."""

import pytest
import subprocess
import sys
import textwrap

from multiprocess_helpers import ROOT, cpu_env, last_json, run_workers

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

WORKER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.path.join(os.getcwd(), "tests", "generate"))
    from tpurl.sharding.distributed import DistributedConfig, initialize
    initialize(DistributedConfig())
    import jax
    import numpy as np
    from flax import nnx
    from test_multiturn import CFG, ENGINE, PROMPTS, SAMPLING, ToolEnv
    from tpurl.generate import Engine, EngineConfig, generate
    from tpurl.models import init_model
    from tpurl.sharding.mesh import MeshConfig, make_mesh
    from tpurl.sharding.presets import layout_preset

    graphdef, params = nnx.split(init_model(CFG, seed=3))
    mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=(2, 1, 4)))
    layout = layout_preset("tp")
    engine = Engine(CFG, EngineConfig(**ENGINE), mesh=mesh, layout=layout, graphdef=graphdef)
    params = jax.device_put(jax.tree.map(np.asarray, params), layout.param_shardings(params, mesh))
    pid = jax.process_index()
    env = ToolEnv(turns=3 if pid == 0 else 1, delay=0.05 * pid)
    out = generate(engine, params, PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, on_turn_end=env)
    print(json.dumps({"pid": pid, "calls": len(env.calls),
                      "episodes": [[[c.token_ids.tolist(), c.model_mask.tolist(), c.turns, c.finish_reason,
                                     c.logprobs.tolist()] for c in row] for row in out]}))
""")


def test_multi_turn_across_processes_matches_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    one = subprocess.Popen([sys.executable, str(script)], env=cpu_env(8), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # beside the two processes
    try:
        multi = [last_json(out) for out in run_workers([str(script)], num_processes=2, devices_per_process=4,
                                                       timeout=300)]
    finally:
        out, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-3000:]
    single = last_json(out)
    assert single["calls"] > 0 and max(t for row in single["episodes"] for _, _, t, _, _ in row) > 1
    assert multi[0]["calls"] == single["calls"] and multi[1]["calls"] == 0  # process 1 ran no tool
    for out in multi:
        for row, ref_row in zip(out["episodes"], single["episodes"]):
            for (tokens, mask, turns, reason, logprobs), (r_tokens, r_mask, r_turns, r_reason, r_lp) in zip(row, ref_row):
                assert (tokens, mask, turns, reason) == (r_tokens, r_mask, r_turns, r_reason)
                assert max((abs(a - b) for a, b in zip(logprobs, r_lp)), default=0.0) < 1e-5
