"""LoRA adapters on the transformer (tpurl.models.lora): a new adapter leaves the model unchanged
bit for bit, the adapted forward equals the dense forward of the merged weights, adapter gradients
under every layout equal a one-device run, an update changes only the adapters, the base with the
adapters off is the base model, dropout only in training forwards, and bad configs are one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.models import forward_logits, init_model, preset
from tpurl.models.lora import (PROJECTIONS, LoraConfig, adapter_names, adapter_state, base_state, merged_weight)
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS, layout_preset
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.parity import grad_parity, lm_loss, single_device_run
from tpurl.train.state import init_train_state
from tpurl.train.step import make_sft_step, make_train_step

V = 64
BASE = preset("tiny", vocab_size=V, num_heads=8, num_kv_heads=2, head_dim=8)
LORA = LoraConfig(rank=4, alpha=8.0, base_dtype="float32")
CFG = BASE.replace(lora=LORA)


def with_random_b(model, seed=1, std=0.05):
    """The model with every adapter's B drawn random (a trained adapter; new ones are zero)."""
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + std * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    return nnx.merge(graphdef, adapters, base)


def merged_base(model):
    """A base model (no adapters) whose targeted weights are `W + scale * A @ B` of `model`'s."""
    base = init_model(BASE, seed=0)
    graphdef, state = nnx.split(base)
    state = jax.tree.map(lambda x: x, base_state(model))  # the same base weights
    merged = nnx.merge(graphdef, state)
    for target in LORA.targets:
        a, b = adapter_names(target)
        w = getattr(model.layers, target)[...]
        getattr(merged.layers, target)[...] = merged_weight(w, getattr(model.layers, a)[...],
                                                            getattr(model.layers, b)[...], LORA.scale, target)
    return merged


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, V, (4, 12)), jnp.int32)


def test_new_adapters_leave_the_model_unchanged_bit_for_bit(tokens):
    base = init_model(BASE, seed=0)
    adapted = init_model(CFG, seed=0)
    assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(adapter_state(adapted))
               if x.shape[-1] == LORA.rank)  # A is random; B is zero
    np.testing.assert_array_equal(np.asarray(forward_logits(adapted, tokens)), np.asarray(forward_logits(base, tokens)))


def test_adapted_forward_equals_the_merged_dense_forward(tokens):
    adapted = with_random_b(init_model(CFG, seed=0))
    got = np.asarray(forward_logits(adapted, tokens))
    want = np.asarray(forward_logits(merged_base(adapted), tokens))
    base = np.asarray(forward_logits(init_model(BASE, seed=0), tokens))
    assert np.abs(got - base).max() > 0.05  # the adapters change the logits ...
    np.testing.assert_allclose(got, want, atol=1e-5)  # ... exactly as the merged weights do


