"""Host-side batching of prefill calls: length buckets, chunks of at most `max_batch` prompts, padding
of the prompt and sample counts (checked against a plain per-prompt reading of the rules)."""

import numpy as np
import pytest

from tpurl.generate import EngineConfig, SamplingConfig
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
    samplings = [SamplingConfig(temperature=0.5 + i / 10, top_k=i, top_p=1 - i / 20) for i in range(len(prompts))]
    calls = plan_prefill_calls(prompts, seeds, samplings, buckets=(8, 16, 32), max_batch=4)
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
                s = samplings[i]
                assert (call.temperature_P[r], call.top_k_P[r], call.top_p_P[r]) == \
                    (np.float32(s.temperature), s.top_k, np.float32(s.top_p))
                seen.append(i)
            else:  # padding row: one token, never read back
                assert call.lengths_P[r] == 1 and (call.tokens_PT[r] == 0).all()
                assert (call.temperature_P[r], call.top_k_P[r], call.top_p_P[r]) == (1, 0, 1)
    assert sorted(seen) == list(range(len(prompts)))


def test_max_prefill_batch_is_validated():
    with pytest.raises(ValueError, match="EngineConfig.max_prefill_batch must be >= 1"):
        EngineConfig(max_slots=4, max_seq_len=16, max_prefill_batch=0)


def test_prefill_forward_in_query_blocks_equals_one_product():
    """A prefill over 96-token right-padded prompts with the model's causal query blocks (3) hands
    the engine the same k/v (real positions) and last-position logits as with one product, and
    XLA counts fewer FLOPs for it (the blocks are used, not just allowed)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tpurl.generate.prefill import prefill_forward
    from tpurl.models import init_model, preset
    from tpurl.models.transformer import identity_constrain

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 96)), jnp.int32)
    lengths = jnp.asarray([96, 70], jnp.int32)
    outs, flops = [], []
    for blocks in (1, 3):
        cfg = preset("tiny", vocab_size=32, num_layers=2, max_position_embeddings=128, attention_query_blocks=blocks)
        graphdef, params = nnx.split(init_model(cfg, 0))
        fn = jax.jit(lambda p, t, n, g=graphdef: prefill_forward(g, p, t, n, constrain=identity_constrain,
                                                                  cache_dtype=jnp.float32))
        outs.append(fn(params, tokens, lengths))
        flops.append(fn.lower(params, tokens, lengths).compile().cost_analysis()["flops"])
    # XLA counts the layer scan's body once: one layer's two products over 2 prompts, a third skipped.
    assert flops[1] < flops[0] - 0.9 * 2 * 2 * 2 * cfg.num_heads * cfg.head_dim * 96 * 96 / 3
    real = np.arange(96)[None, :] < np.asarray(lengths)[:, None]
    for got, want in zip(outs[1][:2], outs[0][:2]):
        np.testing.assert_allclose(np.asarray(got)[:, real], np.asarray(want)[:, real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs[1][2]), np.asarray(outs[0][2]), rtol=1e-5, atol=1e-5)
