"""Peak host memory while loading a ~115M-parameter checkpoint into an FSDP x TP layout on 8
fake devices stays close to one model copy (well under two).

On CPU the "devices" live in host memory, so the loaded model itself is one copy in the
process's resident set; a loader that materialized whole tensors (or kept memory-mapped pages
resident) before sharding them would add up to a second copy. The load runs in a fresh
subprocess so that its high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`) counts
nothing but the load.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tpurl.models import abstract_model
from tpurl.models.config import ModelConfig
from tpurl.models.hf import config_to_hf
from tpurl.models.hf_mapping import param_tensors

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")

# Embedding and untied lm_head (2 x 50176 x 1024) dominate, as in real small models.
CFG = ModelConfig(model_type="llama", vocab_size=50176, hidden_size=1024, intermediate_size=1024, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=128)

LOADER = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import gc
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from tpurl.models import abstract_model
    from tpurl.models.hf import load_hf_checkpoint, load_hf_config
    from tpurl.sharding.layout import Layout

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path = sys.argv[1]
    cfg = load_hf_config(path)
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    layout = Layout(name="fsdp_tp", rules=(("embed", ("fsdp",)), ("vocab", ("tensor",)), ("heads", ("tensor",)),
                                            ("kv_heads", ("tensor",)), ("mlp", ("tensor",))))
    shardings = layout.param_shardings(abstract_model(cfg), mesh)
    jax.device_put(np.zeros(8, np.float32), jax.devices()[1]).block_until_ready()  # runtime warm
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    model = load_hf_checkpoint(path, config=cfg, shardings=shardings)
    leaves = jax.tree.leaves(jax.block_until_ready(model))
    peak, after = status("VmHWM"), status("VmRSS")
    emb = model.embed_tokens[...]
    print(json.dumps({
        "base": base, "peak": peak, "after": after,
        "param_bytes": sum(x.nbytes for x in leaves),
        "embed_shards": sorted({tuple(s.data.shape) for s in emb.addressable_shards}),
        "embed_corner": np.asarray(emb[:2, :3]).tolist(),
        "lm_head_corner": np.asarray(model.lm_head[...][-3:, -2:]).tolist(),
    }))
""")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """Written from numpy, one shard file at a time (so this process holds one file's tensors)."""
    path = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    groups = {"model-00001-of-00003.safetensors": [], "model-00002-of-00003.safetensors": [],
              "model-00003-of-00003.safetensors": []}
    for key, var in nnx.to_flat_state(nnx.state(abstract_model(CFG))):
        param = tuple(str(k) for k in key)
        file = {("embed_tokens",): 0, ("lm_head",): 1}.get(param, 2)
        groups[list(groups)[file]] += param_tensors(param, var.get_value().shape)
    weight_map, corners = {}, {}
    for file, tensors in groups.items():
        arrays = {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in tensors}
        if "model.embed_tokens.weight" in arrays:
            corners["embed"] = arrays["model.embed_tokens.weight"][:2, :3].copy()
        if "lm_head.weight" in arrays:  # HF [V, D]; ours is its transpose
            corners["lm_head"] = arrays["lm_head.weight"][-2:, -3:].T.copy()
        save_file(arrays, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in arrays})
        del arrays
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config_to_hf(CFG)))
    yield str(path), corners
    for file in os.listdir(path):
        os.remove(path / file)


def test_sharded_load_peak_host_memory_is_one_model_copy(big_checkpoint):
    path, corners = big_checkpoint
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", LOADER, path], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    model_bytes = CFG.num_params() * 4
    assert r["param_bytes"] == model_bytes > 400e6
    assert r["embed_shards"] == [[25088, 256]]  # vocab over tensor=2, embed over fsdp=4
    np.testing.assert_array_equal(r["embed_corner"], corners["embed"])
    np.testing.assert_array_equal(r["lm_head_corner"], corners["lm_head"])
    # The measurement sees the loaded model (device buffers are host memory on CPU) ...
    assert r["after"] - r["base"] > 0.9 * model_bytes, r
    # ... and the load's peak adds only per-shard transients on top of it: far from two copies.
    extra = r["peak"] - r["base"] - model_bytes
    print(f"model {model_bytes / 2**20:.0f} MiB, peak above baseline {(r['peak'] - r['base']) / 2**20:.0f} MiB "
          f"(transient {extra / 2**20:.0f} MiB)")
    assert r["peak"] - r["base"] < 1.25 * model_bytes, r
