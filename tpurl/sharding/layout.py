"""Named layouts: the one place that decides how logical axes map to mesh axes.

A `Layout` maps each logical axis name (see `axes.py`) to zero or more mesh axes. It answers two
questions: where a parameter is *stored* (`param_shardings`, e.g. `W_in[D_fsdp, F_tp]`) and how it
is laid out where it is *used* (`compute_constrain`, e.g. `W_in[D, F_tp]`: the FSDP all-gather made
explicit per layer, inside the scan).

Why an explicit compute sharding (the levanter pattern of parameter vs compute axis mappings):
when the partitioner chooses the FSDP all-gather itself, the XLA CPU backend can get the
*gradients* wrong (relative error ~1) while the forward pass is right: a weight whose contracting
dim is stored over `fsdp` (`w2[F_fsdp, D_tensor]`), consuming an activation whose same dim is
sharded over `tensor`, with the batch split over `fsdp` too. Pinning each weight to its compute
sharding at the point of use (`with_sharding_constraint(w, P(None, "tensor"))`) makes the gradients
match a single-device run; constraining the activations alone does not. Elsewhere it costs
nothing: FSDP gathers each weight before use anyway. Symptom, reproducer, affected versions and the
tests that guard it: `docs/xla_cpu_fsdp_tp_miscompile.md`.

Divisibility. A dimension that a rule shards must divide evenly over its mesh axes; otherwise
`param_shardings` raises one line naming the parameter, dim, size and mesh axes. The one exception
is `replicate_indivisible` (default: `kv_heads` and `experts`): GQA models often have fewer KV heads than
tensor-parallel devices (Qwen2.5-0.5B has 2), and the standard answer (vLLM, MaxText) is to
replicate K/V over the excess. The layout then drops mesh axes for that dim, last first, until the
size divides (2 KV heads on fsdp=2 x tensor=4 -> sharded over fsdp only, which keeps each KV head
on the devices of its query heads), for that array only, and reports it (`placements`, a warning
from `param_shardings`, the `tpurl layouts` table). A small mixture of experts on a large mesh
(fewer experts than devices) falls back the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpurl.config_types import check_types
from tpurl.sharding.axes import LOGICAL_AXES, MESH_AXES, logical_axes
from tpurl.sharding.mesh import MeshConfig, make_mesh  # noqa: F401  (re-exported: importable with the layouts)

Rules = tuple[tuple[str, tuple[str, ...]], ...]
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter lives under a layout on a mesh: spec, per-device shard, any fallback."""

    path: str
    shape: tuple[int, ...]
    dtype: object
    logical: tuple[str | None, ...]
    spec: P
    shard_shape: tuple[int, ...]
    fallbacks: tuple[str, ...] = ()

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * jnp.dtype(self.dtype).itemsize


def _axis_sizes(mesh) -> dict[str, int]:
    """`{axis: size}` of a `Mesh` or `AbstractMesh` (both expose `.shape` as that mapping)."""
    return dict(mesh.shape)


def path_keys(path) -> tuple[str, ...]:
    """`("layers", "q_proj")` from a jax key path (dict keys, attribute names, sequence indices).

    A trailing `value` (the payload of an `nnx.Variable` flattened as a pytree) is dropped, so
    the keys of a parameter are the same whether its state was flattened to Variables or to arrays.
    """
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return tuple(parts[:-1]) if parts and parts[-1] == "value" else tuple(parts)


