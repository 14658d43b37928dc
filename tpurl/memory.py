"""Memory accounting in one place: live arrays per memory kind, compiled programs' footprints and
backend peaks.

`live_bytes_by_memory_kind` sums the buffers of `jax.live_arrays()` per memory kind (device,
pinned_host), optionally for one pool's devices; `memory_account` adds named groups (params,
optimizer state, KV pool), which is how a colocated step shows that one phase's tensors are really
gone from device memory while the other phase runs. Bytes are *resident* bytes: a shard replicated
on n devices counts n times. The CPU backend has no `device.memory_stats()`; the live-array sum is
the account there, and where the backend has stats they are recorded alongside.

The live-array account counts the arrays alive *between* programs. While a program runs it also
holds its temporaries (activations kept for the backward pass, attention scores, collective
buffers), which only XLA knows: `program_memory` reads XLA's memory analysis of a compiled program
(per device). For a program that already ran with the same arguments, lowering and compiling again
hit JAX's caches, so asking costs microseconds, not a compile. Where the backend reports it (GPU,
TPU; not CPU), `device.memory_stats()["peak_bytes_in_use"]` is the allocator's high-water mark
since the process started: `device_peak_metrics` logs it.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any, Collection, Mapping

import jax
import numpy as np


DEVICE = "device"
PINNED_HOST = "pinned_host"


def _kind(x: jax.Array) -> str:
    return x.sharding.memory_kind or DEVICE


def resident_bytes(x: jax.Array) -> int:
    """Bytes `x` occupies over its addressable devices (0 once deleted)."""
    if x.is_deleted():
        return 0
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize * len(x.sharding.addressable_devices)


def tree_bytes_by_memory_kind(tree) -> dict[str, int]:
    """`{memory_kind: resident bytes}` of the jax.Arrays in `tree` (deleted arrays count 0; an
    array that appears twice in the tree counts once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted() and id(x) not in seen:
            seen.add(id(x))
            out[_kind(x)] = out.get(_kind(x), 0) + resident_bytes(x)
    return out


def live_bytes_by_memory_kind(device_ids: Collection[int] | None = None) -> dict[str, int]:
    """`{memory_kind: resident bytes}` of every live jax.Array in this process (with `device_ids`:
    of their buffers on those devices alone, e.g. one pool's).

    Each device buffer counts once: `np.asarray(x)` (and `x.addressable_shards`) leave per-shard
    views of x among the live arrays, which share x's buffers, so buffers are deduplicated by
    (device, address). Collects garbage first: arrays caught in unreachable reference cycles still
    hold their buffers until the collector runs, and would otherwise come and go at random points.
    An array's buffers never change while it lives, so they are read once per array
    (`_BUFFERS`): a step accounts its memory at every phase end, and most arrays (weights,
    optimizer state, the KV pool and their per-shard views) outlive many phases.
    """
    gc.collect()
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for x in jax.live_arrays():
        known = _buffers(x)
        if known is None:  # deleted or donated since it was listed (by another thread): not live
            continue
        kind, buffers = known
        for key, nbytes in buffers:
            if key not in seen and (device_ids is None or key[0] in device_ids):
                seen.add(key)
                out[kind] = out.get(kind, 0) + nbytes
    return out


Buffers = tuple[tuple[tuple[int, int], int], ...]  # ((device id, address), bytes) per addressable shard
# id(array) -> (a weak reference to it, its memory kind, its buffers); an entry leaves when its
# array dies (the weak reference's callback), before the id can be reused.
_BUFFERS: dict[int, tuple[weakref.ref, str, Buffers]] = {}


def _buffers(x: jax.Array) -> tuple[str, Buffers] | None:
    """`x`'s memory kind and addressable buffers; None once it is deleted."""
    if x.is_deleted():
        return None
    known = _BUFFERS.get(id(x))
    if known is not None and known[0]() is x:
        return known[1], known[2]
    try:
        shards = [(shard.device.id, shard.data) for shard in x.addressable_shards]
        buffers = tuple(((device, data.unsafe_buffer_pointer()), data.nbytes) for device, data in shards)
    except (RuntimeError, TypeError):  # deleted midway (by another thread) surfaces as a TypeError
        return None
    key, kind = id(x), _kind(x)
    _BUFFERS[key] = (weakref.ref(x, lambda _, key=key: _BUFFERS.pop(key, None)), kind, buffers)
    return kind, buffers


def freeze_heap() -> None:
    """Collect garbage, then exempt every surviving object from future collections.

    The per-phase memory account collects garbage at each phase boundary (arrays caught in cycles
    would otherwise blur it); with the long-lived heap of compiled programs and modules frozen,
    that collection scans only the step's own young objects (docs/performance.md)."""
    gc.collect()
    gc.freeze()


def buffer_keys(x: jax.Array) -> set[tuple[int, int]]:
    """`x`'s (device id, address) buffer keys (none once it is deleted), read through `_buffers`."""
    known = _buffers(x)
    return set() if known is None else {key for key, _ in known[1]}


def device_memory_stats() -> dict[str, dict[str, int]] | None:
    """`device.memory_stats()` per local device, or None where the backend has none (CPU)."""
    stats = {str(d): d.memory_stats() for d in jax.local_devices()}
    return None if all(s is None for s in stats.values()) else stats


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryAccount:
    """Live memory at one point of a step. `live`: all live arrays per memory kind; `groups`:
    named pytrees' bytes per memory kind; `device_stats`: `memory_stats()` where available."""

    phase: str
    live: dict[str, int]
    groups: dict[str, dict[str, int]]
    device_stats: dict[str, dict[str, int]] | None = None

    def device_bytes(self, group: str | None = None) -> int:
        """Device-memory bytes of `group` (or of all live arrays)."""
        return (self.live if group is None else self.groups.get(group, {})).get(DEVICE, 0)


def memory_account(phase: str, groups: Mapping[str, Any] | None = None) -> MemoryAccount:
    """Account live memory now: all live arrays per kind, plus each named group's pytree."""
    return MemoryAccount(phase=phase, live=live_bytes_by_memory_kind(),
                         groups={name: tree_bytes_by_memory_kind(t) for name, t in (groups or {}).items()},
                         device_stats=device_memory_stats())


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA's `memory_analysis()`).

    `argument_bytes` / `output_bytes`: its inputs and outputs; `alias_bytes`: outputs written into
    donated inputs (counted in both); `temp_bytes`: everything else it allocates while it runs."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """What the program holds at once on a device while it runs: inputs, outputs (donated
        ones once) and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def abstract(tree):
    """`ShapeDtypeStruct`s (with shardings) of a pytree of arrays: what lowering needs, without
    keeping the arrays (or their buffers) alive. Works on donated, deleted arrays too."""
    def spec(x):
        if not isinstance(x, jax.Array):
            return x
        # An uncommitted array (no explicit placement) lowers without a sharding annotation; giving
        # it one would make a different program (a compile, not a cache hit).
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None,
                                    weak_type=x.weak_type)
    return jax.tree.map(spec, tree)


