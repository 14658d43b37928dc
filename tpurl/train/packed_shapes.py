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
import time
from typing import Callable

import jax
import numpy as np

from tpurl.train.packing import COUNTS_KEY, INDEX_KEY, PACKED_KEYS, row_ladder

# A packed batch's arrays whose first axis is its packed rows (the others are its padded `[B, ...]`).
ROW_KEYS = (*PACKED_KEYS, COUNTS_KEY, "packed_routes")


def abstract(tree):
    """`tree` with every array as its shape, dtype and sharding (`jax.ShapeDtypeStruct.like`, which
    keeps whether it is committed to its devices), holding no buffer (so it outlives a donated
    argument); other leaves unchanged."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct.like(x) if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


def with_rows(batch: dict, rows: int) -> dict:
    """An abstract packed batch with `rows` packed rows instead of its own (its padded arrays as
    they are)."""
    return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype, sharding=v.sharding) if k in ROW_KEYS else v
            for k, v in batch.items()}


Format = tuple[int, int, int]  # a packed batch's padded rows B, padded length T and row length L


class PackedShapes:
    """The packed row counts one program's calls have met, per batch format, and its last call.

    `blocks`: the (batch shard, micro-batch) blocks its batches are packed in; `buckets`:
    `PackingConfig.row_buckets`. Until `watch()` is called, `record` keeps only the counts met
    (the step pays for nothing else). `take()` hands out each count of the last format's ladder
    that no call has met, once; a call that meets a count being compiled from `take` waits for
    that compile instead of compiling the program again (`take_waited`: the seconds calls waited)."""

    def __init__(self, blocks: int, buckets: int):
        self._blocks, self._buckets = blocks, buckets
        self._lock = threading.Lock()
        self._watched = False
        self._met_new, self._waited = False, 0.0  # since the last `take_met_new` / `take_waited`
        self._last: tuple | None = None  # (format, rows, jitted.lower, abstract arguments)
        self._called: dict[Format, set[int]] = {}  # per format, the counts calls met
        self._handed: dict[Format, set[int]] = {}  # and those `take` handed out
        self._compiling: dict[tuple[Format, int], threading.Event] = {}  # set when that compile ends

    def watch(self) -> None:
        self._watched = True

    def record(self, lower: Callable, *args) -> None:
        """A call of the program: its jitted function's `lower` and its arguments, the batch last
        (called before the program runs: a donated argument is still readable). An unpacked batch
        has one shape: nothing to keep."""
        batch = args[-1]
        if INDEX_KEY not in batch:
            return
        rows, length = batch["packed_tokens"].shape
        fmt = (*batch["valid"].shape, length)
        with self._lock:
            called = self._called.setdefault(fmt, set())
            self._met_new |= rows not in called
            called.add(rows)
            compiling = self._compiling.get((fmt, rows))
            ladder_left = self._watched and not set(self._ladder(fmt)) <= called | self._handed.get(fmt, set())
        if ladder_left:  # the arguments of a call are kept while some count may still be handed out
            last = (fmt, rows, lower, abstract(args))
            with self._lock:
                self._last = last
        if compiling is not None:
            start = time.perf_counter()
            compiling.wait()
            with self._lock:
                self._waited += time.perf_counter() - start

    def take_met_new(self) -> bool:
        """Whether a call since the last `take_met_new` met a count no earlier call had met."""
        with self._lock:
            met, self._met_new = self._met_new, False
        return met

    def take_waited(self) -> float:
        """The seconds calls since the last `take_waited` waited for a compile from `take`."""
        with self._lock:
            waited, self._waited = self._waited, 0.0
        return waited

    def _ladder(self, fmt: Format) -> tuple[int, ...]:
        return row_ladder(*fmt, self._blocks, self._buckets)

    def take(self) -> list[tuple[int, int, Callable[[], None]]]:
        """`(distance, rows, compile)` for every packed row count of the last kept call's format
        that no call has met and no earlier `take` handed out, `distance` from that call's count.
        `compile()` lowers and compiles the program for `rows`, unless a call has met it since
        (then the call compiled it)."""
        with self._lock:
            if self._last is None:
                return []
            fmt, last_rows, lower, args = self._last
            handed = self._handed.setdefault(fmt, set())
            todo = [r for r in self._ladder(fmt) if r not in self._called[fmt] | handed]
            handed.update(todo)
        return [(abs(r - last_rows), r, self._compiler(fmt, r, lower, args)) for r in todo]

    def _compiler(self, fmt: Format, rows: int, lower: Callable, args: tuple) -> Callable[[], None]:
        def compile_() -> None:
            done = threading.Event()
            with self._lock:
                if rows in self._called[fmt]:
                    return
                self._compiling[(fmt, rows)] = done
            try:
                lower(*args[:-1], with_rows(args[-1], rows)).compile()
            finally:
                with self._lock:
                    del self._compiling[(fmt, rows)]
                done.set()

        return compile_
