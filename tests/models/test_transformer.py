"""The NNX transformer against an independent float64 numpy implementation."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from tpurl.models import forward_logits, init_model, preset
from tpurl.models.config import RopeScaling
from tpurl.models.attention import (DenseAttention, causal_blocked_attention, causal_blocked_fraction,
                                    causal_padding_mask, grouped_attention, key_ends_mask, mask_bias, query_block_cuts,
                                    resolve_attention_impl)
from tpurl.models.ops import dense, swiglu
from tpurl.models.transformer import positions_from_mask
from tpurl.train.parity import usable_compiler_options

FAST = usable_compiler_options({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False})
from tpurl.models.rope import inv_frequencies


def _np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rope(x, pos, inv):
    ang = pos[..., None] * inv  # B T H/2
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def numpy_logits(model, tokens, valid):
    """Float64 reference: explicit loops over heads, causal+padding mask, HF semantics."""
    cfg = model.config
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    lay = {k: f64(v) for k, v in model.layers.stacked().items()}
    pos = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.float64)
    inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = f64(model.embed_tokens[...])[tokens]
    b, t = tokens.shape
    g = cfg.num_heads // cfg.num_kv_heads
    mask = np.tril(np.ones((t, t), bool))[None] & valid[:, None, :].astype(bool)
    for layer in range(cfg.num_layers):
        p = {k: v[layer] for k, v in lay.items()}
        h = _np_rms(x, p["input_layernorm"], cfg.rms_norm_eps)
        q = np.einsum("btd,dnh->btnh", h, p["q_proj"])
        k = np.einsum("btd,dkh->btkh", h, p["k_proj"])
        v = np.einsum("btd,dkh->btkh", h, p["v_proj"])
        if cfg.attention_bias:
            q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
        if cfg.qk_norm:
            q, k = _np_rms(q, p["q_norm"], cfg.rms_norm_eps), _np_rms(k, p["k_norm"], cfg.rms_norm_eps)
        q, k = _np_rope(q, pos, inv), _np_rope(k, pos, inv)
        out = np.zeros_like(q)
        for n in range(cfg.num_heads):
            s = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // g]) / np.sqrt(cfg.head_dim)
            s = np.where(mask, s, -1e30)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, :, n] = np.einsum("bts,bsh->bth", w, v[:, :, n // g])
        x = x + np.einsum("btnh,nhd->btd", out, p["o_proj"])
        h = _np_rms(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
        gate, up = h @ p["gate_proj"], h @ p["up_proj"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["down_proj"]
    x = _np_rms(x, f64(model.norm[...]), cfg.rms_norm_eps)
    head = f64(model.embed_tokens[...]).T if cfg.tie_word_embeddings else f64(model.lm_head[...])
    return x @ head


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_scaled", "qwen2", "qwen3"])
def test_forward_matches_float64_numpy(variant):
    over = dict(vocab_size=37, num_layers=2)
    if variant == "llama_scaled":
        over.update(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16), rope_theta=500.0)
    elif variant == "qwen2":
        over.update(model_type="qwen2", attention_bias=True, tie_word_embeddings=True, num_kv_heads=1)
    else:
        over.update(model_type="qwen3", qk_norm=True, num_kv_heads=4)
    cfg = preset("tiny", **over)
    model = init_model(cfg, seed=3)
    if cfg.attention_bias:  # non-zero biases so that they are exercised
        for name in ("q_bias", "k_bias", "v_bias"):
            var = getattr(model.layers, name)
            var[...] = 0.1 * np.random.default_rng(1).standard_normal(var[...].shape).astype(np.float32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (3, 9))
    valid = np.ones((3, 9), bool)
    valid[1, :4] = False  # left padding
    valid[2, 6:] = False  # right padding
    got = np.asarray(forward_logits(model, jnp.asarray(tokens), jnp.asarray(valid)))
    want = numpy_logits(model, tokens, valid)
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_remat_and_bf16_run():
    cfg = preset("tiny", remat="full", dtype="bfloat16")
    model = init_model(cfg)
    tokens = jnp.ones((2, 5), jnp.int32)
    logits = forward_logits(model, tokens)
    assert logits.shape == (2, 5, cfg.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_dense_is_the_einsum_and_its_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5))  # [B, T, N, H]
    w = rng.normal(size=(4, 5, 6))  # [N, H, D]
    f = lambda x, w: jnp.sum(jnp.sin(dense(x, w, n_in=2)))  # noqa: E731
    np.testing.assert_allclose(dense(x, w, n_in=2), np.einsum("btnh,nhd->btd", x, w), rtol=1e-6)
    g = jax.grad(f, argnums=(0, 1))(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    ref = np.cos(np.einsum("btnh,nhd->btd", x, w))
    np.testing.assert_allclose(g[0], np.einsum("btd,nhd->btnh", ref, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g[1], np.einsum("btd,btnh->nhd", ref, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        dense(x, w, n_in=1)


def test_bad_config_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt-5")
    with pytest.raises(ValueError, match="model_type"):
        preset("tiny", model_type="mistral")
    with pytest.raises(ValueError, match="attention_query_blocks=0 must be >= 1"):
        preset("tiny", attention_query_blocks=0)


def test_attention_impl_selection():
    bf16, f32 = jnp.bfloat16, jnp.float32
    # "auto": cuDNN only on a CUDA GPU with a half-precision compute dtype and a head_dim it takes.
    assert resolve_attention_impl("auto", bf16, backend="gpu") == "cudnn"
    assert resolve_attention_impl("auto", jnp.float16, head_dim=128, backend="cuda") == "cudnn"
    assert resolve_attention_impl("auto", f32, backend="gpu") == "xla"
    assert resolve_attention_impl("auto", bf16, head_dim=256, backend="gpu") == "xla"
    assert resolve_attention_impl("auto", bf16, backend="rocm") == "xla"
    assert resolve_attention_impl("auto", bf16, backend="tpu") == "xla"
    assert resolve_attention_impl("cudnn", f32, backend="cpu") == "cudnn"  # explicit choices are kept
    # Here (CPU) "auto" is XLA whatever the dtype.
    assert jax.default_backend() == "cpu"
    assert resolve_attention_impl("auto", bf16) == resolve_attention_impl("auto", f32) == "xla"
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        preset("tiny", attention_impl="flash")
    with pytest.raises(ValueError, match="implementation='flash'"):
        DenseAttention(jnp.ones((1, 2), bool), implementation="flash")


def test_model_passes_its_attention_impl_to_dense_attention():
    """The config's choice reaches `jax.nn.dot_product_attention` when the caller leaves
    `DenseAttention(valid)`'s implementation unset; an explicit one wins. (cuDNN cannot run here,
    so choosing it fails at trace time: that is the observable.)"""
    model = init_model(preset("tiny", attention_impl="cudnn", dtype="bfloat16"))
    tokens = jnp.ones((2, 4), jnp.int32)
    valid = jnp.ones((2, 4), bool)
    with pytest.raises(RuntimeError, match="cuDNN"):
        jax.eval_shape(lambda: forward_logits(model, tokens))
    with pytest.raises(RuntimeError, match="cuDNN"):
        jax.eval_shape(lambda: model(tokens, positions_from_mask(valid), attention=DenseAttention(valid)))
    out = jax.eval_shape(lambda: model(tokens, positions_from_mask(valid),
                                       attention=DenseAttention(valid, implementation="xla"))[0])
    assert out.shape == (2, 4, 64)


@pytest.mark.slow
def test_remat_policies_and_unrolled_layers_give_the_same_gradients():
    base = preset("tiny", vocab_size=32, num_layers=2)
    graphdef, params = nnx.split(init_model(base, seed=2))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 8)), jnp.int32)
    valid = jnp.asarray(np.arange(8)[None, :] >= np.array([[0], [3]]))  # row 1 left-padded

    def grads(**switches):
        cfg = base.replace(**switches)
        gd = nnx.graphdef(init_model(cfg))  # only the (static) config differs

        def loss(p):
            logits = forward_logits(nnx.merge(gd, p), tokens, valid)
            return jnp.sum(jnp.tanh(logits) * valid[:, :, None])

        # The switches are in effect: a remat in the program; no layer loop left when unrolled.
        assert ("remat" in str(jax.make_jaxpr(loss)(params))) == (cfg.remat != "none")
        assert ("while" in jax.jit(loss).lower(params).as_text()) == (cfg.unroll_layers < cfg.num_layers)

        # Unoptimized XLA (where the backend takes the option): a few compiles, cheaply. Remat is
        # a property of the traced program, not of the backend's optimizations.
        return jax.jit(jax.grad(loss)).lower(params).compile(compiler_options=FAST or None)(params)

    want = grads(remat="none")
    for switches in ({"remat": "full"}, {"remat": "dots"}, {"unroll_layers": 2}, {"unroll_layers": 5, "remat": "dots"}):
        got = grads(**switches)
        for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
            g, w = np.asarray(g[...]), np.asarray(w[...])
            assert np.abs(g - w).max() <= 1e-5 * max(1.0, np.abs(w).max()), (switches, path)
    with pytest.raises(ValueError, match="unroll_layers"):
        base.replace(unroll_layers=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a CUDA GPU")
def test_cudnn_attention_matches_xla_on_gpu():
    """On a GPU: "auto" in bf16 is cuDNN, and its logits and gradients (left + right padding) match
    XLA's to bf16 accuracy."""
    cfg = preset("tiny", vocab_size=64, dtype="bfloat16", head_dim=16)
    assert resolve_attention_impl(cfg.attention_impl, cfg.compute_dtype, head_dim=cfg.head_dim) == "cudnn"
    graphdef, params = nnx.split(init_model(cfg, seed=1))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (3, 8)), jnp.int32)
    valid = np.ones((3, 8), bool)
    valid[1, :3] = False
    valid[2, 6:] = False
    valid = jnp.asarray(valid)

    def run(impl):
        def loss(p):
            model = nnx.merge(graphdef, p)
            hidden, _ = model(tokens, positions_from_mask(valid), attention=DenseAttention(valid, impl))
            logits = model.logits(hidden)
            return jnp.sum(jnp.where(valid[:, :, None], jnp.tanh(logits), 0.0)), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, want), g_want = run("xla")
    (_, got), g_got = run("cudnn")
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[v], np.asarray(want)[v], atol=3e-2, rtol=3e-2)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_got), nnx.to_flat_state(g_want)):
        a, b = np.asarray(a[...], np.float32), np.asarray(b[...], np.float32)
        assert np.abs(a - b).max() <= 5e-2 * max(np.abs(b).max(), 1e-3), path


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_attention_matches_jax_attention(packed):
    """The XLA path's attention (heads in front, additive mask) against
    `jax.nn.dot_product_attention` with the boolean mask, 4 query / 2 kv heads: outputs and
    gradients (float32, whose softmax JAX's reference computes in float32 even under x64) wherever
    a query sees a key; cotangents on queries that see nothing are zero, as in the model (they
    sit on padding)."""
    rng = np.random.default_rng(0)
    b, t, n, k, h = 3, 9, 4, 2, 8
    q, kk, v, ct = (jnp.asarray(rng.normal(size=s), jnp.float32)
                    for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)))
    if packed:
        # Segments [1 1 1 2 2 2 2 0 0], one segment, and a prefix tree: a 2-token prompt, one
        # sequence's 3 tokens after it, then a sibling's 2 (which see the prompt, not columns 2-4),
        # then padding.
        ends = jnp.asarray([[3, 3, 3, 7, 7, 7, 7, 0, 0], [9] * 9, [7, 7, 5, 5, 5, 7, 7, 0, 0]])
        mask = key_ends_mask(ends)
    else:
        mask = causal_padding_mask(jnp.asarray(np.arange(t)[None, :] >= np.array([[0], [3], [8]])))
    sees = np.asarray(mask).any(axis=-1)[:, 0]  # [B, T]: queries that see at least one key
    ct = ct * jnp.asarray(sees)[:, :, None, None]

    def loss(attend):
        return lambda q, kk, v: jnp.sum(attend(q, kk, v) * ct)

    def ours(q, kk, v):
        return grouped_attention(q, kk, v, mask_bias(mask))

    def ref(q, kk, v):
        return jax.nn.dot_product_attention(q, kk, v, mask=mask, implementation="xla")

    args = (q, kk, v)
    np.testing.assert_allclose(np.asarray(ours(*args))[sees], np.asarray(ref(*args))[sees], rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.grad(loss(ours), argnums=(0, 1, 2))(*args), jax.grad(loss(ref), argnums=(0, 1, 2))(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["padded", "packed", "longer_keys"])
def test_causal_blocked_attention_equals_one_product(case):
    """Query blocks scored only against the keys up to their end give the one-product attention's
    outputs (where a query sees a key) and gradients: left-padded rows, packed rows (a prefix tree),
    and queries that are the last T of S > T keys."""
    rng = np.random.default_rng(3)
    b, t, n, k, h = 2, 100, 4, 2, 8
    s = t + 20 if case == "longer_keys" else t
    q, ct = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(2))
    kk, v = (jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32) for _ in range(2))
    if case == "packed":
        ends = np.zeros((b, t), np.int32)
        ends[0, :40], ends[0, 40:90] = 40, 90  # two segments, then padding
        ends[1, :10], ends[1, 10:50], ends[1, 50:] = 100, 50, 100  # a prompt shared by two sequences
        mask = key_ends_mask(jnp.asarray(ends))
    else:
        starts = np.array([[0], [37]])
        valid = np.arange(s)[None, :] >= starts
        mask = causal_padding_mask(jnp.asarray(valid))[:, :, s - t:]  # the last t queries of s positions
    sees = np.asarray(mask).any(axis=-1)[:, 0]
    ct = ct * jnp.asarray(sees)[:, :, None, None]
    bias = mask_bias(mask)
    one = lambda q, kk, v: grouped_attention(q, kk, v, bias)
    blocked = lambda q, kk, v: causal_blocked_attention(q, kk, v, bias, 3)
    np.testing.assert_allclose(np.asarray(blocked(q, kk, v))[sees], np.asarray(one(q, kk, v))[sees],
                               rtol=1e-5, atol=1e-6)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(q, kk, v) for f in (blocked, one)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_query_block_cuts():
    """Nearly equal blocks cut on multiples of 8 (128 for blocks of 256 and more), no more than
    t // 32 of them."""
    assert query_block_cuts(100, 3) == [0, 32, 64, 100]
    assert query_block_cuts(64, 3) == [0, 32, 64]  # two blocks of 32, not three of 21
    assert query_block_cuts(20, 3) == [0, 20]
    assert query_block_cuts(2048, 3) == [0, 640, 1408, 2048]
    with pytest.raises(ValueError, match="query_blocks=0 must be >= 1"):
        DenseAttention(jnp.ones((1, 4), bool), query_blocks=0)
    assert causal_blocked_fraction(96, 96, 3) == pytest.approx(2 / 3)
    assert causal_blocked_fraction(96, 96, 1) == 1.0


