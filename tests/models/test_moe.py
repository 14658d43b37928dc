"""Mixture-of-experts layers (tpurl.models.moe, Qwen3-MoE): the dropless grouped computation against
every expert on every token, masked (values and gradients, tokens routed unevenly); Hugging Face
parity with `transformers`' Qwen3MoeForCausalLM (logits and greedy tokens, a checkpoint with dense
layers between sparse ones), a bit-exact export round trip; the paged engine's decode against a
full recompute; bad configs in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.models import forward_logits, init_model, preset
from tpurl.models.hf import load_hf_checkpoint, load_hf_config, save_hf_checkpoint
from tpurl.models.moe import MoeConfig, dense_experts, grouped_experts, layer_kinds, route, segments
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS, layout_preset
from tpurl.train.parity import grad_parity, lm_loss, single_device_run

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

ATOL = 1e-4
MOE = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,))
CFG = preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
             num_kv_heads=2, head_dim=8).replace(model_type="qwen3_moe", qk_norm=True, moe=MOE)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.slow
def test_grouped_experts_equal_every_expert_masked_values_and_gradients():
    """13 tokens, 4 experts, top-2, expert 3 chosen by no token and expert 0 by most."""
    rng = np.random.default_rng(0)
    t, d, e, f, k = 13, 8, 4, 6, 2
    h = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    # A router over experts 0-2 only (expert 3 gets no token), skewed towards expert 0.
    w_router = jnp.asarray(rng.normal(size=(d, e - 1)) + np.array([0.8, 0.0, -0.4]), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), jnp.float32)
    weights, experts, _ = route(h, w_router, k, True)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=e)
    assert counts[3] == 0 and counts.max() > t * k // e  # uneven: one expert gets none
    got = grouped_experts(h, weights, experts, w_gate, w_up, w_down)
    want = dense_experts(h, weights, experts, w_gate, w_up, w_down)
    assert _rel(got, want) <= 1e-5 and np.abs(np.asarray(want)).max() > 0.1

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(a[0], a[1], experts, *a[2:])))
    args = (h, weights, w_gate, w_up, w_down)
    g_got = jax.grad(loss(grouped_experts), argnums=range(5))(*args)
    g_want = jax.grad(loss(dense_experts), argnums=range(5))(*args)
    for a, b in zip(g_got, g_want):
        assert _rel(a, b) <= 1e-5
    assert np.abs(np.asarray(g_got[2][3])).max() == 0  # the unused expert gets no gradient


def test_routing_is_softmax_then_top_k_renormalized_against_numpy():
    rng = np.random.default_rng(1)
    h, w = rng.normal(size=(5, 8)), rng.normal(size=(8, 6))
    for norm in (True, False):
        weights, experts, _ = route(jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), 3, norm)
        logits = h @ w
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[:, :3]
        want = np.take_along_axis(probs, top, -1)
        if norm:
            want = want / want.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(experts), top)
        np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)


def test_which_layers_are_sparse_and_their_scan_segments():
    assert layer_kinds(3, MOE) == ("moe", "dense", "moe")
    assert layer_kinds(4, MoeConfig(num_experts=2, experts_per_token=1, intermediate_size=4, sparse_step=2)) == (
        "dense", "moe", "dense", "moe")
    assert segments(("moe", "dense", "moe")) == [("moe", 0, 1, 0), ("dense", 1, 2, 0), ("moe", 2, 3, 1)]
    assert segments(("dense",) * 3) == [("dense", 0, 3, 0)]


def hf_moe_model(mlp_only_layers=(1,), norm_topk=True, seed=0):
    """A random `transformers` Qwen3-MoE of CFG's shapes, every weight non-trivial."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers), norm_topk_prob=norm_topk, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return model.eval()


