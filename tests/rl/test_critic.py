"""PPO with a value head in the RL loop: old-policy values in the logprobs phase, GAE advantages
against a float64 numpy recomputation of the step's batch, a value loss that trains the critic,
and the value head in the checkpoint."""

import pytest
import jax
import numpy as np

from algo_helpers import BatchSpy, fresh_state, tiny_rl_config
from tpurl.checkpoint import Checkpointer
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.train.config import algorithm_preset

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

KL_COEF, GAMMA, LAM = 0.05, 0.9, 0.95


def _gae64(rewards_B, values, mask, old, ref):
    """Token rewards (sequence reward on the last completion token, minus the k1 KL penalty on every
    one), GAE over the completion tokens, then whitening: all in float64."""
    adv, ret = np.zeros(mask.shape), np.zeros(mask.shape)
    kl = old.astype(np.float64) - ref.astype(np.float64)
    for b in range(mask.shape[0]):
        idx = np.flatnonzero(mask[b] > 0)
        next_v = next_a = 0.0
        for j, t in enumerate(idx[::-1]):
            r = -KL_COEF * kl[b, t] + (rewards_B[b] if j == 0 else 0.0)
            delta = r + GAMMA * next_v - values[b, t]
            next_a = delta + GAMMA * LAM * next_a
            next_v = float(values[b, t])
            adv[b, t], ret[b, t] = next_a, next_a + values[b, t]
    sel = mask > 0
    mean, var = adv[sel].mean(), adv[sel].var()
    return np.where(sel, (adv - mean) / np.sqrt(var + 1e-8), 0.0), ret


def test_ppo_step_gae_value_loss_and_checkpoint(tmp_path):
    algo = algorithm_preset("ppo", kl_coef=KL_COEF, gamma=GAMMA, gae_lambda=LAM)
    cfg = tiny_rl_config(tmp_path, algo)
    rt = RLRuntime(*prepare(cfg))
    spy = BatchSpy(rt)
    state = fresh_state(rt, ref_seed=1)
    assert state.train.value_head is not None
    state, metrics, records, _ = rl_step(rt, state)
    (batch,) = spy.batches

    # The first step's values come from the zero-initialized head; GAE matches numpy anyway.
    rewards = np.asarray([r["reward"] for r in records], np.float64)
    want_adv, want_ret = _gae64(rewards, batch["old_values"], batch["loss_mask"], batch["old_logprobs"],
                                batch["ref_logprobs"])
    np.testing.assert_allclose(batch["advantages"], want_adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(batch["returns"], want_ret, rtol=1e-5, atol=1e-6)
    assert batch["advantages"].shape == batch["tokens"].shape and np.abs(want_ret).max() > 1e-3
    assert np.isfinite(metrics["train/value_loss"]) and metrics["train/value_loss"] > 0
    assert "advantages/value_mean" in metrics and "advantages/kl_penalty_mean" in metrics

    # The critic learns: its loss on the step's (fixed) batch falls over a few more updates.
    train, losses = state.train, [metrics["train/value_loss"]]
    for _ in range(4):
        train, m = rt.train_step(train, dict(batch))
        losses.append(float(m["value_loss"]))
    assert losses[-1] < losses[0] and all(np.isfinite(losses)), losses
    head = jax.device_get(train.value_head)
    assert np.abs(head["w"]).max() > 0

    # The value head is part of the checkpointed train state and restores exactly.
    ck = Checkpointer(str(tmp_path / "ck"), max_to_keep=1)
    ck.save(1, {"train": train}, {"step": 1})
    restored, _ = ck.restore(1, {"train": fresh_state(rt).train})
    ck.close()
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(restored["train"].value_head[k]), head[k])
