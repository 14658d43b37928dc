"""The packed shapes a program on packed batches has not met yet, and its lowering for them.

A program whose batch is packed (the update, the logprobs and value passes: `tpurl.train.packing`)
is compiled once per packed row count R, and a batch format (B rows padded to T, rows of L tokens,
its blocks) can take up to `PackingConfig.row_buckets` counts (`packing.row_ladder`). Which one a
step's batch takes depends on its completions' lengths, so a run meets them one by one, and the
step that meets one waits for its compiles. `PackedShapes`, once watched, keeps a program's last
call as abstract arguments (shapes, dtypes and shardings; no buffers) and the counts it has met,
so that the other counts of the same format can be lowered and compiled before a step needs them
(`tpurl.rl.compile_ahead`, on a background thread): a program compiled from
`jitted.lower(...).compile()` lands in the cache the jitted function's later calls look in.
"""

from __future__ import annotations

import threading
from typing import Callable

import jax
import numpy as np

from tpurl.train.packing import COUNTS_KEY, INDEX_KEY, PACKED_KEYS, row_ladder

# A packed batch's arrays whose first axis is its packed rows (the others are its padded `[B, ...]`).
ROW_KEYS = (*PACKED_KEYS, COUNTS_KEY, "packed_routes")


def abstract(tree):
    """`tree` with every array as its shape, dtype and sharding (`jax.ShapeDtypeStruct`), holding no
    buffer (so it outlives a donated argument); other leaves unchanged."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(one, tree)


def with_rows(batch: dict, rows: int) -> dict:
    """An abstract packed batch with `rows` packed rows instead of its own (its padded arrays as
    they are)."""
    return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype, sharding=v.sharding) if k in ROW_KEYS else v
            for k, v in batch.items()}


class PackedShapes:
    """The packed row counts one program has met, per batch format, and its last call.

    `blocks`: the (batch shard, micro-batch) blocks its batches are packed in; `buckets`:
    `PackingConfig.row_buckets`. Until `watch()` is called, `record` keeps nothing (no cost on
    the step). `take()` hands out each count of the last format's ladder not met yet, once."""

    def __init__(self, blocks: int, buckets: int):
        self._blocks, self._buckets = blocks, buckets
        self._lock = threading.Lock()
        self._watched = False
        self._last: tuple | None = None  # (format, rows, jitted.lower, abstract arguments)
        self._called: dict[tuple[int, int, int], set[int]] = {}  # per format, the counts calls met
        self._handed: dict[tuple[int, int, int], set[int]] = {}  # and those `take` handed out

    def watch(self) -> None:
        self._watched = True

    def record(self, lower: Callable, *args) -> None:
        """A call of the program: its jitted function's `lower` and its arguments, the batch last
        (called before the program runs: a donated argument is still readable). An unpacked batch
        is not kept: it has one shape."""
        batch = args[-1]
        if not self._watched or INDEX_KEY not in batch:
            return
        rows, length = batch["packed_tokens"].shape
        fmt = (*batch["valid"].shape, length)
        last = (fmt, rows, lower, abstract(args))
        with self._lock:
            self._called.setdefault(fmt, set()).add(rows)
            self._last = last

    def take(self) -> list[tuple[int, Callable[[], bool]]]:
        """`(distance, compile)` for every packed row count of the last call's format that no call
        has met and no earlier `take` handed out, `distance` from the last call's count.
        `compile()` lowers and compiles the program for that count, unless a call has met it
        since (then JAX compiled it there); returns whether it compiled."""
        with self._lock:
            if self._last is None:
                return []
            fmt, last_rows, lower, args = self._last
            called, handed = self._called[fmt], self._handed.setdefault(fmt, set())
            todo = [r for r in row_ladder(*fmt, self._blocks, self._buckets) if r not in called | handed]
            handed.update(todo)

        def compiler(rows: int) -> Callable[[], bool]:
            def compile_() -> bool:
                with self._lock:
                    if rows in called:
                        return False
                lower(*args[:-1], with_rows(args[-1], rows)).compile()
                return True
            return compile_

        return [(abs(r - last_rows), compiler(r)) for r in todo]
