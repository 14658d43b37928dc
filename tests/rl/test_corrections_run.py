"""Rollout corrections in RL steps (`tpurl.train.correction`): bypass mode skips the old-logprob
pass and trains against the rollout's logprobs; a correction's effect and the mismatch metrics
are logged every step."""

import numpy as np
import pytest

from algo_helpers import BatchSpy, count_scoring_calls, fresh_state, tiny_rl_config
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sync import SyncConfig
from tpurl.train.config import algorithm_preset
from tpurl.train.correction import correction_preset

MISMATCH = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2", "mismatch/ratio_max", "mismatch/ratio_p99",
            "correction/weight_mean", "correction/token_masked_frac", "correction/seq_masked_frac")


def _step(tmp_path, correction, sync=SyncConfig(rollout_dtype="bfloat16")):
    """One step of two minibatches (the old policy's logprobs are needed) with `correction`: its
    metrics, the update batches and how many scoring passes ran. Rollout weights in bf16 (default):
    a real rollout/trainer mismatch to measure and correct."""
    algo = algorithm_preset("grpo", group_size=4, minibatches=2, correction=correction)
    rt = RLRuntime(*prepare(tiny_rl_config(tmp_path, algo, sync=sync)))
    spy = BatchSpy(rt)
    calls = count_scoring_calls(rt)
    _, m, _, _ = rl_step(rt, fresh_state(rt))
    return m, spy.batches, len(calls)


@pytest.mark.slow
def test_bypass_skips_the_old_logprob_pass_and_trains_against_the_rollout(tmp_path):
    m, batches, passes = _step(tmp_path / "bypass", correction_preset("bypass"))
    assert passes == 1  # the reference's only (GRPO's KL); no old-policy pass
    assert len(batches) == 2
    for b in batches:  # each minibatch's old policy is the rollout's logprobs of its rows
        np.testing.assert_array_equal(b["old_logprobs"], b["rollout_logprobs"])
    assert all(np.isfinite(m[k]) for k in MISMATCH)
    # The mismatch is measured against the update's own forward: bf16 rollout vs the trainer.
    assert m["mismatch/abs_diff_max"] > 0 and m["correction/weight_mean"] == 1.0
    plain, _, passes = _step(tmp_path / "plain", correction_preset("none"))
    assert passes == 2  # the old policy's and the reference's
    assert plain["correction/weight_mean"] == 1.0 and plain["correction/token_masked_frac"] == 0
    # An icepop band up to half the largest log ratio of that gap (the same seed samples the same
    # batch) masks some tokens and keeps the others.
    high = plain["mismatch/ratio_max"] ** 0.5
    assert high > 1
    m_icepop, _, _ = _step(tmp_path / "icepop", correction_preset("icepop", mask_low=1 / high, mask_high=high,
                                                                  is_cap=high))
    assert m_icepop["mismatch/ratio_max"] == plain["mismatch/ratio_max"]
    assert 0 < m_icepop["correction/token_masked_frac"] < 1 and m_icepop["correction/weight_mean"] < 1, {k: v for k, v in m_icepop.items() if "mismatch" in k or "correction" in k}


@pytest.mark.slow
def test_an_fp8_rollout_is_measured_and_corrected(tmp_path):
    """fp8 rollout weights (SyncConfig.quantize): the step runs on them, and the mismatch it
    measures against the trainer is larger than a bf16 rollout's on the same seed; the token TIS
    correction clips its ratios."""
    fp8 = SyncConfig(rollout_dtype="bfloat16", quantize="fp8")
    m8, batches, _ = _step(tmp_path / "fp8", correction_preset("tis", is_cap=1.0), sync=fp8)
    m16, _, _ = _step(tmp_path / "bf16", correction_preset("tis", is_cap=1.0))
    assert all(np.isfinite(m8[k]) for k in MISMATCH)
    assert m8["mismatch/kl_k3"] > m16["mismatch/kl_k3"] > 0
    assert m8["mismatch/abs_diff_max"] > m16["mismatch/abs_diff_max"]
    assert m8["correction/weight_mean"] < 1


@pytest.mark.slow
def test_bypass_without_a_reference_runs_no_scoring_program(tmp_path):
    """Bypass with no KL: the logprobs phase runs no pass, and the step compiles and analyses no
    scoring program it does not run."""
    algo = algorithm_preset("grpo", group_size=4, kl_coef=0.0, minibatches=2, correction=correction_preset("bypass"))
    rt = RLRuntime(*prepare(tiny_rl_config(tmp_path, algo)))
    _, m, _, _ = rl_step(rt, fresh_state(rt))
    assert m["memory/update/program_peak_bytes"] > 0  # the step's programs were analysed ...
    assert not any(k.startswith("memory/logprobs/program") for k in m)  # ... and no scoring one
    assert np.isfinite(m["train/loss"]) and np.isfinite(m["mismatch/kl_k3"])


def test_a_minibatch_without_sampled_tokens_leaves_the_steps_ratios_alone():
    from tpurl.rl.step import _mean_metrics

    full = {"mismatch/ratio_max": np.float32(1.5), "mismatch/ratio_min": np.float32(0.8),
            "mismatch/ratio_p99": np.float32(1.2), "grad_norm": np.float32(np.inf)}
    empty = {"mismatch/ratio_max": np.float32(-np.inf), "mismatch/ratio_min": np.float32(np.inf),
             "mismatch/ratio_p99": np.float32(np.nan), "grad_norm": np.float32(1.0)}
    got = _mean_metrics([full, empty])
    assert got["mismatch/ratio_max"] == 1.5 and got["mismatch/ratio_min"] == np.float32(0.8)
    assert got["mismatch/ratio_p99"] == np.float32(1.2)
    assert got["grad_norm"] == np.inf  # other metrics keep their non-finite values
