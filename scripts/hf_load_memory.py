"""Peak host memory and time of loading a Hugging Face checkpoint into a sharded layout.

Writes a random ~115M-parameter Llama checkpoint (embedding and untied lm_head of
50176 x 1024 dominate, as in real small models; three shard files + index, written from numpy),
then, in a fresh process per mesh, loads it with `load_hf_checkpoint` into an FSDP x TP layout
(`embed` over fsdp, `vocab`/`heads`/`kv_heads`/`mlp` over tensor=2) on 8 devices, and prints one
JSON object per mesh:

  mesh               "fsdp4_tp2" (fsdp=4 x tensor=2) or "data2_fsdp2_tp2" (the same layout with
                     every parameter replicated over data=2)
  model_bytes        bytes of the loaded parameters (float32, one logical copy)
  device_bytes       bytes the devices hold (model_bytes times the replication)
  peak_over_base     rise of the process's resident-set high-water mark (VmHWM, reset through
                     /proc/self/clear_refs just before the load) during the load
  after_over_base    resident-set rise that remains after the load
  peak_over_model    peak_over_base / model_bytes (1.0 = exactly one model copy)
  peak_over_device   peak_over_base / device_bytes (1.0 = exactly what the devices hold)
  host_peak_bytes    peak of the host allocations that Python/numpy make during the load
                     (tracemalloc: the loader's boxes and read buffers, not the device buffers)
  max_shard_bytes    the largest per-device shard of any parameter
  host_peak_over_shard  host_peak_bytes / max_shard_bytes
  load_s             wall time of the load

On CPU the 8 "devices" live in host memory, so what the devices hold is in the resident set:
peak_over_device near 1 means the loader adds only per-shard transients. A loader that
materialized whole tensors first would approach 2 on the first mesh. The resident set cannot see
a loader that keeps every distinct box of a parameter until its replicas are placed (on CPU those
host copies stand in for device buffers not allocated yet), so `host_peak_over_shard` measures the
loader's own host memory: a few shards (a box, its converted copy, a read chunk), against the
whole parameter (4 shards on the second mesh) that such a loader would hold.

Run: `python scripts/hf_load_memory.py [--dir DIR] [--load DIR] [--mesh NAME]` (Linux; 8 fake CPU
devices when no accelerator is present). `--load DIR` only measures (the checkpoint must exist).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=50176, hidden_size=1024, intermediate_size=1024, num_layers=2,
              num_heads=8, num_kv_heads=4, head_dim=128)


def write_checkpoint(path: str, seed: int = 0) -> None:
    """A random checkpoint in HF format, one shard file at a time (embed | lm_head | the rest)."""
    from flax import nnx
    from safetensors.numpy import save_file

    from tpurl.models import abstract_model
    from tpurl.models.config import ModelConfig
    from tpurl.models.hf import config_to_hf
    from tpurl.models.hf_mapping import param_tensors

    cfg = ModelConfig(**CONFIG)
    files = [[], [], []]
    for key, var in nnx.to_flat_state(nnx.state(abstract_model(cfg))):
        param = tuple(str(k) for k in key)
        files[{("embed_tokens",): 0, ("lm_head",): 1}.get(param, 2)] += param_tensors(param, var.get_value().shape)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        arrays = {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in tensors}
        save_file(arrays, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({t: name for t in arrays})
        del arrays
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


MESHES = {"fsdp4_tp2": ((4, 2), ("fsdp", "tensor")), "data2_fsdp2_tp2": ((2, 2, 2), ("data", "fsdp", "tensor"))}


def measure_load(path: str, mesh_name: str = "fsdp4_tp2") -> dict:
    """Load `path` into the FSDP x TP layout on mesh `mesh_name` (see `MESHES`) in this process
    and report memory and time."""
    import jax
    from jax.sharding import Mesh

    from tpurl.models import abstract_model
    from tpurl.models.hf import load_hf_checkpoint, load_hf_config
    from tpurl.sharding.layout import Layout

    cfg = load_hf_config(path)
    shape, axes = MESHES[mesh_name]
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(shape), axes)
    layout = Layout(name="fsdp_tp", rules=(("embed", ("fsdp",)), ("vocab", ("tensor",)), ("heads", ("tensor",)),
                                            ("kv_heads", ("tensor",)), ("mlp", ("tensor",))))
    shardings = layout.param_shardings(abstract_model(cfg), mesh)
    jax.device_put(np.zeros(8, np.float32), jax.devices()[1]).block_until_ready()  # start the runtime
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _status("VmRSS")
    tracemalloc.start()
    start = time.perf_counter()
    model = load_hf_checkpoint(path, config=cfg, shardings=shardings)
    leaves = jax.tree.leaves(jax.block_until_ready(model))
    load_s = time.perf_counter() - start
    peak, after = _status("VmHWM"), _status("VmRSS")
    host_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    max_shard = max(s.data.nbytes for x in leaves for s in x.addressable_shards)
    model_bytes = sum(x.nbytes for x in leaves)
    device_bytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    emb = model.embed_tokens[...]
    return {
        "mesh": mesh_name, "model_bytes": model_bytes, "device_bytes": device_bytes,
        "peak_over_base": peak - base, "after_over_base": after - base,
        "peak_over_model": round((peak - base) / model_bytes, 4),
        "peak_over_device": round((peak - base) / device_bytes, 4), "host_peak_bytes": host_peak,
        "max_shard_bytes": max_shard, "host_peak_over_shard": round(host_peak / max_shard, 3),
        "load_s": round(load_s, 3),
        "embed_shard_shapes": sorted({tuple(s.data.shape) for s in emb.addressable_shards}),
        # a few values for callers that check what was loaded
        "embed_corner": np.asarray(emb[:2, :3]).tolist(),
        "lm_head_corner": np.asarray(model.lm_head[...][-3:, -2:]).tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--load", help="only measure loading this existing checkpoint")
    parser.add_argument("--mesh", choices=list(MESHES), action="append",
                        help="mesh(es) to load into (default: all)")
    args = parser.parse_args()
    meshes = args.mesh or list(MESHES)
    if args.load:
        # One mesh per process: each load needs a high-water mark of its own.
        if args.mesh and len(args.mesh) > 1:
            parser.error("--load measures one --mesh per process")
        print(json.dumps(measure_load(args.load, meshes[0])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or tmp
        write_checkpoint(path)
        for name in meshes:
            # A fresh process, so that the high-water mark counts nothing but the load.
            out = subprocess.run([sys.executable, __file__, "--load", path, "--mesh", name], check=True,
                                 capture_output=True, text=True)
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("hf_load_memory")
    main()