def path_str(path) -> str:
    """`layers.q_proj` from a jax key path (see `path_keys`)."""
    return ".".join(path_keys(path))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """A named mapping from logical axes to mesh axes.

    `rules`: logical name -> tuple of mesh axes (empty or absent: replicated). A dim named by
    several mesh axes is split over their product, the first axis major.
    `gathered_at_use`: mesh axes that shard parameters for storage only and are all-gathered
    where the weight is used (FSDP). Activations keep them on `batch`.
    `replicate_indivisible`: logical axes that fall back to (partial) replication, per array and
    reported, when their size does not divide; every other indivisible dim is an error.
    """

    name: str
    rules: Rules = ()
    gathered_at_use: tuple[str, ...] = ("fsdp",)
    replicate_indivisible: tuple[str, ...] = ("kv_heads", "experts")

    def __post_init__(self):
        check_types(self, skip=("rules",))  # rules: checked below, rule by rule
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("Layout.name must be a non-empty string")
        # Normalize lists (gin, JSON) to tuples so that layouts compare equal and hash.
        try:
            rules = tuple((logical, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                          for logical, axes in self.rules)
        except (TypeError, ValueError):
            raise ValueError(f"Layout {self.name!r}: rules must be (logical_axis, (mesh_axes...)) pairs, "
                             f"got {self.rules!r}") from None
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "gathered_at_use", tuple(self.gathered_at_use))
        object.__setattr__(self, "replicate_indivisible", tuple(self.replicate_indivisible))
        seen = set()
        for logical, mesh_axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"Layout {self.name!r}: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            if logical in seen:
                raise ValueError(f"Layout {self.name!r}: logical axis {logical!r} has two rules; keep one")
            seen.add(logical)
            if not isinstance(mesh_axes, tuple):
                raise ValueError(f"Layout {self.name!r}: rule for {logical!r} must be a tuple of mesh axes, "
                                 f"e.g. ({logical!r}, ('tensor',))")
            for axis in mesh_axes:
                if axis not in MESH_AXES:
                    raise ValueError(f"Layout {self.name!r}: rule for {logical!r} names unknown mesh axis "
                                     f"{axis!r}; use names from {MESH_AXES}")
            if len(set(mesh_axes)) != len(mesh_axes):
                raise ValueError(f"Layout {self.name!r}: rule for {logical!r} repeats a mesh axis: {mesh_axes}")
        for axis in self.gathered_at_use:
            if axis not in MESH_AXES:
                raise ValueError(f"Layout {self.name!r}: gathered_at_use names unknown mesh axis {axis!r}; "
                                 f"use names from {MESH_AXES}")
        for logical in self.replicate_indivisible:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"Layout {self.name!r}: replicate_indivisible names unknown logical axis "
                                 f"{logical!r}; known: {LOGICAL_AXES}")

    @property
    def rule_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    def spec(self, names: Sequence[str | None], mesh, *, compute: bool = False,
             shape: Sequence[int] | None = None, what: str = "array") -> P:
        """PartitionSpec for an array whose dims carry these logical names.

        Mesh axes of size 1 or absent from the mesh are dropped (so a 3-axis layout works on a 1- or
        2-axis mesh); a mesh axis is used at most once (first dim wins), so e.g. `heads` and
        `kv_heads` can both name `tensor`. With `shape`, divisibility is checked (see the module
        docstring); `what` names the array in the error.
        """
        return self._spec_and_notes(names, mesh, compute=compute, shape=shape, what=what)[0]

    def _spec_and_notes(self, names, mesh, *, compute=False, shape=None, what="array", strict=True):
        sizes = _axis_sizes(mesh)
        rules, used, out, notes = self.rule_map, set(), [], []
        if shape is not None and len(shape) != len(names):
            raise ValueError(f"Layout {self.name!r}: {what} has shape {tuple(shape)} but {len(names)} logical "
                             f"axes {tuple(names)}; give one logical name (or None) per dim")
        for i, name in enumerate(names):
            axes = rules.get(name, ()) if name is not None else ()
            if compute and name != "batch":
                axes = tuple(a for a in axes if a not in self.gathered_at_use)
            axes = tuple(a for a in axes if sizes.get(a, 1) > 1 and a not in used)
            if shape is not None and axes and shape[i] % math.prod(sizes[a] for a in axes):
                want = math.prod(sizes[a] for a in axes)
                if strict and name not in self.replicate_indivisible:
                    raise ValueError(
                        f"Layout {self.name!r}: {what} dim {i} ({name}) of size {shape[i]} does not divide over "
                        f"mesh axes {axes} (size {want}); use a mesh whose {'*'.join(axes)} divides {shape[i]} "
                        f"or a layout that does not shard {name!r}")
                kept = axes
                while kept and shape[i] % math.prod(sizes[a] for a in kept):
                    kept = kept[:-1]
                dropped = axes[len(kept):]
                notes.append(f"{name} (size {shape[i]}) replicated over {'*'.join(dropped)} "
                             f"(size {math.prod(sizes[a] for a in dropped)}): does not divide")
                axes = kept
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out), tuple(notes)

    def placements(self, state, mesh) -> list[ParamPlacement]:
        """Every parameter's placement (path, spec, per-device shard shape, fallbacks) in tree order.

        `state`: an `nnx.State` or module, concrete or abstract (`nnx.eval_shape`); `mesh`: a `Mesh`
        or an `AbstractMesh` (so that pods can be planned on a laptop).
        """
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        axes_tree = logical_axes(state)
        sizes = _axis_sizes(mesh)
        leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        axes_leaves = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
        out = []
        for (path, var), names in zip(leaves, axes_leaves, strict=True):
            value = var.get_value() if isinstance(var, nnx.Variable) else var
            name = path_str(path)
            spec, notes = self._spec_and_notes(names, mesh, shape=value.shape, what=f"parameter {name}")
            shard = tuple(n // math.prod(sizes[a] for a in entry_axes(e)) for n, e in
                          zip(value.shape, tuple(spec) + (None,) * (len(value.shape) - len(spec))))
            out.append(ParamPlacement(path=name, shape=tuple(value.shape), dtype=value.dtype, logical=names,
                                      spec=spec, shard_shape=shard, fallbacks=notes))
        return out

    def param_shardings(self, state, mesh: Mesh):
        """NamedShardings for every parameter of an (abstract) `nnx.State` or module.

        Checks divisibility (one-line error naming parameter, dim, size and mesh axes) and logs a
        warning for each `replicate_indivisible` fallback.
        """
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        placements = iter(self.placements(state, mesh))

        def one(_):
            p = next(placements)
            for note in p.fallbacks:
                log.warning("layout %r: parameter %s: %s", self.name, p.path, note)
            return NamedSharding(mesh, p.spec)

        return jax.tree.map(one, logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))

    def compute_constrain(self, mesh: Mesh) -> Callable[[jax.Array, tuple], jax.Array]:
        """`constrain(x, logical_names)` pinning weights/activations to their compute sharding.

        Weights lose the `gathered_at_use` axes (the FSDP all-gather, made explicit), activations
        keep theirs. Pass it as the model's `constrain=` inside `jax.jit` for every layout that
        has `gathered_at_use` axes: without it the XLA CPU backend miscompiles FSDP x TP gradients
        (`docs/xla_cpu_fsdp_tp_miscompile.md`).
        """

        def constrain(x, names):
            # Not strict: weights were checked by `param_shardings` (their compute spec only drops
            # axes, so it divides too), and an activation whose batch does not divide (a last
            # micro-batch, a few decode slots) is legal, just less parallel: drop the axes that
            # do not divide, as XLA would, instead of failing inside a trace.
            spec, _ = self._spec_and_notes(names, mesh, compute=True, shape=x.shape, strict=False)
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        return constrain

    def batch_sharding(self, mesh: Mesh, ndim: int, *, batch_size: int | None = None) -> NamedSharding:
        """Sharding for a `[B, ...]` batch array: batch over this layout's batch axes.

        With `batch_size`, a batch that does not divide over those axes is a one-line error.
        """
        shape = None if batch_size is None else (batch_size,) + (1,) * (ndim - 1)
        names = ("batch",) + (None,) * (ndim - 1)
        return NamedSharding(mesh, self.spec(names, mesh, shape=shape, what="batch"))

    def constrain_batch(self, mesh: Mesh, batch) -> dict:
        """`batch` (a dict of `[B, ...]` arrays, inside a jitted function) constrained to
        `batch_sharding`: each device keeps its own rows."""
        return {k: jax.lax.with_sharding_constraint(v, self.batch_sharding(mesh, v.ndim)) for k, v in batch.items()}


def entry_axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
