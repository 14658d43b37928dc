"""In-flight weight updates at the rollout level: `RolloutSide.load` from another thread while
`RolloutSide.sample` decodes. With in_flight="continue" the running call switches to the new weights
between decode steps (tokens record both versions; the old weights are freed at the switch, not
before); with "drain" the load waits for the call to finish (one version per call). The load is
started deterministically from the engine's decode step `AT` (a wrapper around `Engine.generate`)."""

import threading
import time

import jax
import numpy as np
import pytest

from algo_helpers import tiny_rl_config
from tpurl.generate import KVPool
from tpurl.rl.loop import prepare
from tpurl.rl.rollout import RolloutSide
from tpurl.rl.runtime import RLRuntime
from tpurl.tasks import AdditionConfig, TaskConfig, train_batch
from tpurl.threads import WrongThread
from tpurl.train.config import algorithm_preset

AT = 2  # decode steps before the load starts


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    task = TaskConfig(addition=AdditionConfig(digits=1, num_eval=4, reverse_answer=True, extra_new_tokens=8))
    cfg = tiny_rl_config(tmp_path_factory.mktemp("run"), algorithm_preset("grpo"), task=task)
    rt = RLRuntime(*prepare(cfg))
    return rt, rt.init_params(0), rt.init_params(1)


def _rollout(rt, in_flight: str) -> RolloutSide:
    old = rt.rollout
    return RolloutSide(old.engine, old.shardings, old.sync_cfg, old.task, seq_len=old.seq_len, in_flight=in_flight)


def _on_decode_step(engine, hooks):
    """Call `hooks[n]()` after the engine's n-th decode step (1-based) from now on."""
    step, count = engine.generate, [0]

    def generate(params, state, **kw):
        out = step(params, state, **kw)
        count[0] += 1
        if count[0] in hooks:
            hooks[count[0]]()
        return out

    engine.generate = generate
    return lambda: vars(engine).pop("generate")


def _sample_with_load(rt, rollout, new_params, hooks_for):
    rollout.load(rt.init_params(0), version=0)
    old = rollout.weights.current.owned  # what the sync made (leaves it passes through stay the trainer's)
    assert old
    errors = []

    def load():
        try:
            rollout.load(new_params, version=1)
        except BaseException as e:  # raised in the test's thread below
            errors.append(e)

    loader = threading.Thread(target=load, daemon=True)
    undo = _on_decode_step(rollout.engine, hooks_for(rollout, loader, old))
    try:
        problems, _ = train_batch(rt.task, 0, 4)
        ro = rollout.sample(problems, n=2, seed=0, temperature=1.0)
    finally:
        undo()
    loader.join(timeout=120)
    assert not loader.is_alive() and not errors, errors
    return ro, old


@pytest.mark.slow
def test_continue_switches_a_running_sample_and_frees_the_old_weights_at_the_switch(runtime):
    rt, _, new_params = runtime
    rollout = _rollout(rt, "continue")

    def hooks_for(rollout, loader, old):
        def load():
            loader.start()
            loader.join(timeout=120)  # a continuing load does not wait for the running sample
            assert rollout.version == 1 and rollout.weights.held() == [0]
            assert not any(x.is_deleted() for x in old)  # the sample still holds them

        def switched():
            assert rollout.weights.held() == [1] and all(x.is_deleted() for x in old)

        return {AT: load, AT + 1: switched}

    ro, old = _sample_with_load(rt, rollout, new_params, hooks_for)
    v = ro.token_versions[ro.sampled]
    assert set(np.unique(v)) == {0, 1}
    # Per sequence, the versions never go back.
    for row in range(len(ro.sampled)):
        seq = ro.token_versions[row][ro.sampled[row]]
        assert (np.diff(seq) >= 0).all()
    assert rollout.weights.held() == [] and not any(x.is_deleted() for x in jax.tree.leaves(rollout.params))


def test_drain_finishes_the_running_sample_on_its_weights_then_loads(runtime):
    rt, _, new_params = runtime
    rollout = _rollout(rt, "drain")
    states = []

    def hooks_for(rollout, loader, old):
        def load():
            loader.start()
            deadline = time.monotonic() + 60
            while not rollout.weights.pending and time.monotonic() < deadline:  # the load waits to drain
                time.sleep(0.001)
            assert rollout.weights.pending

        def draining():
            states.append((rollout.weights.held(), any(x.is_deleted() for x in old)))

        return {AT: load, AT + 1: draining}

    ro, old = _sample_with_load(rt, rollout, new_params, hooks_for)
    assert states == [([0], False)]  # the load waited; the old weights were still there
    assert (ro.token_versions[ro.sampled] == 0).all()
    assert rollout.version == 1 and all(x.is_deleted() for x in old)


def test_in_flight_mode_is_checked(runtime):
    with pytest.raises(ValueError, match="in_flight='later' is unknown"):
        _rollout(runtime[0], "later")


def _in_thread(fn, timeout: float = 120.0):
    """`fn()` on a thread of its own; its error, or None. A call still running after `timeout`
    seconds (a deadlock) fails the test instead of hanging it."""
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:
            errors.append(e)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} still runs after {timeout} s"
    return errors[0] if errors else None


def test_a_rollout_window_belongs_to_the_thread_that_opened_it(runtime):
    """While a window is open on one thread (the asynchronous rollout's), another thread's
    `open`, `sample`, `close` and the engine's `init_decode_state` raise at once, naming both
    threads; once the window closes, any thread may open one."""
    rt, params, _ = runtime
    rollout = _rollout(rt, "drain")
    rollout.load(params, version=0)
    opened, done = threading.Event(), threading.Event()

    def window():
        rollout.open()
        opened.set()
        done.wait(120)
        rollout.close()
    owner = threading.Thread(target=window, name="tpurl-rollout", daemon=True)
    owner.start()
    assert opened.wait(120)
    problems, _ = train_batch(rt.task, 0, 2)
    try:
        calls = {"RolloutSide.sample": lambda: rollout.sample(problems, n=2, seed=0, temperature=1.0),
                 "RolloutSide.open": rollout.open, "RolloutSide.close": rollout.close,
                 "Engine.init_decode_state": lambda: KVPool(rollout.engine)}
        for what, call in calls.items():
            with pytest.raises(WrongThread, match=f"{what}: called from thread 'MainThread', but the rollout window "
                                                  "belongs to thread 'tpurl-rollout'"):
                call()
    finally:
        done.set()
        owner.join(120)
    rollout.lend(lambda: None, None)  # closed there: the main thread may open a window now


def test_a_drain_load_from_the_sampling_thread_raises_instead_of_waiting_for_itself(runtime):
    """With in_flight="drain" a load waits for the running sample call; from that call's own
    thread (its `between_steps` hook) it would wait forever, so it raises."""
    rt, params, new_params = runtime
    rollout = _rollout(rt, "drain")
    rollout.load(params, version=0)
    problems, _ = train_batch(rt.task, 0, 2)

    def sample_and_load():
        with rollout.between_steps(lambda: rollout.load(new_params, version=1)):
            rollout.sample(problems, n=2, seed=0, temperature=1.0)
    error = _in_thread(sample_and_load, timeout=60.0)
    assert isinstance(error, WrongThread) and "would wait for itself" in str(error)
    assert rollout.weights.held() == [] and rollout.version == 0  # nothing half-loaded
