"""The compile-ahead thread (tpurl.rl.compile_ahead) on a small jitted program over packed batches:
each packed row count the program has not met is handed out once and compiled, and a later call of
it compiles nothing; a count a call met first is not compiled again; a program that fails to
compile stops the thread and is said once, and the caller goes on."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.rl.compile_ahead import CompileAhead
from tpurl.rl.timeline import COMPILE_CLOCK
from tpurl.train.packed_shapes import PackedShapes
from tpurl.train.packing import row_ladder

B, T = 8, 4  # 8 sequences padded to 4 tokens, rows 4 tokens long: 1 to 8 packed rows in 1 block


def _batch(rows: int) -> dict:
    return {"valid": np.ones((B, T), bool), "unpack_index": np.zeros((B, T), np.int32),
            "packed_tokens": np.ones((rows, T), np.int32), "packed_counts": np.ones((rows, T), np.int32)}


@jax.jit
def _program(scale, batch):
    return scale * jnp.sum(batch["packed_tokens"] * batch["packed_counts"]) + jnp.sum(batch["valid"])


def _wait(ahead: CompileAhead, programs: int) -> None:
    deadline = time.monotonic() + 120
    while ahead.summary()["ahead_programs"] < programs and time.monotonic() < deadline:
        time.sleep(0.05)


def test_each_count_is_handed_out_once_and_one_a_call_met_is_not_compiled():
    shapes = PackedShapes(blocks=1, buckets=4)
    assert row_ladder(B, T, T, 1, 4) == (2, 4, 6, 8)
    shapes.record(_program.lower, 2.0, _batch(4))
    assert shapes.take() == []  # not watched: nothing kept
    shapes.watch()
    shapes.record(_program.lower, 2.0, _batch(4))
    shapes.record(_program.lower, 2.0, _batch(8))
    jobs = dict(shapes.take())  # distance from the last call's 8 rows -> compile
    assert sorted(jobs) == [2, 6] and shapes.take() == []  # counts 6 and 2, once
    shapes.record(_program.lower, 2.0, _batch(6))  # a call meets 6 before the thread gets to it
    assert jobs[2]() is False and jobs[6]() is True


def test_the_thread_compiles_every_count_not_met_and_a_later_call_compiles_nothing():
    shapes, said = PackedShapes(blocks=1, buckets=4), []
    ahead = CompileAhead([shapes], warn=said.append)  # watches the programs
    shapes.record(_program.lower, 3.0, _batch(4))
    _program(3.0, _batch(4))
    first = ahead.schedule()
    _wait(ahead, 3)
    before = COMPILE_CLOCK.process_totals()["programs"]
    for rows in row_ladder(B, T, T, 1, 4):
        _program(3.0, _batch(rows))
    assert COMPILE_CLOCK.process_totals()["programs"] == before  # every count was compiled ahead
    assert first + ahead.schedule() == 3 and ahead.schedule() == 0  # programs compiled since the last call
    ahead.close()
    assert ahead.summary()["ahead_programs"] == 3 and ahead.summary()["ahead_seconds"] > 0 and not said


def test_a_program_that_fails_to_compile_is_said_once_and_the_run_goes_on():
    def failing_lower(*args):
        raise ValueError("no such shape\nsecond line")

    shapes = PackedShapes(blocks=1, buckets=4)
    said = []
    ahead = CompileAhead([shapes], warn=said.append)
    shapes.record(failing_lower, 1.0, _batch(4))
    deadline = time.monotonic() + 60
    while not said and time.monotonic() < deadline:
        ahead.schedule()
        time.sleep(0.05)
    ahead.schedule()
    ahead.close()
    assert said == ["compiling ahead stopped: ValueError: no such shape; later steps compile their new packed shapes "
                    "when they meet them (RLConfig.compile_ahead=False turns it off)"]
    assert ahead.summary()["ahead_programs"] == 0
