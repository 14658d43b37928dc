"""The train side of a step keeps what it computes on the device: the old and reference logprobs,
the critic's values and GAE's `[B, T]` advantages never come to the host, and every `[B, T]` float
array the step uploads is one that was born on the host (the loss mask, the rollout's logprobs).
With one minibatch the step's rows go up once: the scoring passes and every epoch of the update
read the same placed batch."""

import contextlib

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from algo_helpers import fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import learn
from tpurl.rl.timeline import Timeline
from tpurl.train.config import algorithm_preset


@contextlib.contextmanager
def transfers():
    """Records `(direction, shape, dtype)` of every device->host read of a jax array and every
    host->device `jax.device_put` of a numpy array (with the array)."""
    seen = {"to_host": [], "to_device": []}
    device_get, device_put, asarray = jax.device_get, jax.device_put, np.asarray
    array_method = ArrayImpl.__array__

    def record_reads(tree):
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array):
                seen["to_host"].append((x.shape, x.dtype))

    def get(tree, *args, **kwargs):
        record_reads(tree)
        return device_get(tree, *args, **kwargs)

    def put(x, *args, **kwargs):
        for leaf in jax.tree.leaves(x):
            if isinstance(leaf, np.ndarray):
                seen["to_device"].append((leaf.shape, leaf.dtype, leaf))
        return device_put(x, *args, **kwargs)

    def as_array(a, *args, **kwargs):
        if isinstance(a, ArrayImpl):
            seen["to_host"].append((a.shape, a.dtype))
        return asarray(a, *args, **kwargs)

    def method(self, *args, **kwargs):
        seen["to_host"].append((self.shape, self.dtype))
        return array_method(self, *args, **kwargs)

    patches = [(jax, "device_get", get), (jax, "device_put", put), (np, "asarray", as_array),
               (ArrayImpl, "__array__", method)]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield seen
    finally:
        for (owner, name, _), original in zip(patches, (device_get, device_put, asarray, array_method)):
            setattr(owner, name, original)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,batch", [
    ("ppo", {}), ("grpo", dict(group_size=4, minibatches=2, micro_batches=2))])
def test_logprobs_values_and_advantages_stay_on_the_device(tmp_path, algorithm, batch):
    # Two epochs: the old policy's logprobs are a pass of their own; KL: the reference's too.
    # GRPO's minibatches and packed micro-batches index the device arrays.
    algo = algorithm_preset(algorithm, kl_coef=0.05, epochs=2, **batch)
    rt = RLRuntime(*prepare(tiny_rl_config(tmp_path, algo, batch_size=16 if batch else 8)))
    state = fresh_state(rt)
    problems = [rt.task.train_problem(i) for i in range(rt.cfg.prompts_per_step)]
    ro, train, ref = rt.rollout.lend(lambda: rt.rollout.sample(problems, n=rt.cfg.group_size, seed=0,
                                                               temperature=1.0), state.train, state.ref_params)
    bt = ro.tokens.shape
    train = learn(rt, train, ref, ro, 0, Timeline()).train  # compiles (its reads are the same)
    with transfers() as seen:
        learn(rt, train, ref, ro, 1, Timeline())
    floats_read = [s for s, dtype in seen["to_host"] if s[1:] == bt[1:] and np.issubdtype(dtype, np.floating)]
    assert floats_read == [], f"{len(floats_read)} [rows, T] float arrays came to the host"
    # Rows of what was born on the host: the loss mask and the rollout's logprobs.
    host_rows = {np.asarray(r, np.float32).tobytes() for h in (ro.loss_mask, ro.rollout_logprobs) for r in h}
    uploaded = [a for s, dtype, a in seen["to_device"] if s[1:] == bt[1:] and np.issubdtype(dtype, np.floating)]
    assert uploaded, "the update uploads the batch's host arrays"
    for a in uploaded:
        assert all(np.asarray(r, np.float32).tobytes() in host_rows for r in a), \
            "a [rows, T] float array computed on the device went back up"
    if algo.minibatches == 1:  # every array uploaded once: nothing is placed twice
        seen_once = [(a.shape, a.dtype.str, a.tobytes()) for _, _, a in seen["to_device"] if a.size > 1]
        assert len(seen_once) == len(set(seen_once)), "an array of the step was uploaded more than once"