@pytest.fixture(scope="module", params=[(1,), ()], ids=["dense-between", "all-sparse"])
def checkpoint(request, tmp_path_factory):
    model = hf_moe_model(request.param)
    path = str(tmp_path_factory.mktemp("moe") / "hf")
    model.save_pretrained(path, safe_serialization=True)
    return model, path, request.param


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers_and_export_round_trips(checkpoint, tmp_path):
    hf, path, dense_layers = checkpoint
    cfg = load_hf_config(path)
    assert cfg.model_type == "qwen3_moe" and cfg.moe.dense_layers == dense_layers
    assert cfg.layer_kinds == tuple("dense" if i in dense_layers else "moe" for i in range(3))
    model = load_hf_checkpoint(path)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 64, (3, 9)).astype(np.int32)
    valid = np.ones(tokens.shape, bool)
    valid[1, :3] = False
    positions = np.maximum(np.cumsum(valid, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(valid).long(),
                 position_ids=torch.from_numpy(positions).long()).logits.numpy()
    ours = np.asarray(forward_logits(model, tokens, valid))
    assert np.abs(ours[valid] - ref[valid]).max() <= ATOL and np.abs(ref[valid]).max() > 0.5
    # Greedy tokens: the paged engine against transformers' generate.
    prompt = tokens[0, :5].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                           pad_token_id=0)[0, 5:].tolist()
    engine = Engine(cfg, EngineConfig(max_slots=2, max_seq_len=16, page_size=4, prefill_buckets=(8,)))
    from flax import nnx
    got = generate(engine, nnx.state(model, nnx.Param), [prompt], n_samples=1,
                   sampling=SamplingConfig(temperature=0.0, max_new_tokens=8), seed=0)[0][0].token_ids.tolist()
    assert got == want
    # Export: transformers loads it back bit for bit.
    out = str(tmp_path / "export")
    save_hf_checkpoint(model, out, max_shard_bytes=16 * 1024)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    want_sd, got_sd = hf.state_dict(), back.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name in want_sd:
        assert torch.equal(got_sd[name], want_sd[name]), name


@pytest.mark.slow
def test_the_paged_engine_decodes_as_a_full_recompute():
    """Sampled tokens of the paged engine (prefill, then one-token decode steps through the experts):
    each token's logprob equals a full forward over the sequence so far."""
    from flax import nnx

    model = init_model(CFG, seed=3)
    params = nnx.state(model, nnx.Param)
    engine = Engine(CFG, EngineConfig(max_slots=4, max_seq_len=24, page_size=4, prefill_buckets=(8,)))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 8, 5)]
    out = generate(engine, params, prompts, n_samples=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10),
                   seed=1)
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq = jnp.asarray([prompt + c.token_ids.tolist()], jnp.int32)
            logp = jax.nn.log_softmax(forward_logits(model, seq)[0], axis=-1)
            n = len(prompt)
            want = np.asarray(logp)[np.arange(n - 1, n - 1 + len(c.token_ids)), c.token_ids]
            np.testing.assert_allclose(c.logprobs, want, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(moe=None), "model_type='qwen3_moe' with moe=None"),
    (dict(model_type="qwen3"), "model_type='qwen3' with moe=set"),
    (dict(moe=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=8, dense_layers=(7,))),
     r"dense_layers=\(7,\) names a layer beyond the model's num_layers=3"),
])
def test_bad_moe_configs_are_one_line(change, match):
    with pytest.raises(ValueError, match=match) as err:
        CFG.replace(**change)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=4, experts_per_token=5, intermediate_size=8), r"experts_per_token=5 must be in \[1, num_experts=4\]"),
    (dict(num_experts=0, experts_per_token=1, intermediate_size=8), "need num_experts >= 1"),
    (dict(num_experts=4, experts_per_token=1, intermediate_size=8, sparse_step=0), "sparse_step=0 must be >= 1"),
])
def test_bad_moe_fields_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoeConfig(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name,mesh_shape",
                         [(name, (2, 2, 2)) for name in LAYOUT_PRESETS] + [("tp", (1, 1, 8))])
def test_gradients_under_every_layout_equal_one_device(layout_name, mesh_shape):
    """Loss, logits and every gradient of a model with dense and sparse layers under each layout
    preset (experts sharded over the FSDP axes in training, expert-parallel over the tensor axes in
    rollout layouts; on (1, 1, 8) the 4 experts do not divide over 8 tensor devices and fall back to
    replication), against a single device."""
    from flax import nnx

    cfg = CFG.replace(num_heads=8, head_dim=8, num_kv_heads=2)
    graphdef, params = nnx.split(init_model(cfg, seed=1))
    rng = np.random.default_rng(0)
    valid = np.ones((8, 8), bool)
    valid[1, :3] = False
    batch = {"tokens": jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32), "valid": jnp.asarray(valid)}
    loss_fn = lm_loss(graphdef)
    reference = single_device_run(loss_fn, params, batch)
    layout, mesh = layout_preset(layout_name), make_mesh(MeshConfig(shape=mesh_shape))
    expert_spec = layout.param_shardings(params, mesh)["layers"]["experts_gate"].spec
    assert bool(expert_spec[1]) == (layout_name != "dp" and mesh_shape == (2, 2, 2))  # experts sharded, or not
    report = grad_parity(loss_fn, params, batch, layout=layout, mesh=mesh, reference=reference)
    assert report.ok(1e-5), report.summary()
    assert all(np.abs(reference.grads[k]).max() > 0 for k in reference.grads if "experts" in k)
