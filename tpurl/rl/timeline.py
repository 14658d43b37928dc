"""Per-phase timing of a step, where each phase's device work is finished inside the phase.

JAX dispatches asynchronously: without a barrier, the time of a jitted call lands in whichever later
phase first touches its result. `Timeline.phase` therefore blocks on the values the phase produced
(`jax.block_until_ready`) before stopping its clock, and blocks nowhere else, so the phases of a
step are disjoint intervals that cover it (a phase opened with `wait=False` leaves its programs
running on purpose, e.g. the update that the next batch is sampled beside; a later phase of the
same name waits for them): their seconds add up to the step's wall time up to the
few microseconds of bookkeeping between them. `metrics` reports that remainder as `other`, so the
phases and `other` add up to the step exactly. What the timeline's owner does at each phase's end
(`on_phase_end`: the RL step's live-array memory account) is timed apart, as the phase
`ACCOUNT_PHASE`, so that measuring a phase's memory does not count as the phase's own work.

Compilation hides inside the phases: a phase that meets a new program shape traces, lowers and
compiles it before running it. `compile/seconds` reports how much of the step that was (JAX's own
compile events, `jax.monitoring`, of the thread that made the timeline: JAX compiles on the
calling thread, so a rollout thread's compiles are its own timeline's), and `steady_steps` leaves
such steps out of the averages (`compile/steps` in a summary counts them, so the cost stays
visible).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import jax

# JAX's events for the three stages of making a program (tracing, lowering, the backend compile).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
COMPILE_KEY = "compile/seconds"
ACCOUNT_PHASE = "memory_account"


BACKEND_EVENT = COMPILE_EVENTS[2]  # one per program made: compiled, or loaded from the persistent cache
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # one per program loaded from the persistent cache


class _CompileClock:
    """Seconds each thread has spent making programs, summed from JAX's compile events, which JAX
    records on the compiling thread (two listeners for the process, registered on first use; a
    program found in a jit's in-memory cache records nothing), and the programs made in the
    process: compiled by the backend, or loaded from the persistent cache (`tpurl.compile_cache`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals: dict[int, float] = {}  # thread ident -> seconds
        self._made: dict[int, int] = {}  # thread ident -> programs made (compiled or loaded)
        self._loaded: dict[int, int] = {}  # thread ident -> programs loaded from the persistent cache
        self._registered = False

    def _record(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            me = threading.get_ident()
            with self._lock:
                self._totals[me] = self._totals.get(me, 0.0) + duration
                self._made[me] = self._made.get(me, 0) + (event == BACKEND_EVENT)

    def _count(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            me = threading.get_ident()
            with self._lock:
                self._loaded[me] = self._loaded.get(me, 0) + 1

    def _register(self) -> None:
        if not self._registered:
            jax.monitoring.register_event_duration_secs_listener(self._record)
            jax.monitoring.register_event_listener(self._count)
            self._registered = True

    def read(self, thread: int | None = None) -> float:
        """The compile seconds so far of the thread with ident `thread` (default: the calling one)."""
        with self._lock:
            self._register()
            return self._totals.get(threading.get_ident() if thread is None else thread, 0.0)

    def compiled(self, thread: int | None = None) -> int:
        """The programs the thread with ident `thread` (default: the calling one) has compiled so
        far (made, and not loaded from the persistent cache)."""
        me = threading.get_ident() if thread is None else thread
        with self._lock:
            self._register()
            return self._made.get(me, 0) - self._loaded.get(me, 0)

    def process_totals(self) -> dict[str, float]:
        """So far in this process, on every thread: `seconds` spent making programs, `programs`
        made, and how many of them were `loaded` from the persistent cache instead of compiled."""
        with self._lock:
            self._register()
            return {"seconds": sum(self._totals.values()), "programs": sum(self._made.values()),
                    "loaded": sum(self._loaded.values())}


COMPILE_CLOCK = _CompileClock()


class PhaseResult:
    """Holder a phase body stores its outputs in (`res.value = ...`) so the phase can block on them."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: Any = None


class Timeline:
    """Collects `phase name -> seconds` for one step (phases may repeat; their times add up).

    `clock`: the one clock every reading uses, wall time by default. Set it (e.g. to
    `time.process_time`) to account the process's CPU time instead, which a busy machine's
    scheduler does not stretch.
    """

    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, on_phase_end: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}
        self.order: list[str] = []
        self._on_phase_end = on_phase_end
        self._start = self.clock()
        self._end: float | None = None
        self._thread = threading.get_ident()  # whose compiles the step counts
        self._compile_start, self._compile_s = COMPILE_CLOCK.read(self._thread), 0.0

    @contextlib.contextmanager
    def phase(self, name: str, *, wait: bool = True) -> Iterator[PhaseResult]:
        """Time a phase; everything assigned to the yielded holder's `.value` is blocked on.
        `wait=False`: a phase that leaves work running on the devices (its programs dispatched,
        not finished): nothing is blocked on, and the end-of-phase account, which would wait for
        that work, is skipped."""
        res = PhaseResult()
        t0 = self.clock()
        yield res
        if wait:
            jax.block_until_ready(res.value)
        t1 = self.clock()
        self._add(name, t1 - t0)
        if wait and self._on_phase_end is not None:
            # E.g. the live-bytes account of what this phase left on device: timed as its own phase.
            self._on_phase_end(name)
            self._add(ACCOUNT_PHASE, self.clock() - t1)

    def _add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            self.order.append(name)
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def finish(self) -> float:
        """Stop the step clock; returns the step's wall time."""
        self._end = self.clock()
        self._compile_s = COMPILE_CLOCK.read(self._thread) - self._compile_start
        return self.wall

    @property
    def compile_seconds(self) -> float:
        """Seconds the timeline's thread spent making programs (known once `finish` has run)."""
        return self._compile_s

    @property
    def wall(self) -> float:
        end = self._end if self._end is not None else self.clock()
        return end - self._start

    def metrics(self) -> dict[str, float]:
        """`time/<phase>_s` for each phase, `time/step_s`, the unaccounted remainder, and the
        seconds the step spent making programs (`compile/seconds`, part of the phases' time)."""
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = self.wall
        out["time/other_s"] = self.wall - sum(self.seconds.values())
        out[COMPILE_KEY] = self.compile_seconds
        return out


def compile_seconds(record: dict) -> float:
    """The seconds a step's record says it spent making programs, on any thread (`compile/seconds`
    the main thread's, `compile/rollout_seconds` an asynchronous rollout's, `compile/wait_seconds`
    its wait for the compile-ahead thread's)."""
    return float(sum(v for k, v in record.items() if k.startswith("compile/") and k.endswith("seconds")))


def steady_steps(records: list[dict]) -> list[dict]:
    """The step records a run's timeline averages over: those that compiled no program on any
    thread; if every step compiled, all but the first."""
    later = records[1:] if len(records) > 1 else records
    steady = [r for r in later if compile_seconds(r) == 0.0]
    return steady or later


def summarize(records: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean seconds and share of the step for each phase over `records` (metrics dicts)."""
    if not records:
        return {}
    keys = sorted({k for r in records for k in r if k.startswith("time/") and k.endswith("_s")})
    mean = {k: sum(r.get(k, 0.0) for r in records) / len(records) for k in keys}
    step = mean.get("time/step_s", 0.0) or 1.0
    return {k[len("time/"):-2]: {"mean_s": v, "share": v / step} for k, v in mean.items()}


def compile_summary(records: list[dict]) -> dict[str, float]:
    """How many of a run's steps made programs, and the seconds they spent on it."""
    seconds = [compile_seconds(r) for r in records]
    return {"steps": sum(s > 0 for s in seconds), "seconds": float(sum(seconds))}


def compile_since(start: dict[str, float]) -> dict[str, float]:
    """What the process spent making programs since `start` (a `COMPILE_CLOCK.process_totals()`):
    `run_seconds` on every thread, `programs` made and how many were `programs_loaded` from the
    persistent cache (the rest were compiled)."""
    now = COMPILE_CLOCK.process_totals()
    return {"run_seconds": now["seconds"] - start["seconds"], "programs": int(now["programs"] - start["programs"]),
            "programs_loaded": int(now["loaded"] - start["loaded"])}
