"""The step timeline's compile clock and the steady steps that averages use."""

import threading

import jax
import jax.numpy as jnp

from tpurl.rl.timeline import COMPILE_KEY, Timeline, compile_summary, steady_steps


def _step(fn, x):
    tl = Timeline()
    with tl.phase("update") as res:
        res.value = fn(x)
    tl.finish()
    return tl.metrics()


def test_compile_seconds_are_the_timelines_own_threads():
    """A program another thread compiles meanwhile (the rollout thread's) is not this step's."""
    step = Timeline()
    other = {}

    def rollout_thread():
        other.update(_step(jax.jit(lambda x: jnp.sin(x) * 5 - 2), jnp.ones(11)))
    thread = threading.Thread(target=rollout_thread)
    thread.start()
    thread.join()
    step.finish()
    assert other[COMPILE_KEY] > 0 and step.compile_seconds == 0.0


def test_compile_seconds_count_new_programs_only():
    fn = jax.jit(lambda x: jnp.tanh(x) * 3 + 1)
    first = _step(fn, jnp.ones(7))
    again = _step(fn, jnp.ones(7))  # the same program: JAX's cache, nothing made
    new_shape = _step(fn, jnp.ones(9))
    assert 0 < first[COMPILE_KEY] <= first["time/update_s"]
    assert again[COMPILE_KEY] == 0.0
    assert new_shape[COMPILE_KEY] > 0


def test_steady_steps_leave_out_compiling_steps():
    records = [{"step": 1, COMPILE_KEY: 2.0}, {"step": 2, COMPILE_KEY: 0.0}, {"step": 3, COMPILE_KEY: 1.5},
               {"step": 4, COMPILE_KEY: 0.0}, {"step": 5}]  # a record from before the clock counts as steady
    assert [r["step"] for r in steady_steps(records)] == [2, 4, 5]
    compiling = [{"step": 1, COMPILE_KEY: 1.0}, {"step": 2, COMPILE_KEY: 1.0}]
    assert [r["step"] for r in steady_steps(compiling)] == [2]  # every step compiled: all but the first
    assert compile_summary(records) == {"steps": 2, "seconds": 3.5}
    # A step whose batch compiled on the rollout thread compiled too (the main thread waited for it).
    rollout = [{"step": 1, COMPILE_KEY: 1.0}, {"step": 2, COMPILE_KEY: 0.0, "compile/rollout_seconds": 0.5},
               {"step": 3, COMPILE_KEY: 0.0, "compile/rollout_seconds": 0.0}]
    assert [r["step"] for r in steady_steps(rollout)] == [3]
    assert compile_summary(rollout) == {"steps": 2, "seconds": 1.5}
