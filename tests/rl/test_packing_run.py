"""A whole RL step with packed sequences (the default) equals the same step run padded: PPO, so the
packed old-policy and reference logprobs, the critic's old values and GAE all feed the update,
over 2 epochs x 2 shuffled minibatches on 8 fake devices (2 batch shards x 4 tensor; each
minibatch packed per batch shard)."""

import pytest
import jax
import numpy as np

from algo_helpers import MESH3, BatchSpy, fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.tasks import AdditionConfig, TaskConfig
from tpurl.train.config import algorithm_preset
from tpurl.train.critic import make_value_fn
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.packing import pack_batch
from tpurl.train.step import make_train_step

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

COMPARED = ("train/", "advantages/", "mismatch/", "reward/")


def _padded(rt: RLRuntime) -> None:
    """The runtime's update, logprobs and critic rebuilt without packing (same layout and mesh)."""
    algo, kw = rt.spec.algorithm, {"mesh": rt.train_mesh, "layout": rt.train_layout}
    rt.train_step = make_train_step(rt.graphdef, algo, rt.cfg.optimizer, **kw)
    rt.logprob_fn = make_logprob_fn(rt.graphdef, temperature=algo.temperature, **kw)
    rt.value_fn = make_value_fn(rt.graphdef, **kw)


def test_packed_rl_step_equals_padded(tmp_path):
    algo = algorithm_preset("ppo", kl_coef=0.05, epochs=2, minibatches=2)
    placement = PlacementConfig(train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 4)),
                                rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 4)))
    # Room for long random completions, so that short ones pair up in packed rows.
    task = TaskConfig(addition=AdditionConfig(digits=1, num_eval=4, reverse_answer=True, extra_new_tokens=30))
    cfg = tiny_rl_config(tmp_path, algo, batch_size=16, placement=placement, task=task)
    assert cfg.packing.enabled
    rt = RLRuntime(*prepare(cfg))
    spy = BatchSpy(rt)
    packed_state, packed, _, _ = rl_step(rt, fresh_state(rt, ref_seed=1))
    # The minibatches really share rows: fewer packed rows than sequences.
    rows = [pack_batch(mb["tokens"], mb["valid"], cfg.packing, shards=2)["packed_tokens"].shape[0]
            for mb in spy.batches]
    assert len(rows) == 4 and min(rows) < 8, rows
    _padded(rt)
    padded_state, padded, _, _ = rl_step(rt, fresh_state(rt, ref_seed=1))
    keys = [k for k in padded if k.startswith(COMPARED) and k != "train/lr"]
    assert "train/value_loss" in keys and "train/kl" in keys
    for k in keys:
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert padded["train/ratio_max"] != 1.0  # later minibatches really are off-policy
    got, want = jax.device_get((packed_state.train.params, packed_state.train.value_head)), \
        jax.device_get((padded_state.train.params, padded_state.train.value_head))
    # Per tensor (after 4 Adam steps a weight whose gradient is ~0 moves by rounding noise).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
