"""`tpurl layouts`: every parameter's spec in the train and rollout layouts, bytes per device, and
what a train -> rollout weight sync moves. Nothing is allocated: shapes come from `nnx.eval_shape`
and the mesh is an `AbstractMesh`, so `--devices 256` plans a pod on a laptop.

    tpurl layouts --model qwen3-8b --mesh fsdp_tp4 --devices 64 --train fsdp_tp --rollout tp
    tpurl layouts --gin_file configs/demo.gin --gin_param 'tpurl.ShardingConfig.rollout_layout="tp_replicas"'

Gin supplies the model (`tpurl.model_preset.name = ...` or a bound `tpurl.ModelConfig`) and the
`tpurl.ShardingConfig`; flags override it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TextIO

import gin
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from tpurl.configurables import parse_gin
from tpurl.models.config import ModelConfig, preset
from tpurl.models.transformer import abstract_model
from tpurl.sharding.mesh import MeshConfig
from tpurl.sharding.plan import human_bytes, sync_cost
from tpurl.sharding.presets import MESH_PRESETS, ShardingConfig, layout_preset, mesh_preset


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tpurl layouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. 'A.b=1' (repeatable)")
    ap.add_argument("--model", help="model preset name (overrides gin)")
    ap.add_argument("--mesh", help=f"mesh preset ({', '.join(MESH_PRESETS)}) or sizes like 2,2,2 "
                                   "(overrides gin)")
    ap.add_argument("--axes", default="data,fsdp,tensor", help="mesh axis names for --mesh sizes")
    ap.add_argument("--devices", type=int, help="device count to plan for (default: this machine's)")
    ap.add_argument("--train", help="train layout preset (overrides gin)")
    ap.add_argument("--rollout", help="rollout layout preset (overrides gin)")
    ap.add_argument("--rollout_dtype", help="dtype of the rollout weights, e.g. bfloat16 (default: as stored)")
    return ap


def _model_config(args) -> ModelConfig:
    if args.model:
        return preset(args.model)
    if gin.get_bindings("tpurl.model_preset"):
        return gin.get_configurable("tpurl.model_preset")()
    if gin.get_bindings("tpurl.ModelConfig"):
        return gin.get_configurable("tpurl.ModelConfig")()
    raise ValueError("no model: pass --model PRESET or bind tpurl.model_preset.name (or tpurl.ModelConfig) in gin")


def _mesh_config(spec: str, axes: str) -> MeshConfig:
    if spec in MESH_PRESETS:
        return mesh_preset(spec)
    try:
        shape = tuple(int(s) for s in spec.split(","))
    except ValueError:
        raise ValueError(f"--mesh {spec!r} is neither a mesh preset ({', '.join(MESH_PRESETS)}) "
                         "nor comma-separated sizes like 2,2,2") from None
    return MeshConfig(axes=tuple(a.strip() for a in axes.split(",")), shape=shape)


def _sharding_config(args) -> ShardingConfig:
    cfg = gin.get_configurable("tpurl.ShardingConfig")()
    return ShardingConfig(mesh=_mesh_config(args.mesh, args.axes) if args.mesh else cfg.mesh,
                          train_layout=layout_preset(args.train) if args.train else cfg.train_layout,
                          rollout_layout=layout_preset(args.rollout) if args.rollout else cfg.rollout_layout)


def _spec_str(spec) -> str:
    return "P(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def report(model: ModelConfig, sharding: ShardingConfig, num_devices: int, rollout_dtype=None,
           out: TextIO | None = None) -> dict:
    """Print the plan; return its numbers: `{"train": bytes per device, "rollout": ..., "sync": SyncCost}`."""
    out = out or sys.stdout
    sizes = sharding.mesh.sizes(num_devices)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    state = abstract_model(model)
    total = model.num_params()
    print(f"model {model.model_type}: {total / 1e9:.3f} B parameters, {model.param_dtype}; mesh "
          + " x ".join(f"{k}={v}" for k, v in sizes.items()) + f" ({num_devices} devices)", file=out)
    results, placements = {}, {}
    for role, layout in (("train", sharding.train_layout), ("rollout", sharding.rollout_layout)):
        pl = placements[role] = layout.placements(state, mesh)
        dtype = rollout_dtype if role == "rollout" and rollout_dtype else None

        def nbytes(p):
            return math.prod(p.shard_shape) * jnp.dtype(dtype or p.dtype).itemsize

        per_dev = sum(nbytes(p) for p in pl)
        results[role] = int(per_dev)
        print(f"\n{role} layout {layout.name!r}: {human_bytes(per_dev)} of parameters per device"
              + (f" (as {jnp.dtype(dtype).name})" if dtype else ""), file=out)
        w = max(len(p.path) for p in pl)
        print(f"  {'parameter':<{w}}  {'shape':<18} {'logical axes':<38} {'spec':<40} per device", file=out)
        for p in pl:
            logical = "(" + ", ".join(str(n) for n in p.logical) + ")"
            print(f"  {p.path:<{w}}  {str(p.shape):<18} {logical:<38} {_spec_str(p.spec):<40} "
                  f"{human_bytes(nbytes(p))}", file=out)
            for note in p.fallbacks:
                print(f"  {'':<{w}}  note: {note}", file=out)
    cost = sync_cost(placements["train"], placements["rollout"], sizes, dst_dtype=rollout_dtype)
    results["sync"] = cost
    print(f"\nsync {sharding.train_layout.name!r} -> {sharding.rollout_layout.name!r}: moves "
          f"{human_bytes(cost.total_bytes)} in total, at most {human_bytes(cost.max_device_bytes)} into one device",
          file=out)
    for path, nbytes in cost.per_param.items():
        print(f"  {path:<{max(map(len, cost.per_param))}}  {human_bytes(nbytes) if nbytes else 'local copy only'}",
              file=out)
    return results


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        parse_gin(args.gin_file, args.gin_param)
        model = _model_config(args)
        sharding = _sharding_config(args)
        if args.rollout_dtype:
            jnp.dtype(args.rollout_dtype)  # validate early: a one-line error instead of a trace
        report(model, sharding, args.devices or jax.device_count(), args.rollout_dtype)
    except (ValueError, TypeError) as e:
        print(f"tpurl layouts: {e}", file=sys.stderr)
        return 2
    return 0

