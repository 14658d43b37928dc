"""In-flight weight updates at the rollout level: `Rollout.load` from another thread while
`Rollout.sample` decodes. With in_flight="continue" the running call switches to the new weights
between decode steps (tokens record both versions; the old weights are freed at the switch, not
before); with "drain" the load waits for the call to finish (one version per call). The load is
started deterministically from the engine's decode step `AT` (a wrapper around `Engine.generate`)."""

import threading
import time

import jax
import numpy as np
import pytest

from algo_helpers import tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.rollout import Rollout
from tpurl.rl.runtime import RLRuntime
from tpurl.tasks import AdditionConfig, TaskConfig, train_batch
from tpurl.train.config import algorithm_preset

AT = 2  # decode steps before the load starts


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    task = TaskConfig(addition=AdditionConfig(digits=1, num_eval=4, reverse_answer=True, extra_new_tokens=8))
    cfg = tiny_rl_config(tmp_path_factory.mktemp("run"), algorithm_preset("grpo"), task=task)
    rt = RLRuntime(*prepare(cfg))
    return rt, rt.init_params(0), rt.init_params(1)


def _rollout(rt, in_flight: str) -> Rollout:
    old = rt.rollout
    return Rollout(old.engine, old.shardings, old.sync_cfg, old.task, seq_len=old.seq_len, in_flight=in_flight)


def _on_decode_step(engine, hooks):
    """Call `hooks[n]()` after the engine's n-th decode step (1-based) from now on."""
    step, count = engine.generate, [0]

    def generate(params, state):
        out = step(params, state)
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
