"""Batch-invariant computation (tpurl.models.invariant, bitwise mode): a row's result from `tiled`
products and reductions is the same bits whatever else shares the program (other row counts,
offsets, short axes, fp32 and bf16), where XLA's plain forms are not; `rounded` keeps a product out
of a fused multiply-add, where XLA's plain form contracts it; packed and padded rows give a token
the same attention window and the same attention bits as its sequence alone."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tpurl.models.attention import causal_padding_mask, key_ends_mask
from tpurl.models.invariant import matmul_rows, rounded, rowwise, window_attention, window_indices

SIZES = (1, 5, 20, 63, 64, 65, 144, 400)


def _rows_invariant(fn, x) -> bool:
    """Whether `fn`'s rows over every leading slice of `x` (and at an offset) equal its rows over all of `x`."""
    f = jax.jit(fn)
    full = np.asarray(f(x))
    return all(np.array_equal(np.asarray(f(x[off:off + m])), full[off:off + m]) for m in SIZES for off in (0, 3)
               if off + m <= x.shape[0])


def _mean_sq(x):
    return jnp.mean(jnp.square(x), axis=-1, keepdims=True)


@pytest.mark.parametrize("k,n,dtype", [(8, 32, jnp.float32), (16, 16, jnp.float32), (32, 64, jnp.float32),
                                       (128, 512, jnp.float32), (64, 128, jnp.bfloat16)])
def test_tiled_products_and_reductions_are_row_invariant(k, n, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(400, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)), dtype)
    assert _rows_invariant(lambda x: matmul_rows(x, w), x)
    assert _rows_invariant(lambda x: rowwise(_mean_sq, x.astype(jnp.float32)), x)


def test_the_plain_forms_are_not():
    """What `tiled` removes: XLA:CPU's plain matmul and reduction round a row differently with the
    number of rows beside it."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(400, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 512)), jnp.float32)
    assert not _rows_invariant(lambda x: x @ w, x)
    assert not _rows_invariant(_mean_sq, jnp.asarray(rng.normal(size=(400, 16)), jnp.float32))


def test_rounded_keeps_products_out_of_fused_multiply_adds():
    rng = np.random.default_rng(0)
    x, c, r, s = (jnp.asarray(rng.normal(size=4096), jnp.float32) for _ in range(4))
    unfused = (np.asarray(x) * np.asarray(c)) + (np.asarray(r) * np.asarray(s))  # each product rounded
    plain = jax.jit(lambda x, c, r, s: x * c + r * s)(x, c, r, s)
    pinned = jax.jit(lambda x, c, r, s, z: rounded(x * c, z) + rounded(r * s, z))(x, c, r, s, jnp.int32(0))
    assert not np.array_equal(np.asarray(plain), unfused)  # XLA contracts one product into an FMA
    np.testing.assert_array_equal(np.asarray(pinned), unfused)
    half = jnp.asarray(np.asarray(x).astype(ml_dtypes.bfloat16))
    assert rounded(half, jnp.int32(0)).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
@pytest.mark.slow
def test_bitwise_gradients_are_the_fast_ones(name):
    """Bitwise mode computes the same function: its loss gradients (through `rounded`, the tiles and
    the windows) equal fast mode's to float32 rounding."""
    from flax import nnx

    from tpurl.models import init_model, preset
    from tpurl.train.logprobs import token_logprobs

    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 128, (3, 11)), jnp.int32)
    valid = jnp.asarray(np.arange(11)[None, :] >= np.asarray([[0], [2], [5]]))

    def grads(consistency):
        cfg = preset(name, consistency=consistency, max_position_embeddings=32)
        graphdef, params = nnx.split(init_model(cfg, 0))
        loss = lambda p: jnp.sum(token_logprobs((graphdef, p), tokens, valid)[0])  # noqa: E731
        return jax.grad(loss)(params)

    fast, bitwise = grads("fast"), grads("bitwise")
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(bitwise)):
        assert float(jnp.max(jnp.abs(b))) > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-4)


def test_windows_list_the_visible_keys_in_position_order():
    # One packed row: a prompt (columns 0-2) shared by two completions (3-4 and 5-6), then padding.
    ends = jnp.asarray([[7, 7, 7, 5, 5, 7, 7, 0]])
    idx, valid = window_indices(key_ends_mask(ends)[:, 0], 6)
    assert idx[0, 4].tolist() == [0, 1, 2, 3, 4, 8] and valid[0, 4].tolist() == [1, 1, 1, 1, 1, 0]
    assert idx[0, 6].tolist() == [0, 1, 2, 5, 6, 8]  # the second completion skips the first one


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_a_token_attends_alike_packed_padded_and_alone(dtype):
    """The same sequence's attention outputs, as the first of two padded rows, packed behind a
    shared prompt, and alone: the same bits."""
    rng = np.random.default_rng(1)
    n, kv, h = 4, 2, 8
    qkv = [jnp.asarray(rng.normal(size=(1, 8, c, h)), dtype) for c in (n, kv, kv)]
    window = 16
    packed = window_attention(*qkv, key_ends_mask(jnp.asarray([[7, 7, 7, 5, 5, 7, 7, 0]]))[:, 0], window)
    # Sequence B = columns 0-2 and 5-6 of the packed row, alone.
    cols = jnp.asarray([0, 1, 2, 5, 6])
    alone = window_attention(*(x[:, cols] for x in qkv), causal_padding_mask(jnp.ones((1, 5), bool))[:, 0], window)
    np.testing.assert_array_equal(np.asarray(packed[0, 5:7]), np.asarray(alone[0, 3:5]))
    # In a padded batch of two rows beside another sequence.
    other = [jnp.asarray(rng.normal(size=x[:, cols].shape), dtype) for x in qkv]
    batch = [jnp.concatenate([x[:, cols], o]) for x, o in zip(qkv, other)]
    padded = window_attention(*batch, causal_padding_mask(jnp.ones((2, 5), bool))[:, 0], window)
    np.testing.assert_array_equal(np.asarray(padded[0]), np.asarray(alone[0]))
