"""The compile-ahead thread (tpurl.rl.compile_ahead) on a small jitted program over packed batches:
each packed row count the program has not met is handed out once and compiled, and a later call of
it compiles nothing; a count a call met first is not compiled again, and a call that meets a count
being compiled waits for it; a program that fails to compile stops the thread and is said once,
and the caller goes on; the run loop freezes the heap only while the thread has no job."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.rl.compile_ahead import CompileAhead
from tpurl.rl.timeline import COMPILE_CLOCK, compile_seconds, steady_steps
from tpurl.train.packed_shapes import PackedShapes
from tpurl.train.packing import row_ladder

B, T = 8, 4  # 8 sequences padded to 4 tokens, rows 4 tokens long: 1 to 8 packed rows in 1 block


def _batch(rows: int) -> dict:
    return {"valid": np.ones((B, T), bool), "unpack_index": np.zeros((B, T), np.int32),
            "packed_tokens": np.ones((rows, T), np.int32), "packed_counts": np.ones((rows, T), np.int32)}


def _new_program(salt: int):
    """A jitted program of its own (`salt` makes its computation another test's programs are not:
    JAX finds a computation compiled once in its caches, the persistent one included)."""
    return jax.jit(lambda scale, batch: scale * jnp.sum(batch["packed_tokens"] * batch["packed_counts"])
                   + jnp.sum(batch["valid"]) + salt)


def _wait(ahead: CompileAhead) -> int:
    """The jobs the thread ran, once it has none left."""
    deadline = time.monotonic() + 120
    while (done := ahead.settled()) is None:
        assert time.monotonic() < deadline, "the compile-ahead thread did not finish its jobs in 120 s"
        time.sleep(0.05)
    return done


def test_each_count_is_handed_out_once_and_one_a_call_met_is_not_compiled():
    _program = _new_program(1)
    shapes = PackedShapes(blocks=1, buckets=4)
    assert row_ladder(B, T, T, 1, 4) == (2, 4, 6, 8)
    shapes.record(_program.lower, 2.0, _batch(4))
    assert shapes.take() == [] and shapes.take_met_new()  # not watched: only the counts met are kept
    shapes.watch()
    shapes.record(_program.lower, 2.0, _batch(4))
    assert not shapes.take_met_new()
    shapes.record(_program.lower, 2.0, _batch(8))
    shapes.record(_program.lower, 2.0, _batch(4))
    assert shapes.take_met_new()  # a new count since the last read, though the last call's was not
    shapes.record(_program.lower, 2.0, _batch(8))
    jobs = {rows: (distance, job) for distance, rows, job in shapes.take()}
    assert {r: d for r, (d, _) in jobs.items()} == {2: 6, 6: 2} and shapes.take() == []  # from 8 rows, once
    shapes.record(_program.lower, 2.0, _batch(6))  # a call meets 6 before the thread gets to it
    compiled = COMPILE_CLOCK.compiled()
    jobs[6][1]()
    assert COMPILE_CLOCK.compiled() == compiled  # the call's to compile
    jobs[2][1]()
    assert COMPILE_CLOCK.compiled() == compiled + 1


def test_the_thread_compiles_every_count_not_met_and_a_later_call_compiles_nothing():
    _program = _new_program(2)
    shapes, said = PackedShapes(blocks=1, buckets=4), []
    ahead = CompileAhead([shapes], warn=said.append)  # watches the programs
    shapes.record(_program.lower, 3.0, _batch(4))
    _program(3.0, _batch(4))
    ahead.schedule()
    assert _wait(ahead) == 3 and ahead.settled() == 0  # the jobs run since the last call
    before = COMPILE_CLOCK.process_totals()["programs"]
    for rows in row_ladder(B, T, T, 1, 4):
        shapes.record(_program.lower, 3.0, _batch(rows))
        _program(3.0, _batch(rows))
    assert COMPILE_CLOCK.process_totals()["programs"] == before  # every count was compiled ahead
    assert shapes.take_waited() == 0.0
    ahead.schedule()  # nothing left to hand out
    ahead.close()
    assert ahead.summary()["ahead_programs"] == 3 and ahead.summary()["ahead_seconds"] > 0 and not said


def test_a_call_that_meets_a_count_being_compiled_waits_for_it():
    _program = _new_program(3)
    shapes = PackedShapes(blocks=1, buckets=2)  # counts 4 and 8
    shapes.watch()
    started, release = threading.Event(), threading.Event()

    def slow_lower(*args):
        started.set()
        release.wait(60)
        return _program.lower(*args)

    shapes.record(slow_lower, 5.0, _batch(4))
    (_, rows, job), = shapes.take()
    worker = threading.Thread(target=job)
    worker.start()
    assert rows == 8 and started.wait(60)
    caller = threading.Thread(target=shapes.record, args=(_program.lower, 5.0, _batch(8)))
    caller.start()
    caller.join(0.5)
    assert caller.ident is not None and caller.is_alive()  # the call waits for the compile in progress ...
    release.set()
    worker.join(60)
    caller.join(60)
    assert not caller.is_alive() and shapes.take_waited() > 0  # ... and goes on once it is done
    before = COMPILE_CLOCK.process_totals()["programs"]
    _program(5.0, _batch(8))
    assert COMPILE_CLOCK.process_totals()["programs"] == before


def test_a_program_that_fails_to_compile_is_said_once_and_the_run_goes_on():
    def failing_lower(*args):
        raise ValueError("no such shape\nsecond line")

    shapes = PackedShapes(blocks=1, buckets=4)
    said = []
    ahead = CompileAhead([shapes], warn=said.append)
    shapes.record(failing_lower, 1.0, _batch(4))
    ahead.schedule()
    assert _wait(ahead) == 1  # the first job failed, the others were dropped: nothing left pending
    shapes.record(failing_lower, 1.0, _batch(2))  # a count whose compile was handed out: no wait
    assert shapes.take_waited() == 0.0
    ahead.schedule()
    ahead.schedule()
    ahead.close()
    assert said == ["compiling ahead stopped: ValueError: no such shape; later steps compile their new packed shapes "
                    "when they meet them (RLConfig.compile_ahead=False turns it off)"]
    assert ahead.summary()["ahead_programs"] == 0


def test_a_failure_after_the_last_schedule_is_said_at_close():
    def failing_lower(*args):
        raise RuntimeError("late")

    shapes, said = PackedShapes(blocks=1, buckets=2), []
    ahead = CompileAhead([shapes], warn=said.append)
    shapes.record(failing_lower, 1.0, _batch(4))
    ahead.schedule()
    _wait(ahead)
    ahead.close()
    ahead.close()
    assert len(said) == 1 and "RuntimeError: late" in said[0]


def test_the_heap_is_frozen_after_compiles_only_while_the_thread_has_no_job(monkeypatch):
    """`freeze_if_compiled`: a step's compiles, or the thread's jobs, freeze the heap, but not
    while the thread is making a program (a freeze is owed until it is done); a step that waited
    for the thread's compile is not a steady one."""
    import tpurl.rl.loop as loop

    frozen = []
    monkeypatch.setattr(loop, "freeze_heap", lambda: frozen.append(True))
    _program = _new_program(4)
    shapes = PackedShapes(blocks=1, buckets=2)
    ahead = CompileAhead([shapes], warn=print)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_lower(*args):
        started.set()
        release.wait(60)
        lowered = _program.lower(*args)
        finished.set()
        return lowered

    shapes.record(slow_lower, 1.0, _batch(4))
    ahead.schedule()
    assert started.wait(60)
    assert loop.freeze_if_compiled({"compile/seconds": 1.0}, ahead) is True and not frozen  # owed
    release.set()
    assert finished.wait(60)
    deadline = time.monotonic() + 60
    while (owed := loop.freeze_if_compiled({}, ahead, True)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owed and frozen == [True]  # paid once the thread was done
    assert loop.freeze_if_compiled({}, ahead) is False and frozen == [True]  # nothing new since
    ahead.close()
    assert compile_seconds({"compile/wait_seconds": 0.5}) == 0.5
    assert steady_steps([{"compile/seconds": 2.0}, {"compile/wait_seconds": 0.5}, {}]) == [{}]


def test_the_report_line_says_what_was_compiled_ahead():
    from tpurl.rl.loop import compile_line

    c = {"run_seconds": 9.0, "programs": 5, "programs_loaded": 1, "ahead_programs": 2, "ahead_seconds": 1.5}
    assert "4 programs compiled (2 of them compiled ahead on a background thread, 1.5 s), 1 loaded" in compile_line(c)
    assert "4 programs compiled, 1 loaded" in compile_line({**c, "ahead_programs": 0})
