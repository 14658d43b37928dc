"""Narrowed decode steps (tpurl.generate.compaction): the widths and the slots a step runs, and a
sampled rollout whose sequences finish at different lengths decoded at narrowing widths against
the same rollout at full width and against a dense teacher-forced forward."""

import numpy as np
import pytest

from engine_setup import CFG, MAX_NEW, PROMPTS, SEQ
from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.generate.compaction import decode_widths, step_rows


def test_widths_and_rows():
    # max_slots times 1, 3/4, 1/2, 3/8, ..., 1/8: whole numbers only, the 3/4 steps from 16 slots
    # up, `buckets` of them at most.
    assert decode_widths(128, 7) == (128, 96, 64, 48, 32, 24, 16) and decode_widths(256, 9)[-1] == 32
    assert decode_widths(128, 3) == (128, 96, 64)
    assert decode_widths(32, 7) == (32, 24, 16, 8, 4) and decode_widths(24, 7) == (24, 18, 12, 6, 3)
    assert decode_widths(8, 7) == (8, 4, 2, 1) and decode_widths(12, 7) == (12, 6, 3)
    assert decode_widths(6, 4) == (6, 3) and decode_widths(8, 1) == (8,) and decode_widths(5, 4) == (5,)
    widths = (8, 4, 2)
    assert step_rows([0, 3, 4, 7, 5], 8, widths) is None  # more than half in use: full width
    np.testing.assert_array_equal(step_rows([6, 3, 5], 8, widths), [0, 3, 5, 6])  # padded with free slots
    np.testing.assert_array_equal(step_rows([7], 8, widths), [0, 7])
    np.testing.assert_array_equal(step_rows([], 8, widths), [0, 1])
    with pytest.raises(ValueError, match="decode_buckets"):
        EngineConfig(decode_buckets=0)


# Sequences that stop at a stop token finish at different lengths, so the slots in use dwindle.
STOPPING = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=tuple(range(3, 3 + 12)))


def _run(model_and_params, buckets):
    engine = Engine(CFG, EngineConfig(max_slots=8, max_seq_len=SEQ, page_size=4, prefill_buckets=(8, 32),
                                      max_stop_tokens=16, decode_buckets=buckets), graphdef=model_and_params[0])
    out = generate(engine, model_and_params[1], PROMPTS[:8], n_samples=2, sampling=STOPPING, seed=3)
    return engine, [c for row in out for c in row]


@pytest.mark.slow
def test_narrowed_decode_equals_full_width(model_and_params, full_logits):
    narrow_engine, narrow = _run(model_and_params, 4)
    full_engine, full = _run(model_and_params, 1)
    lengths = [len(c.token_ids) for c in full]
    assert min(lengths) < max(lengths) == MAX_NEW  # some stopped early, some ran to the limit
    # The narrowed run computed fewer slot-steps in as many steps, at more than one width.
    assert narrow_engine.stats["decode_steps"] == full_engine.stats["decode_steps"]
    assert narrow_engine.stats["decode_slot_steps"] < full_engine.stats["decode_slot_steps"]
    assert full_engine.trace_counts["generate"] == 1 < narrow_engine.trace_counts["generate"] <= 4
    for a, b in zip(narrow, full):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # And both against a dense teacher-forced forward over each whole sequence.
    seqs = [c.prompt_ids.tolist() + c.token_ids.tolist() for c in narrow]
    logits = full_logits(seqs).astype(np.float64)
    for c, seq, lg in zip(narrow, seqs, logits):
        p = len(c.prompt_ids)
        rows = lg[p - 1:len(seq) - 1]
        logz = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1)
        want = rows[np.arange(len(rows)), c.token_ids] - logz
        np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
