"""Float8 weights (tpurl.models.quant): the quantized values and scales equal a float64 numpy
reference rounded by ml_dtypes, the error of every weight is within e4m3's per-channel bound (and a
per-tensor scale breaks it), and a quantized model computes exactly what the plain model computes
with the dequantized weights."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tpurl.models import forward_logits, init_model, preset
from tpurl.models import quant


def _weights(shape, seed=0):
    """Weights with channels of very different magnitudes and a few tiny entries (e4m3 subnormals)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * np.exp(rng.uniform(-6, 2, size=shape[-1]))
    w[..., 0] = 0.0  # a channel of zeros
    w.flat[::7] *= 1e-4
    return w.astype(np.float32)


def _reference(w: np.ndarray, in_axes: tuple[int, ...]):
    """float64 numpy: scale = max|W| / 448 per output channel, values rounded to e4m3 by ml_dtypes."""
    amax = np.max(np.abs(w.astype(np.float64)), axis=in_axes, keepdims=True)
    s = np.where(amax > 0, amax / 448.0, 1.0)
    q = (w.astype(np.float64) / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def _within_bound(w, deq, s) -> bool:
    return bool(np.all(np.abs(w.astype(np.float64) - deq) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s)))


# Each weight's input axes in its stacked shape, written out (not read from tpurl.models.quant).
@pytest.mark.parametrize("name,shape,in_axes", [("q_proj", (2, 16, 4, 8), (1,)), ("o_proj", (2, 4, 8, 16), (1, 2)),
                                                ("down_proj", (2, 32, 16), (1,)), ("experts_up", (2, 3, 16, 24), (2,)),
                                                ("experts_down", (2, 3, 24, 16), (2,))])
def test_values_and_scales_equal_the_numpy_reference(name, shape, in_axes):
    w = _weights(shape)
    q, s = quant.quantize(jnp.asarray(w), name)
    q_ref, s_ref = _reference(w, in_axes)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert s.shape == quant.drop_inputs(shape, name)
    np.testing.assert_allclose(np.asarray(s), np.squeeze(s_ref, in_axes), rtol=1e-6)
    # The values may differ from the reference only where f32 division rounds across a tie: none here.
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), q_ref.astype(np.float32))
    deq = np.asarray(quant.dequantize(q, s, name, jnp.float32)).astype(np.float64)
    assert _within_bound(w, deq, s_ref)
    assert np.all(deq[..., 0] == 0)


def test_a_per_tensor_scale_breaks_the_per_channel_bound():
    """The bound holds because each channel has its own scale: one scale for the whole tensor sends
    the small channels into e4m3's subnormals, past the bound (the check catches it)."""
    w = _weights((1, 32, 16))
    q, s_ch = _reference(w, (1,))  # the bound is in each channel's own scale
    assert _within_bound(w, q.astype(np.float64) * s_ch, s_ch)
    s = np.full((1, 1, 16), np.max(np.abs(w)) / 448.0)
    deq = (w / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
    assert not _within_bound(w, deq, s_ch)


@pytest.mark.parametrize("preset_name", ["tiny", "tiny-moe"])
@pytest.mark.slow
def test_a_quantized_model_computes_with_its_dequantized_weights(preset_name):
    cfg = preset(preset_name)
    qmodel = init_model(cfg.replace(quantization="fp8"), seed=0)
    plain = init_model(cfg, seed=0)
    layers = vars(qmodel.layers)
    for name in quant.INPUT_AXES:
        if name in layers:
            q, s = layers[name][...], layers[quant.scale_name(name)][...]
            assert q.dtype == jnp.float8_e4m3fn
            getattr(plain.layers, name).value = quant.dequantize(q, s, name, jnp.float32)
    for name in ("embed_tokens", "norm", "lm_head"):  # the rest is the plain model's, unquantized
        if hasattr(plain, name):
            np.testing.assert_array_equal(np.asarray(getattr(qmodel, name)[...]), np.asarray(getattr(plain, name)[...]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    np.testing.assert_allclose(np.asarray(forward_logits(qmodel, tokens)), np.asarray(forward_logits(plain, tokens)),
                               atol=1e-6)
    # and the quantized weights are close to the model's own fp32 ones, not equal
    fresh = forward_logits(init_model(cfg, seed=0), tokens)
    diff = float(jnp.max(jnp.abs(forward_logits(qmodel, tokens) - fresh)))
    assert 0 < diff < 0.1


def test_quantized_params_carry_logical_axes_for_the_layouts():
    cfg = preset("tiny").replace(quantization="fp8")
    state = nnx.state(init_model(cfg, 0), nnx.Param)
    assert state["layers"]["q_proj_scale"].logical_axes == ("layers", "heads", "head_dim")
    assert state["layers"]["o_proj_scale"].logical_axes == ("layers", "embed")
    assert state["layers"]["down_proj_scale"].logical_axes == ("layers", "embed")


def test_an_unknown_format_is_one_line():
    with pytest.raises(ValueError, match=r"ModelConfig.quantization='int4' is unknown; use one of \('fp8',\)"):
        preset("tiny", quantization="int4")
    from tpurl.sync.config import SyncConfig
    with pytest.raises(ValueError, match="SyncConfig.quantize='fp4' is unknown"):
        SyncConfig(quantize="fp4")