@pytest.mark.slow
def test_model_skips_the_key_blocks_above_the_diagonal():
    """The model with `attention_query_blocks=3` computes the same hidden states (on real tokens) as
    with one product, and XLA counts fewer FLOPs for it: the blocks are not computed and masked."""
    cfg = preset("tiny", vocab_size=32, num_layers=1, max_position_embeddings=256)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 32, (2, 192)))
    valid = jnp.asarray(np.arange(192)[None, :] >= np.array([[0], [50]]))
    runs = {}
    for blocks in (1, 3):
        model = init_model(cfg.replace(attention_query_blocks=blocks, attention_impl="xla"), 0)
        fwd = jax.jit(lambda m: m(tokens, positions_from_mask(valid), attention=DenseAttention(valid))[0])
        runs[blocks] = (np.asarray(fwd(model)), fwd.lower(model).compile().cost_analysis()["flops"])
    np.testing.assert_allclose(runs[3][0][np.asarray(valid)], runs[1][0][np.asarray(valid)], rtol=1e-5, atol=1e-5)
    per_layer_scores = 4 * 2 * cfg.num_heads * cfg.head_dim * 192 * 192  # q k^T and p v, both rows
    assert runs[1][1] - runs[3][1] >= 0.9 * per_layer_scores / 3


