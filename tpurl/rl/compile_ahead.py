"""The learn phase's programs compiled for packed shapes before a step meets them.

The update and the scoring passes run on the step's rows packed into R rows, and R takes one of
`PackingConfig.row_buckets` counts, depending on how long the step's completions are
(`tpurl.train.packing`). JAX compiles a program for a new count on the thread that first calls
it, so the step that first packs into it waits for the update's and the scoring passes' compiles
(docs/performance.md, "Compile time"). `CompileAhead` hands every count the run has not met to a
thread of its own, after each step, nearest the last step's count first: it lowers and compiles
the programs there from their last call's abstract arguments (`tpurl.train.packed_shapes`), and a
later step finds them compiled. Its seconds count in the run's compile seconds
(`RunResult.compile["run_seconds"]`), not in a step's (`compile/seconds`: its own thread's), and
in `ahead_seconds`, with `ahead_programs`.

`RLConfig.compile_ahead`: None (the default) compiles ahead where the train devices are TPUs: the
host's cores are free while the device works, and the compile uses no device memory. Not on a
CPU-only host, where the compile takes the cores the step runs on (a 2-core machine's run is
slower with it: docs/performance.md), nor yet on GPUs, where XLA's compiles autotune on the
device (scratch memory beside the running step) and it has not been measured; True or False say
so. The thread is its owner's to close: `close()`
drops what is queued and waits for the compile in progress (one program's); a program that fails
to compile ahead stops the thread and is said once (`warn`), and the step compiles it as before.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from tpurl.train.packed_shapes import PackedShapes

CLOSE_TIMEOUT_S = 600.0  # the most `close` waits for the compile in progress


class CompileAhead:
    """A background thread compiling `programs` for the packed row counts they have not met."""

    def __init__(self, programs: list[PackedShapes], warn: Callable[[str], None]):
        self._programs, self._warn = programs, warn
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.programs, self.seconds = 0, 0.0  # compiled so far, and the thread's seconds on them
        self._reported, self._error, self._said = 0, None, False
        for p in programs:
            p.watch()

    def schedule(self) -> int:
        """After a step: queue every count its programs have not met, nearest the step's first;
        returns how many programs the thread compiled since the last call (the caller may freeze
        them out of the garbage collector's way, `tpurl.memory.freeze_heap`)."""
        if self._error is not None:
            if not self._said:
                self._said = True
                self._warn(f"compiling ahead stopped: {self._error}; later steps compile their new packed shapes "
                           "when they meet them (RLConfig.compile_ahead=False turns it off)")
        else:
            for _, job in sorted((j for p in self._programs for j in p.take()), key=lambda j: j[0]):
                self._queue.put(job)
            if self._thread is None and not self._queue.empty():
                self._thread = threading.Thread(target=self._work, name="tpurl-compile-ahead", daemon=True)
                self._thread.start()
        with self._lock:
            done, self._reported = self.programs - self._reported, self.programs
        return done

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                compiled = job()
            except Exception as e:  # noqa: BLE001 - the step compiles what this could not
                self._error = f"{type(e).__name__}: {e}".splitlines()[0]
                return
            with self._lock:
                self.programs += compiled
                self.seconds += time.perf_counter() - start

    def close(self) -> None:
        """Drop what is queued and wait for the compile in progress (at most `CLOSE_TIMEOUT_S`)."""
        if self._thread is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        self._thread = None

    def summary(self) -> dict[str, float]:
        """`ahead_programs` compiled and the thread's `ahead_seconds` on them."""
        with self._lock:
            return {"ahead_programs": self.programs, "ahead_seconds": self.seconds}
