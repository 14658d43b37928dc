"""Host-side batching of prefill calls: length buckets, chunks of at most `max_batch` prompts, padding
of the prompt and sample counts (checked against a plain per-prompt reading of the rules)."""

import numpy as np
import pytest

from tpurl.generate import EngineConfig
from tpurl.generate.prefill import plan_prefill_calls, pow2_bucket


def test_pow2_bucket():
    assert [pow2_bucket(n, 16) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert [pow2_bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]  # the cap need not be a power of 2
    with pytest.raises(ValueError, match=r"n=7 must be in \[1, 6\]"):
        pow2_bucket(7, 6)


def test_plan_prefill_calls_groups_chunks_and_pads():
    rng = np.random.default_rng(0)
    lengths = [3, 12, 8, 9, 1, 30, 16, 5, 7, 2]
    prompts = [rng.integers(3, 100, n).astype(np.int32) for n in lengths]
    seeds = [np.arange(1 + i % 3, dtype=np.uint32) + 10 * i for i in range(len(prompts))]
    calls = plan_prefill_calls(prompts, seeds, buckets=(8, 16, 32), max_batch=4)
    # Bucket 8: prompts 0, 2, 4, 7, 8, 9 -> chunks of 4 and 2; bucket 16: 1, 3, 6; bucket 32: 5.
    assert [c.indices for c in calls] == [[0, 2, 4, 7], [8, 9], [1, 3, 6], [5]]
    assert [c.tokens_PT.shape for c in calls] == [(4, 8), (2, 8), (4, 16), (1, 32)]
    seen = []
    for call in calls:
        p, t = call.tokens_PT.shape
        g = max(len(seeds[i]) for i in call.indices)
        assert call.seeds_PG.shape == (p, g) and call.lengths_P.shape == (p,)
        for r in range(p):
            if r < len(call.indices):
                i = call.indices[r]
                n = len(prompts[i])
                assert call.lengths_P[r] == n and (call.tokens_PT[r, :n] == prompts[i]).all()
                assert (call.tokens_PT[r, n:] == 0).all()
                assert (call.seeds_PG[r, :len(seeds[i])] == seeds[i]).all()
                seen.append(i)
            else:  # padding row: one token, never read back
                assert call.lengths_P[r] == 1 and (call.tokens_PT[r] == 0).all()
    assert sorted(seen) == list(range(len(prompts)))


def test_max_prefill_batch_is_validated():
    with pytest.raises(ValueError, match="EngineConfig.max_prefill_batch must be >= 1"):
        EngineConfig(max_slots=4, max_seq_len=16, max_prefill_batch=0)
