"""Device memory that the live-array account cannot see: compiled programs' footprints and backend peaks.

`tpurl.sync.offload.live_bytes_by_memory_kind` counts the arrays alive *between* programs. While a
program runs it also holds its temporaries (activations kept for the backward pass, attention
scores, collective buffers), which only XLA knows: `program_memory` reads XLA's memory analysis
of a compiled program (per device). For a program that already ran with the same arguments,
lowering and compiling again hit JAX's caches, so asking costs microseconds, not a compile.

Where the backend reports it (GPU, TPU; not CPU), `device.memory_stats()["peak_bytes_in_use"]` is
the allocator's high-water mark since the process started: `device_peak_metrics` logs it.
"""

from __future__ import annotations

import dataclasses

import jax


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
    devices (`tpurl.sync.offload.device_memory_stats()`), and `device_in_use_bytes` now; {} where
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
