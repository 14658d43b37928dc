"""The rollout weights of a LoRA run: its frozen base and trained adapters, merged or not.

A LoRA run trains the adapters (`nnx.LoRAParam`s) and keeps the base frozen in the train layout
(`TrainState.frozen`). The rollout engine serves base + adapters in one of two forms
(`SyncConfig.adapters`):

  * `merged`: the engine runs the plain model on `W + scale * A @ B` for every targeted projection.
    Each sync computes the merged weights inside the resharding programs (`MergedWeight`, a derived
    leaf of `tpurl.sync.reshard`: one fused merge + cast + reshard program per bucket), so it moves
    the targeted projections' bytes at the rollout dtype. The base's other weights (embeddings,
    norms) never change: they are synced once, by `set_base`.
  * `unmerged`: the engine runs the model with its adapters (each targeted projection adds the
    low-rank path); the base is synced once, by `set_base`, and each sync moves only the adapters.
  * `auto`: `merged` when train and rollout share their devices (colocated: the merge is a local
    program and decoding runs the plain model), `unmerged` when the weights cross to other devices
    (disaggregated: the adapters are a small fraction of the bytes).

`LoraRollout` holds the base's rollout part that `set_base` made (where a leaf's layout and dtype
already match, the train state's own array, passed through) and builds each sync's rollout params
from the adapters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.models.lora import LoraConfig, adapter_names, merged_weight, targeted_split
from tpurl.models.quant import scale_name
from tpurl.sync.config import SyncConfig, SyncReport
from tpurl.sync.reshard import made_by_sync, sync_weights


def resolve_adapters(form: str, colocated: bool) -> str:
    """`SyncConfig.adapters` resolved for a placement: "merged" or "unmerged" (see the module docstring)."""
    if form == "auto":
        return "merged" if colocated else "unmerged"
    return form


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MergedWeight:
    """A targeted projection's rollout weight `W + scale * A @ B`, computed where it is moved (a
    derived leaf of `tpurl.sync.reshard`); shape, dtype and sharding are W's."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata={"static": True})
    target: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self) -> int:
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def sharding(self):
        return self.w.sharding

    def materialize(self) -> jax.Array:
        """The merged weight in float32 (inside a program; the sync casts it)."""
        return merged_weight(self.w, self.a, self.b, self.scale, self.target, jnp.float32)

    def slice_layers(self, start, size: int) -> MergedWeight:
        """Layers `start:start + size` (W, A and B are all stacked along their first axis)."""
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, 0)  # noqa: E731
        return dataclasses.replace(self, w=cut(self.w), a=cut(self.a), b=cut(self.b))


def merged_state(frozen: nnx.State, adapters: nnx.State, lora: LoraConfig) -> nnx.State:
    """The targeted projections of `frozen` as `MergedWeight`s with their `adapters` (paths as in the
    base state: `layers/<target>`)."""
    layers, ad = frozen["layers"], adapters["layers"]
    out = {}
    for target in lora.targets:
        name_a, name_b = adapter_names(target)
        merged = MergedWeight(layers[target][...], ad[name_a][...], ad[name_b][...], lora.scale, target)
        out[target] = nnx.Param(merged)
    return nnx.State({"layers": out})


class LoraRollout:
    """Rollout weights of a LoRA run (see the module docstring). `form`: "merged" or "unmerged";
    `shardings`: the rollout layout's shardings of the engine's model's parameters (the base model's
    when merged, the adapted model's when unmerged)."""

    def __init__(self, lora: LoraConfig, form: str, shardings, sync_cfg: SyncConfig):
        if form not in ("merged", "unmerged"):
            raise ValueError(f"LoraRollout form={form!r}; resolve SyncConfig.adapters first (resolve_adapters)")
        self.lora, self.form, self.shardings, self.sync_cfg = lora, form, shardings, sync_cfg
        self._static: nnx.State | None = None  # the base's rollout part, synced once
        self._frozen: nnx.State | None = None  # merged: the train layout's base the merges read
        self._source: list | None = None  # the frozen arrays `_static` was synced from

    def set_base(self, frozen: nnx.State) -> SyncReport | None:
        """Sync the part of the frozen base that no update changes into the rollout layout (all of
        it when unmerged; the weights no adapter targets when merged), replacing the previous one;
        None (nothing synced) when `frozen` holds the very arrays synced last time."""
        leaves = jax.tree.leaves(frozen)
        if self._source is not None and len(leaves) == len(self._source) and all(
                a is b for a, b in zip(leaves, self._source)):
            return None
        static = frozen if self.form == "unmerged" else targeted_split(frozen, self.lora)[1]
        self._static = self._source = None  # the previous part goes before the new one is made
        self._static, report = sync_weights(static, _matching(self.shardings, static), self.sync_cfg)
        self._frozen = frozen if self.form == "merged" else None
        self._source = leaves
        return report

    @property
    def ready(self) -> bool:
        return self._static is not None

    def sync(self, adapters: nnx.State) -> tuple[nnx.State, SyncReport, list[jax.Array]]:
        """The rollout params with `adapters` (merged into the base, or beside it), the sync's
        report and the arrays it made (what the next sync may free)."""
        if self._static is None:
            raise RuntimeError("LoraRollout.sync before set_base: the frozen base has not reached the rollout")
        moving = merged_state(self._frozen, adapters, self.lora) if self.form == "merged" else adapters
        moved, report = sync_weights(moving, _matching(self.shardings, moving), self.sync_cfg)
        return nnx.merge_state(self._static, moved), report, made_by_sync(moved, adapters)


def _matching(shardings, state: nnx.State):
    """The part of a shardings tree (of the whole model's params) at `state`'s paths, and at the
    scales of its quantized weights where the rollout model has them (`SyncConfig.quantize`)."""
    flat = dict(nnx.to_flat_state(nnx.State(shardings)))
    paths = [path for path, _ in nnx.to_flat_state(state)]
    scales = [(*path[:-1], scale_name(str(path[-1]))) for path in paths]
    return nnx.from_flat_state([(path, flat[path]) for path in paths + [p for p in scales if p in flat]])
