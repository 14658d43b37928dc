"""Every layout preset on every test mesh: loss, logits and gradients equal a single-device run.

Test meshes on the 8 fake CPU devices. 3-D shapes are (data, fsdp, tensor). The 1-D (8,) mesh is
`fsdp` (pure tensor parallelism is already (1, 1, 8)), and the 2-D (2, 4) mesh is (fsdp, tensor),
the classic FSDP x TP grid. Every preset uses every device of every mesh (see presets.py), so each
combination exercises a different partitioning.

Compiles dominate the runtime (2 shared cores), so most runs compile with `FAST` options: no LLVM
backend optimization and the classic (non-"fusion emitter") CPU code generator, which cuts a
compile from ~2 s to ~0.5 s of CPU. Neither changes SPMD partitioning, where the known miscompile
lives (the reproducer below still fails with them); the standard train layout on the 3-D mesh is
also checked with the default compiler options.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from tpurl.models import forward_logits, init_model, preset
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS, layout_preset
from tpurl.train.parity import (compare, grad_parity, lm_loss, miscompile_case, sharded_run, single_device_run,
                                  usable_compiler_options)
from xla_flags import XLA_DEFAULTS

# XLA debug flags that a future XLA may rename or drop: keep those the backend accepts.
FAST = usable_compiler_options({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False})
MESHES = {
    "8": MeshConfig(axes=("fsdp",), shape=(8,)),
    "2x4": MeshConfig(axes=("fsdp", "tensor"), shape=(2, 4)),
    "2x2x2": MeshConfig(shape=(2, 2, 2)),
    "1x1x8": MeshConfig(shape=(1, 1, 8)),
    "4x1x2": MeshConfig(shape=(4, 1, 2)),
}
# 8 query heads so that 8-way tensor parallelism divides; 2 KV heads exercise the replication
# fallback (tensor=4, 8); small vocab keeps the logits cheap.
CFG = preset("tiny", vocab_size=64, num_heads=8, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def lm():
    graphdef, params = nnx.split(init_model(CFG, seed=1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (8, 8)).astype(np.int32)
    valid = np.ones((8, 8), bool)
    valid[1, :3] = False  # left padding
    valid[2, 5:] = False  # right padding
    batch = {"tokens": jnp.asarray(tokens), "valid": jnp.asarray(valid)}
    loss_fn = lm_loss(graphdef)
    reference = single_device_run(loss_fn, params, batch, compiler_options=FAST)
    return graphdef, params, batch, loss_fn, reference


@pytest.fixture(scope="module")
def meshes(devices):
    return {name: make_mesh(cfg) for name, cfg in MESHES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("layout_name", list(LAYOUT_PRESETS))
def test_layout_matches_single_device(lm, meshes, layout_name, mesh_name):
    _, params, batch, loss_fn, reference = lm
    report = grad_parity(loss_fn, params, batch, layout=layout_preset(layout_name), mesh=meshes[mesh_name],
                         reference=reference, compiler_options=FAST)
    assert report.ok(1e-5), report.summary()
    assert set(report.grad_errs) == set(reference.grads) and len(reference.grads) == 12


@pytest.mark.slow
def test_standard_train_layout_with_default_compiler_options(lm, meshes):
    _, params, batch, loss_fn, _ = lm
    report = grad_parity(loss_fn, params, batch, layout=layout_preset("fsdp_tp"), mesh=meshes["2x2x2"],
                         compiler_options=usable_compiler_options(XLA_DEFAULTS))  # not the tests' fast flags
    assert report.ok(1e-5), report.summary()


@pytest.mark.slow
def test_attention_query_blocks_match_single_device(meshes):
    """Sequences long enough for the attention's three causal query blocks (96 tokens, left and
    right padding): the standard train layout on the 3-D mesh equals a single-device run."""
    graphdef, params = nnx.split(init_model(CFG.replace(max_position_embeddings=128), seed=2))
    rng = np.random.default_rng(1)
    valid = np.ones((8, 96), bool)
    valid[1, :40] = False
    valid[2, 70:] = False
    batch = {"tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (8, 96)), jnp.int32), "valid": jnp.asarray(valid)}
    assert CFG.attention_query_blocks == 3
    report = grad_parity(lm_loss(graphdef), params, batch, layout=layout_preset("fsdp_tp"), mesh=meshes["2x2x2"],
                         compiler_options=FAST)
    assert report.ok(1e-5), report.summary()


def test_reference_is_a_real_loss(lm):
    """Guards the parity tests against comparing zeros: a finite loss near log(V), nonzero grads."""
    *_, reference = lm
    assert abs(float(reference.loss) - np.log(CFG.vocab_size)) < 0.5
    assert all(np.abs(g).max() > 0 for g in reference.grads.values())


def test_harness_catches_cpu_fsdp_tp_miscompile(meshes):
    """Without compute constraints XLA CPU gets FSDP x TP gradients wrong
    (docs/xla_cpu_fsdp_tp_miscompile.md).

    This documents the bug (and that the harness sees it); the same case with
    `compute_constrain` is right. If it starts passing unconstrained, the JAX in use no longer
    miscompiles it: update the doc and the `Layout` docstring in tpurl/sharding/layout.py.
    """
    if jax.default_backend() != "cpu":
        pytest.skip("the miscompile is documented for the CPU backend")
    loss_fn, params, batch = miscompile_case()
    mesh, layout = meshes["2x2x2"], layout_preset("fsdp_tp")
    reference = single_device_run(loss_fn, params, batch, compiler_options=FAST)
    bad = compare(sharded_run(loss_fn, params, batch, layout=layout, mesh=mesh, constrain=False,
                              compiler_options=FAST), reference, layout="fsdp_tp", mesh=mesh, constrained=False)
    good = grad_parity(loss_fn, params, batch, layout=layout, mesh=mesh, reference=reference, compiler_options=FAST)
    assert bad.loss_err < 1e-5 and bad.aux_err < 1e-5, bad.summary()  # the forward pass is right ...
    assert bad.grad_errs["w_in"] > 1e-2, (
        f"the documented miscompile does not reproduce on jax {jax.__version__}: {bad.summary()}")  # ... grads not
    assert good.ok(1e-5), good.summary()


def _sharding_constraints(jaxpr):
    """(operand shape, sharding) of every sharding constraint in `jaxpr` and its sub-jaxprs
    (the layer scan, remat, nested jits)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            yield eqn.invars[0].aval.shape, eqn.params["sharding"]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    yield from _sharding_constraints(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    yield from _sharding_constraints(sub)


def test_real_model_fsdp_tp_gradients_come_through_the_compute_sharding(lm, meshes):
    """The standard train layout on the real model: gradients equal a single-device run, and
    every weight reaches its use pinned to its compute sharding (its parameter sharding without
    `fsdp`; per layer inside the scan), the workaround of docs/xla_cpu_fsdp_tp_miscompile.md.

    The tiny transformer's own matmul chains do not trigger the miscompile on this JAX (see the
    doc), so its gradients alone would not notice the workaround going missing: the pinning is
    checked in the traced program. This fails if `Layout.compute_constrain` becomes a no-op or a
    layer stops passing a weight through `constrain`.
    """
    _, params, batch, loss_fn, reference = lm
    mesh, layout = meshes["2x2x2"], layout_preset("fsdp_tp")
    report = grad_parity(loss_fn, params, batch, layout=layout, mesh=mesh, reference=reference,
                         compiler_options=FAST)
    assert report.ok(1e-5), report.summary()
    placed = jax.device_put(params, layout.param_shardings(params, mesh))
    traced = jax.make_jaxpr(jax.value_and_grad(lambda p, b: loss_fn(p, b, layout.compute_constrain(mesh)),
                                               has_aux=True))(placed, batch)
    pinned = list(_sharding_constraints(traced.jaxpr))
    for p in layout.placements(params, mesh):
        stacked = p.logical[0] == "layers"
        names, shape = (p.logical[1:], p.shape[1:]) if stacked else (p.logical, p.shape)
        want = jax.sharding.NamedSharding(mesh, layout.spec(names, mesh, compute=True))
        assert any(got_shape == shape and got.is_equivalent_to(want, len(shape)) for got_shape, got in pinned), (
            f"{p.path}{shape} is never constrained to its compute sharding {want.spec}")


@pytest.mark.parametrize("mesh_name", ["2x4", "2x2x2"])
@pytest.mark.parametrize("layout_name", ["tp", "tp_replicas"])
def test_rollout_forward_matches_single_device(lm, meshes, layout_name, mesh_name):
    """Inference-only forward (no grad) with the weights placed in a rollout layout."""
    graphdef, params, batch, _, _ = lm
    mesh, layout = meshes[mesh_name], layout_preset(layout_name)

    def logits(p, tokens, valid, constrain):
        return forward_logits(nnx.merge(graphdef, p), tokens, valid, constrain=constrain)

    def run(constrain, *args):
        return jax.jit(lambda p, t, v: logits(p, t, v, constrain)).lower(*args).compile(FAST or None)(*args)

    want = run(None, params, batch["tokens"], batch["valid"])
    placed = jax.device_put(params, layout.param_shardings(params, mesh))
    tokens, valid = (jax.device_put(batch[k], layout.batch_sharding(mesh, 2)) for k in ("tokens", "valid"))
    got = run(layout.compute_constrain(mesh), placed, tokens, valid)
    assert got.sharding.spec[0] == layout.batch_sharding(mesh, 2).spec[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unsupported_compiler_options_fall_back_to_defaults():
    """A flag the backend rejects (renamed or dropped by a newer XLA) is left out, not fatal."""
    got = usable_compiler_options({"xla_backend_optimization_level": 0, "xla_no_such_flag_anymore": True,
                                   "xla_cpu_use_fusion_emitters": "not a bool"})
    assert got == {"xla_backend_optimization_level": 0}
    assert usable_compiler_options(None) == {}
