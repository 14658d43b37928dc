"""Quantized rollout weights made by the sync (`SyncConfig.quantize="fp8"`).

A run with `SyncConfig.quantize="fp8"` trains as before (fp32 masters, bf16 or fp32 compute) and
rolls out with float8 e4m3 projections and experts, one float32 scale per output channel
(`tpurl.models.quant`). The sync makes them: `quantized_state` replaces each quantized weight of
the train state by two derived leaves of `tpurl.sync.reshard`, `QuantizedPart(w, name, "values")`
at the weight's path and `QuantizedPart(w, name, "scales")` at `<name>_scale`, so the resharding
program of each bucket computes the scales, divides, rounds to e4m3 and moves the result in one go:
the weights cross at one byte each, and no bf16 or fp32 copy of the quantized model is ever held.

The weights a quantized model keeps in the rollout dtype (embeddings, output projection, norms,
router, adapters) go through the sync as usual. A LoRA run's merged weights are quantized after the
merge (a `MergedWeight` inside the part).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.models import quant
from tpurl.sync.derived import leaf_slice, leaf_value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPart:
    """The e4m3 values (`part="values"`) or the float32 per-channel scales (`part="scales"`) of the
    stacked layer weight `w` (an array, or a derived leaf such as a merged LoRA weight) named
    `name`: a derived leaf of `tpurl.sync.reshard` whose `rollout_dtype` is the part's own."""

    w: Any
    name: str = dataclasses.field(metadata={"static": True})
    part: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape) if self.part == "values" else quant.drop_inputs(tuple(self.w.shape), self.name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def rollout_dtype(self):
        return jnp.dtype(quant.FP8_DTYPE) if self.part == "values" else jnp.dtype(jnp.float32)

    @property
    def sharding(self):
        """The weight's train sharding; the scales': that sharding without the input axes."""
        s = self.w.sharding
        if self.part == "values" or not isinstance(s, NamedSharding):
            return s
        spec = tuple(s.spec) + (None,) * (self.w.ndim - len(s.spec))
        return NamedSharding(s.mesh, P(*quant.drop_inputs(spec, self.name)), memory_kind=s.memory_kind)

    @property
    def source_size(self) -> int:
        """Elements the part's program reads: the whole weight (its scales reduce over it)."""
        return math.prod(self.w.shape)

    def materialize(self) -> jax.Array:
        """The part in float32 (inside a program; the sync casts it to `rollout_dtype`)."""
        w = leaf_value(self.w)
        scales = quant.channel_scales(w, self.name)
        return quant.quantized_values(w, scales, self.name) if self.part == "values" else scales

    def slice_layers(self, start, size: int) -> QuantizedPart:
        """Layers `start:start + size` (the scales of a channel come from its layer alone)."""
        return dataclasses.replace(self, w=leaf_slice(self.w, start, size, 0))


def is_quantized(keys: tuple[str, ...]) -> bool:
    """Whether the parameter at `keys` (`("layers", "q_proj")`) is one the sync quantizes."""
    return len(keys) == 2 and keys[0] == "layers" and keys[1] in quant.INPUT_AXES


def quantized_state(params) -> nnx.State:
    """`params` (a model's state, or part of it) with each quantized layer weight (`quant.INPUT_AXES`)
    replaced by its values and joined by its scales, as `QuantizedPart`s (module docstring)."""
    flat = []
    for path, var in nnx.to_flat_state(nnx.State(params)):
        name = str(path[-1])
        if is_quantized(tuple(str(k) for k in path)):
            w = var.get_value() if isinstance(var, nnx.Variable) else var
            flat.append((path, nnx.Param(QuantizedPart(w, name, "values"))))
            flat.append(((*path[:-1], quant.scale_name(name)), nnx.Param(QuantizedPart(w, name, "scales"))))
        else:
            flat.append((path, var))
    return nnx.from_flat_state(flat)