def test_merged_weight_against_float64_numpy():
    rng = np.random.default_rng(2)
    w, a, b = rng.normal(size=(3, 8, 2, 4)), rng.normal(size=(3, 8, 5)), rng.normal(size=(3, 5, 2, 4))
    got = merged_weight(jnp.asarray(w, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 0.5,
                        "q_proj")
    want = w + 0.5 * np.einsum("lir,lrnh->linh", a, b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    w_o, a_o, b_o = rng.normal(size=(2, 4, 8)), rng.normal(size=(2, 4, 5)), rng.normal(size=(5, 8))
    got = merged_weight(*(jnp.asarray(x, jnp.float32) for x in (w_o, a_o, b_o)), 2.0, "o_proj")  # one layer
    np.testing.assert_allclose(np.asarray(got), w_o + 2.0 * np.einsum("nhr,rd->nhd", a_o, b_o), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(LAYOUT_PRESETS))
def test_adapter_gradients_under_every_layout_equal_one_device(layout_name):
    """Loss, logits and every gradient (the adapters' included) of an adapted model under each
    layout preset on the 2x2x2 mesh, against a single-device run."""
    graphdef, params = nnx.split(with_random_b(init_model(CFG, seed=1)))
    rng = np.random.default_rng(0)
    valid = np.ones((8, 8), bool)
    valid[1, :3] = False
    batch = {"tokens": jnp.asarray(rng.integers(0, V, (8, 8)), jnp.int32), "valid": jnp.asarray(valid)}
    loss_fn = lm_loss(graphdef)
    reference = single_device_run(loss_fn, params, batch)
    adapter_grads = [k for k in reference.grads if "_lora_" in k]
    assert len(adapter_grads) == 2 * len(LORA.targets)
    assert all(np.abs(reference.grads[k]).max() > 0 for k in adapter_grads)
    report = grad_parity(loss_fn, params, batch, layout=layout_preset(layout_name),
                         mesh=make_mesh(MeshConfig(shape=(2, 2, 2))), reference=reference)
    assert report.ok(1e-5), report.summary()


def _sft_batch(rng, b=8, t=10):
    valid = np.ones((b, t), bool)
    return {"tokens": rng.integers(0, V, (b, t)).astype(np.int32), "valid": valid,
            "loss_mask": valid & (np.arange(t)[None, :] >= 3)}


@pytest.mark.slow
def test_an_update_changes_the_adapters_only_and_keeps_no_base_optimizer_state():
    model = with_random_b(init_model(CFG.replace(lora=LoraConfig(rank=4, base_dtype="bfloat16")), seed=0))
    opt = OptimizerConfig(lr=1e-2)
    state = init_train_state(model, opt)
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert all("lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0])
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    n_moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert n_moments == 2 * n_adapter  # AdamW's two moments, of the adapters alone
    frozen_before = [np.asarray(x) for x in jax.tree.leaves(state.frozen)]
    params_before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    step = make_sft_step(nnx.graphdef(model), opt)
    state, metrics = step(state, _sft_batch(np.random.default_rng(0)))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    for before, after in zip(frozen_before, jax.tree.leaves(state.frozen)):
        np.testing.assert_array_equal(np.asarray(after), before)  # the base: bit for bit
    changed = [np.abs(np.asarray(after) - before).max() > 0 for before, after in zip(params_before,
                                                                                      jax.tree.leaves(state.params))]
    assert all(changed)


def test_the_base_with_adapters_off_is_the_base_model(tokens):
    """The reference policy of a LoRA run: the base graph on the frozen base state gives the base
    model's logprobs (no second copy of the weights)."""
    adapted = with_random_b(init_model(CFG, seed=0))
    base = init_model(BASE, seed=0)
    valid = np.ones(tokens.shape, bool)
    off = make_logprob_fn(nnx.graphdef(base))(base_state(adapted), tokens, valid)[0]
    want = make_logprob_fn(nnx.graphdef(base))(nnx.state(base, nnx.Param), tokens, valid)[0]
    np.testing.assert_array_equal(np.asarray(off), np.asarray(want))
    on = make_logprob_fn(nnx.graphdef(adapted))(nnx.state(adapted, nnx.Param), tokens, valid)[0]
    assert np.abs(np.asarray(on) - np.asarray(want)).max() > 1e-3


@pytest.mark.slow
def test_dropout_only_in_training_forwards_and_fresh_each_step():
    """With dropout, two steps from the same state on the same batch differ only through their
    masks (drawn from the step), the scoring forward is the dropout-free one, and rate 0 is the
    plain update."""
    opt = OptimizerConfig(lr=1e-2, optimizer="sgd")
    batch = _sft_batch(np.random.default_rng(1))
    grads, scored = {}, {}
    for rate in (0.0, 0.5):
        model = with_random_b(init_model(CFG.replace(lora=LoraConfig(rank=4, base_dtype="float32", dropout=rate)), 0))
        step = make_sft_step(nnx.graphdef(model), opt)
        before = [np.asarray(x) for x in jax.tree.leaves(adapter_state(model))]
        s1, _ = step(init_train_state(model, opt), batch)  # the state is donated: a fresh one each
        s0 = init_train_state(model, opt)
        s1b, _ = step(s0.replace(step=s0.step + 1), batch)  # another step's masks
        grads[rate] = [np.asarray(a) - b for a, b in zip(jax.tree.leaves(s1.params), before)]
        other = [np.asarray(a) - b for a, b in zip(jax.tree.leaves(s1b.params), before)]
        same = all(np.allclose(g, o, atol=1e-7) for g, o in zip(grads[rate], other))
        assert same == (rate == 0.0)
        scored[rate] = make_logprob_fn(nnx.graphdef(model))(nnx.state(model, nnx.Param), batch["tokens"],
                                                             batch["valid"])[0]
    np.testing.assert_array_equal(np.asarray(scored[0.5]), np.asarray(scored[0.0]))  # scoring drops nothing
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(grads[0.0], grads[0.5]))


@pytest.mark.parametrize("kwargs,match", [
    ({"targets": ("q_proj", "qkv")}, r"unknown \['qkv'\].*projections are \['q_proj'"),
    ({"targets": ()}, "empty"),
    ({"rank": 0}, "rank=0 must be >= 1"),
    ({"alpha": 0.0}, "alpha=0.0 must be > 0"),
    ({"alpha": -1.0}, "alpha=-1.0 must be > 0"),
    ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
    ({"base_dtype": "int8"}, "must be a floating dtype"),
])
def test_bad_lora_configs_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        LoraConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_a_rank_above_a_projections_width_is_one_line():
    with pytest.raises(ValueError, match=r"rank=65 exceeds q_proj's width \(64 in, 64 out\); use a rank of at most 64"):
        init_model(BASE.replace(lora=LoraConfig(rank=65)))  # checked once the architecture is known
    assert set(PROJECTIONS) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.slow
def test_rl_step_of_a_lora_model_against_the_merged_full_model():
    """The RL update's loss and metrics of an adapted model equal those of the dense model with the
    merged weights (the same policy), and its adapter gradients are nonzero."""
    adapted = with_random_b(init_model(CFG, seed=0))
    merged = merged_base(adapted)
    rng = np.random.default_rng(3)
    batch = _sft_batch(rng)
    batch["advantages"] = rng.normal(size=8).astype(np.float32)
    algo = algorithm_preset("grpo", group_size=4, kl_coef=0.0)
    opt = OptimizerConfig(lr=1e-3)
    _, m_lora = make_train_step(nnx.graphdef(adapted), algo, opt)(init_train_state(adapted, opt), batch)
    _, m_full = make_train_step(nnx.graphdef(merged), algo, opt)(init_train_state(merged, opt), batch)
    for key in ("loss", "entropy"):
        np.testing.assert_allclose(float(m_lora[key]), float(m_full[key]), rtol=1e-5, err_msg=key)
    assert float(m_lora["grad_norm"]) > 0
