"""What a weight sync compiles to: the collectives of the train -> rollout resharding, per layout pair.

For each (train layout, rollout layout) pair on one 8-device mesh, lowers the sync as the `jit`
method runs it (`tpurl.sync.reshard`: one program that casts every leaf to the rollout dtype in
its train layout, then constrains it to the rollout layout), compiles it for this backend and
counts the collective operations in the optimized HLO, with the bytes each kind outputs per
device. Next to them: the bytes the planner's arithmetic says the sync must move
(`tpurl.sharding.cost.sync_cost`, summed over receiving devices), and the parameter bytes a disk
round trip would write and read back.

Prints one JSON object (last line). Nothing is allocated: the programs are compiled from shapes.

Run: `python scripts/sync_collectives.py [--size 50m] [--mesh 1,4,2] [--pairs fsdp_tp:tp,...]`.
The HLO is the backend's (XLA:CPU here; GPU and TPU compilers may choose other collectives for
the same resharding, e.g. all-to-all where CPU emits all-gather + dynamic-slice).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tpurl.models import abstract_model, preset  # noqa: E402
from tpurl.sharding import MeshConfig, layout_preset, make_mesh  # noqa: E402
from tpurl.sharding.cost import sync_cost  # noqa: E402
from tpurl.sync.reshard import cast_then_reshard_program  # noqa: E402

from bench_sync import SIZES  # noqa: E402  (the benchmark's model sizes, run from scripts/)

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
# `%name = f32[4,128]{1,0} all-gather(...)` or a tuple `(f32[..]{..}, f32[..]{..}) all-to-all(...)`
# (also the `-start` halves of asynchronous collectives).
_OP = re.compile(r"=\s+(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8}


def collectives_in(hlo: str) -> dict[str, dict]:
    """`{kind: {"count": n, "bytes": output bytes per device, "dtypes": [...]}}` of the
    collectives in HLO text (the dtypes they move: a backend may upcast around a collective)."""
    out: dict[str, dict] = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0, "dtypes": set()})
        entry["count"] += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            entry["bytes"] += _BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
            entry["dtypes"].add(dtype)
    return {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(out.items())}


def sync_program_hlo(abstract, train, rollout, mesh, dtype) -> str:
    """The optimized HLO of the `jit`-method sync of every parameter leaf, compiled from shapes."""
    src = train.param_shardings(abstract, mesh)
    dst = rollout.param_shardings(abstract, mesh)
    leaves, src_l, dst_l = jax.tree.leaves(abstract), jax.tree.leaves(src), jax.tree.leaves(dst)
    xs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, src_l)]
    dtypes = tuple(jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype for x in leaves)
    lowered = cast_then_reshard_program(dtypes, tuple(src_l), tuple(dst_l)).lower(xs)
    return lowered.compile().as_text()


def pair_report(abstract, train_name: str, rollout_name: str, mesh, dtype) -> dict:
    train, rollout = layout_preset(train_name), layout_preset(rollout_name)
    cost = sync_cost(train.placements(abstract, mesh), rollout.placements(abstract, mesh), mesh,
                     dst_dtype=jnp.dtype(dtype))
    return {"train_layout": train_name, "rollout_layout": rollout_name,
            "collectives": collectives_in(sync_program_hlo(abstract, train, rollout, mesh, dtype)),
            "planned_bytes_moved_total": cost.total_bytes, "planned_bytes_moved_max_device": cost.max_device_bytes,
            "local_only_params": len(cost.local_only)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="50m", choices=sorted(SIZES))
    ap.add_argument("--mesh", default="1,4,2", help="(data, fsdp, tensor) shape over 8 devices")
    ap.add_argument("--pairs", default="fsdp_tp:tp,fsdp_tp:tp_replicas,fsdp:tp,fsdp_tp:fsdp_tp",
                    help="comma-separated train:rollout layout preset pairs")
    ap.add_argument("--dtype", default="bfloat16", help="rollout dtype")
    args = ap.parse_args(argv)
    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=shape))
    cfg = preset("tiny", **SIZES[args.size])
    abstract = nnx.state(abstract_model(cfg))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    rollout_bytes = param_bytes * jnp.dtype(args.dtype).itemsize // 4
    pairs = [pair_report(abstract, *p.split(":"), mesh, args.dtype) for p in args.pairs.split(",")]
    print(json.dumps({"backend": jax.default_backend(), "size": args.size, "params": cfg.num_params(),
                      "mesh": dict(mesh.shape), "rollout_dtype": args.dtype,
                      "disk_round_trip_bytes": {"write_fp32": param_bytes, "read_rollout_dtype": rollout_bytes},
                      "pairs": pairs}))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("sync_collectives")
    raise SystemExit(main())