def program_memory(jitted, *args, **kwargs) -> ProgramMemory | None:
    """XLA's memory analysis of `jitted(*args, **kwargs)`'s compiled program (a `jax.jit` function
    or anything with its `lower`; None for a plain callable); arguments may be arrays or
    `abstract` specs."""
    if not hasattr(jitted, "lower"):
        return None
    stats = jitted.lower(*args, **kwargs).compile().memory_analysis()
    return ProgramMemory(argument_bytes=int(stats.argument_size_in_bytes), output_bytes=int(stats.output_size_in_bytes),
                         alias_bytes=int(stats.alias_size_in_bytes), temp_bytes=int(stats.temp_size_in_bytes))


def program_metrics(phase: str, mem: ProgramMemory | None) -> dict[str, float]:
    """`memory/<phase>/program_temp_bytes` and `.../program_peak_bytes` of one of the phase's programs."""
    if mem is None:
        return {}
    return {f"memory/{phase}/program_temp_bytes": float(mem.temp_bytes),
            f"memory/{phase}/program_peak_bytes": float(mem.peak_bytes)}


def device_peak_metrics(phase: str, stats: dict[str, dict[str, int]] | None) -> dict[str, float]:
    """`memory/<phase>/device_peak_bytes`: the largest allocator high-water mark over the local
    devices (`device_memory_stats()`), and `device_in_use_bytes` now; {} where
    the backend reports no stats."""
    if not stats:
        return {}
    present = [s for s in stats.values() if s]
    out = {}
    for key, name in (("peak_bytes_in_use", "device_peak_bytes"), ("bytes_in_use", "device_in_use_bytes")):
        values = [s[key] for s in present if key in s]
        if values:
            out[f"memory/{phase}/{name}"] = float(max(values))
    return out
