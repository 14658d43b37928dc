"""Derived leaves of a weight sync: objects that stand for a weight and compute it inside the sync's
program (a LoRA weight merged with its adapter, a quantized weight's values or scales).

A derived leaf is a pytree with the `shape` of the array it computes and the `sharding` that array
has in the train layout, a floating `dtype` (which decides whether the sync's `rollout_dtype`
applies), a `materialize()` that computes it (float32, inside a program; the sync casts it to the
rollout dtype, or to the leaf's own `rollout_dtype` where it has one), `slice_layers(start, size)`
for a piece along its first (`layers`) axis, and optionally `source_size`, the elements its
computation reads (bucket sizing). See `tpurl.sync.reshard`.
"""

from __future__ import annotations

import jax


def is_derived(x) -> bool:
    """Whether `x` is a derived leaf (see the module docstring)."""
    return hasattr(x, "materialize") and hasattr(x, "slice_layers")


def leaf_value(x):
    """A leaf's array inside a program: a derived leaf computed, an array itself."""
    return x.materialize() if is_derived(x) else x


def leaf_slice(x, start, size: int, axis: int):
    """Rows `start:start + size` of leaf `x` along `axis` (a derived leaf: along its first axis)."""
    return x.slice_layers(start, size) if is_derived(x) else jax.lax.dynamic_slice_in_dim(x, start, size, axis)
