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

`RLConfig.compile_ahead` (off by default) turns it on. On a CPU-only host the compile takes the
cores the step runs on, and a 2-core machine's run was slower with it (docs/performance.md); on
GPUs and TPUs, whose hosts have cores to spare while the device works, it is unmeasured (its
tracing holds Python's lock beside the step's host work, and XLA:GPU's compiles autotune on the
device). The thread is its owner's to close: `close()` drops what is queued and waits for the
compile in progress (one program's); a program that fails to compile ahead stops the thread and
is said once (`warn`), and the steps compile what it did not.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from tpurl.rl.timeline import COMPILE_CLOCK
from tpurl.train.packed_shapes import PackedShapes

CLOSE_TIMEOUT_S = 600.0  # the most `close` waits for the compile in progress


class CompileAhead:
    """A background thread compiling `programs` for the packed row counts they have not met."""

    def __init__(self, programs: list[PackedShapes], warn: Callable[[str], None]):
        self._programs, self._warn = programs, warn
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = self._done = 0  # jobs queued or running; jobs run since the last `settled`
        self.programs, self.seconds = 0, 0.0  # compiled so far by the thread, and its seconds on them
        self._error: str | None = None
        self._said = False
        for p in programs:
            p.watch()

    def settled(self) -> int | None:
        """None while the thread has jobs (queued or running: a program may be half made), else how
        many jobs it ran since the last call: the caller may then freeze what they made out of the
        garbage collector's way (`tpurl.memory.freeze_heap`)."""
        with self._lock:
            if self._pending:
                return None
            done, self._done = self._done, 0
        return done

    def schedule(self) -> None:
        """After a step: queue every count its programs have not met, nearest the step's first."""
        if self._failed():
            return
        jobs = sorted((j for p in self._programs for j in p.take()), key=lambda j: j[:2])
        with self._lock:  # a job failing now drops these with the rest (its error is set under the lock)
            if self._error is not None:
                return
            self._pending += len(jobs)
            for _, _, job in jobs:
                self._queue.put(job)
        if self._thread is None and jobs:
            self._thread = threading.Thread(target=self._work, name="tpurl-compile-ahead", daemon=True)
            self._thread.start()

    def _failed(self) -> bool:
        """Whether a job failed (said once: the steps compile the rest as they meet them)."""
        with self._lock:
            error = self._error
            say = error is not None and not self._said
            self._said = self._said or say
        if say:
            self._warn(f"compiling ahead stopped: {error}; later steps compile their new packed shapes when they "
                       "meet them (RLConfig.compile_ahead=False turns it off)")
        return error is not None

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            start, compiled = time.perf_counter(), COMPILE_CLOCK.compiled()
            error = None
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - the steps compile what this could not
                error = f"{type(e).__name__}: {e}".splitlines()[0]
            with self._lock:
                self.programs += COMPILE_CLOCK.compiled() - compiled
                self.seconds += time.perf_counter() - start
                self._pending, self._done = self._pending - 1, self._done + 1
                self._error = self._error or error
            if error is not None:
                self._drop_queued()
                return

    def _drop_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:  # (`close`'s end mark is not a job)
                with self._lock:
                    self._pending -= 1

    def close(self) -> None:
        """Drop what is queued, wait for the compile in progress (at most `CLOSE_TIMEOUT_S`) and say
        a failure not said yet."""
        if self._thread is not None:
            self._drop_queued()
            self._queue.put(None)
            self._thread.join(CLOSE_TIMEOUT_S)
            self._thread = None
        self._failed()

    def summary(self) -> dict[str, float]:
        """`ahead_programs` the thread compiled (not loaded from the persistent cache, nor found
        compiled already) and its `ahead_seconds` on its jobs."""
        with self._lock:
            return {"ahead_programs": self.programs, "ahead_seconds": self.seconds}
