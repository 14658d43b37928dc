"""Gradient parity: a loss and its gradients under a layout on a mesh vs a single-device run.

Every layout tpurl offers must pass this check (`tpurl check-layouts`; tests/sharding/test_parity.py), because the XLA CPU
backend miscompiles the gradients of the standard FSDP x TP layout unless the weights are pinned to
their compute sharding (see `layout.py`). The harness places the parameters with
`layout.param_shardings`, the batch with `layout.batch_sharding`, runs `jax.value_and_grad` inside
`jax.jit` with `constrain=layout.compute_constrain(mesh)` (or with no constraint at all, to
reproduce the bug), and reports relative errors per parameter.

A loss function here is `loss_fn(params, batch, constrain) -> (loss, aux)`: `params` an
`nnx.State` of `nnx.Param`s with `logical_axes`, `batch` a dict of `[B, ...]` arrays, `constrain`
the layout's `(x, logical_axes) -> x` (identity for the reference). `aux` (e.g. logits) is compared
too, which checks the forward pass under the layout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpurl.models.attention import DenseAttention
from tpurl.models.transformer import identity_constrain, positions_from_mask
from tpurl.sharding.layout import Layout, path_str

log = logging.getLogger(__name__)
LossFn = Callable[[nnx.State, Mapping[str, jax.Array], Callable], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class Run:
    """Host copies of one run's loss, aux and gradients (gradients keyed by parameter path)."""

    loss: np.ndarray
    aux: Any
    grads: dict[str, np.ndarray]


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {path_str(p): np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in leaves}


@functools.lru_cache(maxsize=None)
def _accepts_option(backend: str, name: str, value) -> bool:
    try:
        jax.jit(lambda x: x + 1, backend=backend).lower(jnp.zeros((), jnp.float32)).compile(
            compiler_options={name: value})
    except Exception:  # noqa: BLE001 -- the backend's rejection type is not part of JAX's API
        return False
    return True


def usable_compiler_options(options: Mapping[str, Any] | None, backend: str | None = None) -> dict[str, Any]:
    """The subset of XLA `compiler_options` that the backend accepts (probed once per option).

    Options such as `xla_cpu_use_fusion_emitters` are XLA debug flags that a newer XLA may rename
    or drop; a harness that only uses them for speed should then fall back to the defaults, not
    fail. Rejected options are logged and left out.
    """
    backend = backend or jax.default_backend()
    kept = {}
    for name, value in (options or {}).items():
        if _accepts_option(backend, name, value):
            kept[name] = value
        else:
            log.warning("compiler option %s=%r is not accepted by the %s backend; using its default",
                        name, value, backend)
    return kept


def _run(loss_fn: LossFn, params, batch, constrain, compiler_options) -> Run:
    step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, constrain), has_aux=True))
    compiled = step.lower(params, batch).compile(compiler_options=usable_compiler_options(compiler_options) or None)
    (loss, aux), grads = compiled(params, batch)
    return Run(loss=np.asarray(loss), aux=jax.tree.map(np.asarray, aux), grads=_flat(grads))


def single_device_run(loss_fn: LossFn, params, batch, *, device: jax.Device | None = None,
                      compiler_options: dict | None = None) -> Run:
    """The reference: everything on one device, no sharding constraints."""
    device = device or jax.devices()[0]
    params, batch = jax.device_put((params, batch), device)
    return _run(loss_fn, params, batch, identity_constrain, compiler_options)


def sharded_run(loss_fn: LossFn, params, batch, *, layout: Layout, mesh: jax.sharding.Mesh, constrain: bool = True,
                compiler_options: dict | None = None) -> Run:
    """Loss, aux and gradients with parameters and batch placed by `layout` on `mesh`.

    `constrain=False` drops the compute constraints (the model then sees no sharding hints at all);
    on CPU that reproduces the FSDP x TP gradient miscompile. Use it only to demonstrate the bug.
    """
    params = jax.device_put(params, layout.param_shardings(params, mesh))
    batch = {k: jax.device_put(v, layout.batch_sharding(mesh, v.ndim)) for k, v in batch.items()}
    return _run(loss_fn, params, batch, layout.compute_constrain(mesh) if constrain else identity_constrain,
                compiler_options)


