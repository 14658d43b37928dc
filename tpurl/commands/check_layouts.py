"""`tpurl check-layouts`: gradient parity of every layout preset against a single-device run on
this machine's devices, one JSON line per (mesh, layout), plus the FSDP x TP miscompile reproducer
with and without the compute-sharding constraint (`tpurl.train.parity`).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpurl.commands.common import ArgumentParser
from tpurl.models import init_model, preset
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS
from tpurl.train.parity import grad_parity, lm_loss, miscompile_case, single_device_run


def parity_meshes(n: int) -> list[MeshConfig]:
    """The parity test's mesh shapes scaled to `n` devices (those that fit)."""
    shapes = [(("fsdp",), (n,)), (("data", "fsdp", "tensor"), (1, 1, n))]
    if n % 2 == 0:
        shapes += [(("fsdp", "tensor"), (2, n // 2)), (("data", "fsdp", "tensor"), (n // 2, 1, 2))]
    if n % 4 == 0:
        shapes += [(("data", "fsdp", "tensor"), (2, 2, n // 4))]
    return [MeshConfig(axes=a, shape=s) for a, s in shapes]


def main(argv: list[str] | None = None) -> int:
    """Parity of every preset on this machine's devices, as JSON lines, plus the unconstrained
    miscompile reproducer (to check a GPU/TPU backend for the bug)."""
    ArgumentParser(prog="tpurl check-layouts", description=__doc__.split("\n\n")[0]).parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    n = jax.device_count()
    width = max(8, n)
    cfg = preset("tiny", vocab_size=8 * width, hidden_size=8 * width, intermediate_size=16 * width,
                 num_heads=width, num_kv_heads=2, head_dim=8)
    graphdef, params = nnx.split(init_model(cfg, seed=1))
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (width, 8)), jnp.int32),
             "valid": jnp.ones((width, 8), bool)}
    loss_fn = lm_loss(graphdef)
    reference = single_device_run(loss_fn, params, batch)
    for mesh_cfg in parity_meshes(n):
        mesh = make_mesh(mesh_cfg)
        for layout in LAYOUT_PRESETS.values():
            r = grad_parity(loss_fn, params, batch, layout=layout, mesh=mesh, reference=reference)
            print(json.dumps({"backend": jax.default_backend(), **dataclasses.asdict(r), "ok": r.ok()}), flush=True)
    if n % 8 == 0:
        case_fn, case_params, case_batch = miscompile_case()
        mesh = make_mesh(MeshConfig(shape=(2, 2, n // 4)))
        for constrain in (False, True):
            r = grad_parity(case_fn, case_params, case_batch, layout=LAYOUT_PRESETS["fsdp_tp"], mesh=mesh,
                            constrain=constrain)
            print(json.dumps({"backend": jax.default_backend(), "case": "miscompile_repro", **dataclasses.asdict(r),
                              "ok": r.ok()}), flush=True)
    return 0
