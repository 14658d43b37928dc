"""`tpurl layouts`: every parameter's spec in the train and rollout layouts, bytes per device, and
what a train -> rollout weight sync moves. Nothing is allocated: shapes come from `nnx.eval_shape`
and the mesh is an `AbstractMesh`, so `--devices 256` plans a pod on a laptop.

    tpurl layouts --model qwen3-8b --mesh fsdp_tp4 --devices 64 --train fsdp_tp --rollout tp
    tpurl layouts --gin_file configs/demo.gin --gin_param 'tpurl.RLConfig.rollout_layout="tp_replicas"'

Gin supplies the job: an RL job's `tpurl.RLConfig` (model, layouts, `PlacementConfig` meshes,
colocated or disaggregated; its defaults where unbound). Without gin the job is the flags, with
`RLConfig`'s defaults: train layout `fsdp_tp`, rollout layout `tp`, mesh `fsdp`. Flags override gin.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import TextIO

import gin
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from tpurl.commands.common import EXPECTED_ERRORS, ArgumentParser, fail
from tpurl.models.config import ModelConfig, preset
from tpurl.models.transformer import abstract_model
from tpurl.sharding.cost import DeviceGrid, human_bytes, human_count, sync_cost
from tpurl.sharding.layout import Layout
from tpurl.sharding.mesh import MeshConfig
from tpurl.sharding.presets import MESH_PRESETS, layout_preset, mesh_preset


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="tpurl layouts", description=__doc__.split("\n\n")[0])
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


def _parse_gin(files, bindings) -> bool:
    """Parse the job's gin, if any; returns whether there was any.

    `tpurl.commands.gin_config` registers every subsystem's configs (it imports the rollout engine, the
    RL loop, ...), so it is imported only when gin is given: planning from flags alone needs none
    of it, and keeps working while another subsystem is broken or being edited.
    """
    if not files and not bindings:
        return False
    from tpurl.commands.gin_config import parse_gin

    parse_gin(files, bindings)
    return True


def _model_config(args) -> ModelConfig:
    if args.model:
        return preset(args.model)
    raise ValueError("no model: pass --model PRESET or a gin file with an RL job (tpurl.RLConfig.model)")


def _mesh_config(spec: str, axes: str) -> MeshConfig:
    if spec in MESH_PRESETS:
        return mesh_preset(spec)
    try:
        shape = tuple(int(s) for s in spec.split(","))
    except ValueError:
        raise ValueError(f"--mesh {spec!r} is neither a mesh preset ({', '.join(MESH_PRESETS)}) "
                         "nor comma-separated sizes like 2,2,2") from None
    return MeshConfig(axes=tuple(a.strip() for a in axes.split(",")), shape=shape)


@dataclasses.dataclass(frozen=True)
class LayoutJob:
    """What `tpurl layouts` plans: a model, the two layouts and their meshes.

    `split`: `(train_devices, rollout_devices)` when the pools are disaggregated (disjoint
    devices), None when colocated (both meshes over the same devices).
    """

    model: ModelConfig
    train_layout: Layout
    rollout_layout: Layout
    train_mesh: MeshConfig
    rollout_mesh: MeshConfig
    split: tuple[int, int] | None = None


def _job(args, num_devices: int, use_gin: bool = True) -> LayoutJob:
    """From gin (the `RLConfig` job), then flag overrides; without gin, from the flags."""
    if not use_gin:
        # RLConfig's defaults, without importing the RL package (see `_parse_gin`).
        job = LayoutJob(model=None, train_layout=layout_preset("fsdp_tp"), rollout_layout=layout_preset("tp"),
                        train_mesh=mesh_preset("fsdp"), rollout_mesh=mesh_preset("fsdp"))
    else:
        rl = gin.get_configurable("tpurl.RLConfig")()
        placement = rl.placement
        job = LayoutJob(model=rl.model, train_layout=rl.train_layout, rollout_layout=rl.rollout_layout,
                        train_mesh=placement.train_mesh, rollout_mesh=placement.rollout_mesh,
                        split=None if placement.mode == "colocated" else placement.split(num_devices))
    changes = {}
    if args.model or job.model is None:
        changes["model"] = _model_config(args)
    if args.mesh:
        changes["train_mesh"] = changes["rollout_mesh"] = _mesh_config(args.mesh, args.axes)
    if args.train:
        changes["train_layout"] = layout_preset(args.train)
    if args.rollout:
        changes["rollout_layout"] = layout_preset(args.rollout)
    return dataclasses.replace(job, **changes)


def _spec_str(spec) -> str:
    return "P(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def _abstract_mesh(cfg: MeshConfig, num_devices: int) -> AbstractMesh:
    sizes = cfg.sizes(num_devices)
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def _mesh_str(mesh: AbstractMesh) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({mesh.size} devices)"


def report(job: LayoutJob, num_devices: int, rollout_dtype=None, out: TextIO | None = None) -> dict:
    """Print the plan; return its numbers: `{"train": bytes per device, "rollout": ..., "sync": SyncCost}`."""
    out = out or sys.stdout
    n_train, n_rollout = job.split or (num_devices, num_devices)
    meshes = {"train": _abstract_mesh(job.train_mesh, n_train), "rollout": _abstract_mesh(job.rollout_mesh, n_rollout)}
    state = abstract_model(job.model)
    print(f"model {job.model.model_type}: {human_count(job.model.num_params())} parameters, {job.model.param_dtype}; "
          + ("disaggregated" if job.split else "colocated"), file=out)
    results, placements = {}, {}
    for role, layout in (("train", job.train_layout), ("rollout", job.rollout_layout)):
        pl = placements[role] = layout.placements(state, meshes[role])
        dtype = rollout_dtype if role == "rollout" and rollout_dtype else None

        def nbytes(p):
            return math.prod(p.shard_shape) * jnp.dtype(dtype or p.dtype).itemsize

        per_dev = sum(nbytes(p) for p in pl)
        results[role] = int(per_dev)
        print(f"\n{role} layout {layout.name!r} on mesh {_mesh_str(meshes[role])}: {human_bytes(per_dev)} of "
              "parameters per device" + (f" (as {jnp.dtype(dtype).name})" if dtype else ""), file=out)
        w = max(len(p.path) for p in pl)
        print(f"  {'parameter':<{w}}  {'shape':<18} {'logical axes':<38} {'spec':<40} per device", file=out)
        for p in pl:
            logical = "(" + ", ".join(str(n) for n in p.logical) + ")"
            print(f"  {p.path:<{w}}  {str(p.shape):<18} {logical:<38} {_spec_str(p.spec):<40} "
                  f"{human_bytes(nbytes(p))}", file=out)
            for note in p.fallbacks:
                print(f"  {'':<{w}}  note: {note}", file=out)
    # Abstract device ids: colocated meshes share 0..n-1, a disaggregated rollout pool follows the train pool.
    src = DeviceGrid.of(meshes["train"])
    dst = DeviceGrid.of(meshes["rollout"], first_id=n_train if job.split else 0)
    cost = sync_cost(placements["train"], placements["rollout"], src, dst, dst_dtype=rollout_dtype)
    results["sync"] = cost
    print(f"\nsync {job.train_layout.name!r} -> {job.rollout_layout.name!r}: moves "
          f"{human_bytes(cost.total_bytes)} in total, at most {human_bytes(cost.max_device_bytes)} into one device",
          file=out)
    for path, nbytes in cost.per_param.items():
        print(f"  {path:<{max(map(len, cost.per_param))}}  {human_bytes(nbytes) if nbytes else 'local copy only'}",
              file=out)
    return results


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        use_gin = _parse_gin(args.gin_file, args.gin_param)
        num_devices = args.devices or jax.device_count()
        job = _job(args, num_devices, use_gin)
        if args.rollout_dtype:
            try:
                jnp.dtype(args.rollout_dtype)  # validate early: a one-line error instead of a trace
            except TypeError:
                raise ValueError(f"--rollout_dtype {args.rollout_dtype!r} is not a dtype name; use e.g. "
                                 "bfloat16") from None
        report(job, num_devices, args.rollout_dtype)
    except EXPECTED_ERRORS as e:
        return fail("tpurl layouts", e)
    return 0