def test_swiglu_backward_matches_autodiff():
    rng = np.random.default_rng(1)
    g, u, dh = (jnp.asarray(rng.normal(size=(4, 16)) * 3) for _ in range(3))
    with jax.enable_x64():
        g, u, dh = g.astype(jnp.float64), u.astype(jnp.float64), dh.astype(jnp.float64)
        np.testing.assert_allclose(swiglu(g, u), jax.nn.silu(g) * u, rtol=1e-14)
        got = jax.vjp(swiglu, g, u)[1](dh)
        want = jax.vjp(lambda g, u: jax.nn.silu(g) * u, g, u)[1](dh)
        for a, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_grouped_attention_in_bfloat16_is_as_close_as_jax_attention():
    """bf16 inputs, 8 query / 2 kv heads of 128: against float32 attention, the XLA path is within
    1.5x of `jax.nn.dot_product_attention`'s own bf16 error (a bound on its rounding, which casts
    the probabilities to bf16 for the second product as JAX's does)."""
    rng = np.random.default_rng(2)
    b, t, n, k, h = 2, 16, 8, 2, 128
    q, kk, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h)))
    mask = causal_padding_mask(jnp.ones((b, t), bool))
    exact = np.asarray(jax.nn.dot_product_attention(q, kk, v, mask=mask, implementation="xla"))
    bf = [x.astype(jnp.bfloat16) for x in (q, kk, v)]
    ours = np.asarray(grouped_attention(*bf, mask_bias(mask)), np.float32)
    ref = np.asarray(jax.nn.dot_product_attention(*bf, mask=mask, implementation="xla"), np.float32)
    assert np.abs(ours - exact).max() <= 1.5 * np.abs(ref - exact).max() + 1e-3