def rel_err(got, want) -> float:
    """`max|got - want| / max|want|` (absolute when `want` is all zeros)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / (scale if scale > 0 else 1.0) if want.size else 0.0


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """Relative errors of a sharded run against the single-device reference."""

    layout: str
    mesh: dict[str, int]
    constrained: bool
    loss_err: float
    aux_err: float
    grad_errs: dict[str, float]

    @property
    def max_grad_err(self) -> float:
        return max(self.grad_errs.values(), default=0.0)

    def ok(self, tol: float = 1e-5) -> bool:
        return max(self.loss_err, self.aux_err, self.max_grad_err) <= tol

    def summary(self) -> str:
        worst = max(self.grad_errs, key=self.grad_errs.get) if self.grad_errs else "-"
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        return (f"layout={self.layout} mesh=({mesh}) constrained={self.constrained}: loss {self.loss_err:.1e}, "
                f"aux {self.aux_err:.1e}, worst grad {self.max_grad_err:.1e} ({worst})")


def compare(run: Run, reference: Run, *, layout: str, mesh: jax.sharding.Mesh, constrained: bool) -> ParityReport:
    aux = jax.tree.leaves(jax.tree.map(rel_err, run.aux, reference.aux))
    return ParityReport(layout=layout, mesh=dict(mesh.shape), constrained=constrained,
                        loss_err=rel_err(run.loss, reference.loss), aux_err=max(aux, default=0.0),
                        grad_errs={k: rel_err(run.grads[k], reference.grads[k]) for k in reference.grads})


def grad_parity(loss_fn: LossFn, params, batch, *, layout: Layout, mesh: jax.sharding.Mesh,
                reference: Run | None = None, constrain: bool = True,
                compiler_options: dict | None = None) -> ParityReport:
    """Run `loss_fn` under `layout` on `mesh` and compare with a single-device run.

    Pass a precomputed `reference` to share it between layouts (one compile instead of many).
    """
    reference = reference or single_device_run(loss_fn, params, batch, compiler_options=compiler_options)
    run = sharded_run(loss_fn, params, batch, layout=layout, mesh=mesh, constrain=constrain,
                      compiler_options=compiler_options)
    return compare(run, reference, layout=layout.name, mesh=mesh, constrained=constrain)


def lm_loss(graphdef: nnx.GraphDef) -> LossFn:
    """Mean next-token cross-entropy of a `Transformer` over `batch["tokens"]`, `batch["valid"]`.

    aux = the float32 logits `[B, T, V]`, so that the forward pass is compared as well.

    Deliberately a plain full-vocabulary log-softmax rather than `tpurl.train.logprobs`: this
    harness tests the *layouts*, so its loss must not depend on the trainer's chunked scorer (a bug
    there would show up as a layout failure, or be hidden by it), and it needs the full logits as
    aux anyway.
    """

    def loss_fn(params, batch, constrain):
        model = nnx.merge(graphdef, params)
        tokens, valid = batch["tokens"], batch["valid"]
        hidden, _ = model(tokens, positions_from_mask(valid), attention=DenseAttention(valid), constrain=constrain)
        logits_BTV = model.logits(hidden, constrain)
        logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1], axis=-1)
        nll_BT = -jnp.take_along_axis(logp_BTV, tokens[:, 1:, None], axis=-1)[..., 0]
        mask_BT = (valid[:, 1:] & valid[:, :-1]).astype(jnp.float32)
        return jnp.sum(nll_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0), logits_BTV

    return loss_fn


def miscompile_case(seed: int = 0) -> tuple[LossFn, nnx.State, dict[str, jax.Array]]:
    """The two-matmul reproducer of the XLA CPU FSDP x TP gradient miscompile
    (`docs/xla_cpu_fsdp_tp_miscompile.md`).

    `sum((tanh(x @ w_in) @ w_out) ** 2)` with `x[B, T, D]` (a 3-D batch: 2-D does not reproduce),
    `w_in[D, F]`, `w_out[F, D]`, both *stored* as `[dim0_fsdp, dim1_tensor]` as in the reproducer
    (so `w_out` is labelled `("embed", "mlp")`: the labels only choose the storage spec here).
    Under `fsdp_tp` on a (2, 2, 2) CPU mesh without compute constraints the gradient of `w_in` is
    wrong where the backend miscompiles (relative error ~0.6); with them both match to ~3e-7.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16, 32)).astype(np.float32)
    params = nnx.State({
        "w_in": nnx.Param(jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32) / 6),
                          logical_axes=("embed", "mlp")),
        "w_out": nnx.Param(jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32) / 8),
                           logical_axes=("embed", "mlp")),
    })

    def loss_fn(p, batch, constrain):
        w_in = constrain(p["w_in"][...], ("embed", "mlp"))
        w_out = constrain(p["w_out"][...], ("embed", "mlp"))
        y = jnp.tanh(batch["x"] @ w_in) @ w_out
        return jnp.sum(y ** 2), y

    return loss_fn, params, {"x": jnp.asarray(x)}
