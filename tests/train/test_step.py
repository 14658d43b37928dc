"""The jitted train step: micro-batching == full batch, layouts on 8 devices == one device,
the non-finite guard, bf16 compute, SFT and the PPO value head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.models import forward_logits, init_model, preset
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset
from tpurl.train.advantages import compute_advantages
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.correction import correction_preset
from tpurl.train.critic import init_value_head, make_value_fn
from tpurl.train.logprobs import forward_hidden, make_logprob_fn, token_logprobs
from tpurl.train.state import init_train_state, make_schedule
from tpurl.train.step import make_grad_fn, make_sft_step, make_train_step
from train_helpers import max_rel, rel

V, B, T = 64, 16, 12
# The standard train layout spelled out (FSDP x TP); the presets are exercised below too.
RULES = (("batch", ("data", "fsdp")), ("embed", ("fsdp",)), ("heads", ("tensor",)), ("kv_heads", ("tensor",)),
         ("mlp", ("tensor",)), ("vocab", ("tensor",)))
LAYOUT = Layout(name="train", rules=RULES)
# The full algorithm surface at once: clip-higher + dual clip, KL in the loss, entropy, TIS.
ALGO = algorithm_preset("grpo", eps_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01,
                        correction=correction_preset("tis"))
WHOLE_BATCH_METRICS = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2", "mismatch/ratio_max", "mismatch/ratio_min",
                       "mismatch/ratio_p99", "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "correction/weight_mean",
                       "correction/token_masked_frac", "correction/seq_masked_frac", "correction/truncated_frac")


@pytest.fixture(scope="module")
def model():
    return init_model(preset("tiny", vocab_size=V), seed=0)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    valid = np.ones((B, T), bool)
    valid[::3, :2] = False  # left-padded prompts
    prompt_len = 5
    lens = rng.integers(2, T - prompt_len + 1, B)  # ragged completions, right padding after them
    for b in range(B):
        valid[b, prompt_len + lens[b]:] = False
    loss_mask = valid & (np.arange(T)[None, :] >= prompt_len)
    old = -4.0 + 0.3 * rng.normal(size=(B, T))
    return {
        "tokens": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
        "valid": jnp.asarray(valid),
        "loss_mask": jnp.asarray(loss_mask, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
        "old_logprobs": jnp.asarray(old, jnp.float32),
        "ref_logprobs": jnp.asarray(old + 0.2 * rng.normal(size=(B, T)), jnp.float32),
        "rollout_logprobs": jnp.asarray(old + 0.2 * rng.normal(size=(B, T)), jnp.float32),
    }


OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1)
SFT_OPT = OptimizerConfig(lr=3e-3)


@pytest.fixture(scope="module")
def single_step(model):
    """One compiled single-device RL step shared by the tests below (compiles dominate test time)."""
    return make_train_step(nnx.graphdef(model), ALGO, OPT)


@pytest.fixture(scope="module")
def sft_step(model):
    return make_sft_step(nnx.graphdef(model), SFT_OPT, micro_batches=2)


@pytest.fixture(scope="module")
def single_grads(model, batch):
    graphdef, params = nnx.split(model)
    return make_grad_fn(graphdef, ALGO, micro_batches=1)(params, batch)


@pytest.mark.slow
def test_micro_batches_equal_full_batch(model, batch, single_grads):
    graphdef, params = nnx.split(model)
    g_full, m_full = single_grads
    g_mb, m_mb = make_grad_fn(graphdef, ALGO, micro_batches=4)(params, batch)
    assert max_rel(g_mb, g_full) <= 1e-6
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max",
                "ratio_min", "grad_norm", "tokens", *WHOLE_BATCH_METRICS):
        assert rel(m_mb[key], m_full[key]) <= 1e-6, key  # the p99 too: micro-batches' tokens put back in order
    assert float(m_full["clip_frac_low"]) > 0 and float(m_full["kl"]) != 0


@pytest.mark.slow
@pytest.mark.parametrize("name,shape", [("fsdp", (1, 8, 1)), ("fsdp_tp", (2, 2, 2)), ("dp", (8, 1, 1))],
                         ids=["fsdp_8", "fsdp_tp_2x2x2", "dp_8"])
def test_layout_gradients_equal_single_device(model, batch, single_grads, name, shape):
    """The project's train layouts on 8 fake devices (with 2 micro-batches) against one device."""
    layout = layout_preset(name)
    mesh = make_mesh(MeshConfig(shape=shape))
    graphdef, params = nnx.split(model)
    sharded = jax.device_put(params, layout.param_shardings(params, mesh))
    if name == "dp":  # replicas: whole weights everywhere, the batch split 8 ways
        assert sharded["embed_tokens"][...].sharding.is_fully_replicated
    else:
        assert sharded["embed_tokens"][...].sharding.spec[1] is not None  # really FSDP-sharded
    g, metrics = make_grad_fn(graphdef, ALGO, mesh=mesh, layout=layout, micro_batches=2)(sharded, batch)
    assert max_rel(g, single_grads[0]) <= 1e-5
    assert rel(metrics["loss"], single_grads[1]["loss"]) <= 1e-5


@pytest.mark.slow
def test_sharded_train_step_matches_single_device(model, batch, single_step):
    graphdef = nnx.graphdef(model)
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    st = init_train_state(model, OPT, mesh=mesh, layout=LAYOUT)
    count = jax.tree.leaves(st.opt_state)[0]
    assert count.ndim == 0 and count.sharding.is_fully_replicated
    step = make_train_step(graphdef, ALGO, OPT, mesh=mesh, layout=LAYOUT)
    st1, metrics = step(st, batch)
    st2, metrics2 = step(st1, batch)

    ref1, ref_metrics = single_step(init_train_state(model, OPT), batch)
    ref2, _ = single_step(ref1, batch)
    assert max_rel(st2.params, ref2.params) <= 1e-5
    q = st2.params["layers"]["q_proj"][...]
    assert q.sharding.spec == LAYOUT.spec(("layers", "embed", "heads", "head_dim"), mesh)
    assert float(metrics2["lr"]) == pytest.approx(OPT.lr)
    assert int(metrics2["step"]) == 2 and int(metrics2["skipped_steps"]) == 0
    assert rel(metrics["grad_norm"], ref_metrics["grad_norm"]) <= 1e-5
    assert st.params["embed_tokens"][...].is_deleted()  # the state was donated
    assert not model.embed_tokens[...].is_deleted()  # ... but not the model's own weights


# In the fast subset although it compiles a step of its own: the subset's only test of a compiled update.
def test_non_finite_gradients_skip_the_update(model, batch, single_step):
    st = init_train_state(model, OPT)
    before = jax.tree.map(np.asarray, (st.params, st.opt_state))
    bad = dict(batch, advantages=batch["advantages"].at[3].set(jnp.nan))
    st1, metrics = single_step(st, bad)
    assert int(metrics["skipped"]) == 1 and int(st1.skipped) == 1 and int(st1.step) == 1
    assert not np.isfinite(float(metrics["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, (st1.params, st1.opt_state), before)
    st2, metrics = single_step(st1, batch)
    assert int(metrics["skipped"]) == 0 and int(metrics["skipped_steps"]) == 1
    assert max_rel(st2.params, before[0]) > 0


def test_schedule_warmup_then_cosine():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=4, schedule="cosine", total_steps=10, min_lr_ratio=0.1)
    sched = make_schedule(cfg)
    for step in range(16):
        if step < 4:
            want = 1e-3 * step / 4
        else:
            k = min(step - 4, 10)
            want = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 10)))
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-12), step
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(schedule="cosine")


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_gradients(model, batch, single_grads):
    graphdef, params = nnx.split(model)
    g, metrics = make_grad_fn(graphdef, ALGO, compute_dtype="bfloat16")(params, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g))
    assert 0 < rel(metrics["loss"], single_grads[1]["loss"]) < 5e-2  # bf16 is used, and close
    assert max_rel(g, single_grads[0]) < 0.1
    # The scorer for old/reference logprobs takes the same switch (so ratios start near 1).
    lp16, _ = make_logprob_fn(graphdef, compute_dtype="bfloat16")(params, batch["tokens"], batch["valid"])
    lp32, _ = token_logprobs(model, batch["tokens"], batch["valid"])
    err = np.abs(np.asarray(lp16) - np.asarray(lp32))
    assert 0 < err.max() < 0.1


@pytest.mark.slow
def test_sft_step_cross_entropy_on_completion_tokens(model, batch, sft_step):
    st = init_train_state(model, SFT_OPT)
    logits = np.asarray(forward_logits(model, batch["tokens"], batch["valid"]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    tok, mask = np.asarray(batch["tokens"]), np.asarray(batch["loss_mask"]) > 0
    nll = [-logp[b, t - 1, tok[b, t]] for b, t in zip(*np.nonzero(mask))]
    losses = []
    for _ in range(5):
        st, metrics = sft_step(st, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], np.mean(nll), rtol=1e-5)
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.slow
def test_value_head_gradient_matches_closed_form(model, batch):
    """PPO: with a zero head every value is 0, so d(value_coef * 0.5 * sum_w (V - R)^2)/dw =
    -value_coef * sum_t w_t R_t h_{t-1}; checked against a float64 recompute from hidden states."""
    algo = algorithm_preset("ppo")
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(5)
    returns = rng.normal(size=(B, T)) * np.asarray(batch["loss_mask"])
    ppo_batch = {k: batch[k] for k in ("tokens", "valid", "loss_mask", "old_logprobs")}
    ppo_batch.update(advantages=jnp.asarray(returns, jnp.float32), returns=jnp.asarray(returns, jnp.float32),
                     old_values=jnp.zeros((B, T), jnp.float32))
    head = init_value_head(model.config.hidden_size)
    g, metrics = make_grad_fn(graphdef, algo)(params, ppo_batch, head)
    h = np.asarray(forward_hidden(model, batch["tokens"], batch["valid"]), np.float64)
    mask = np.asarray(batch["loss_mask"], np.float64)
    w = mask / mask.sum()  # token-mean
    coef = -algo.value_coef * w[:, 1:] * returns[:, 1:]
    np.testing.assert_allclose(np.asarray(g[1]["w"]), np.einsum("bt,btd->d", coef, h[:, :-1]), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(g[1]["b"]), coef.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["value_loss"]), 0.5 * (w * returns ** 2).sum(), rtol=1e-5)
    # The scorer for GAE's old values: value of the prefix before token t, read at t - 1.
    head = {"w": jnp.asarray(rng.normal(size=h.shape[-1]), jnp.float32), "b": jnp.asarray(0.3, jnp.float32)}
    values = np.asarray(make_value_fn(graphdef)(params, head, batch["tokens"], batch["valid"]))
    valid = np.asarray(batch["valid"])
    want = np.zeros((B, T))
    want[:, 1:] = np.where(valid[:, 1:] & valid[:, :-1], h[:, :-1] @ np.asarray(head["w"], np.float64) + 0.3, 0.0)
    np.testing.assert_allclose(values, want, rtol=1e-4, atol=1e-5)
    with_head, without = init_train_state(params, OPT, value_head=head), init_train_state(params, OPT)
    # Adam's two moments of w and b are the only extra optimizer leaves.
    assert len(jax.tree.leaves(with_head.opt_state)) == len(jax.tree.leaves(without.opt_state)) + 4
    np.testing.assert_array_equal(np.asarray(with_head.value_head["w"]), np.asarray(head["w"]))


PROMPT, TARGET = 4, 7


@pytest.fixture(scope="module")
def sampler(model):
    """Plain ancestral sampling with `jax.random.categorical` (full recompute per token; the
    engine lives elsewhere). Returns tokens and the sampler's logprobs of the sampled tokens."""
    graphdef = nnx.graphdef(model)

    @jax.jit
    def sample(params, prompts, key):
        m = nnx.merge(graphdef, params)
        tokens = jnp.zeros((B, T), jnp.int32).at[:, :PROMPT].set(prompts)
        valid = jnp.arange(T)[None, :] < PROMPT

        def body(t, carry):
            tokens, valid, lp = carry
            logits = forward_logits(m, tokens, valid)[:, t - 1]
            tok = jax.random.categorical(jax.random.fold_in(key, t), logits)
            lp = lp.at[:, t].set(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], axis=1)[:, 0])
            return tokens.at[:, t].set(tok), valid.at[:, t].set(True), lp

        return jax.lax.fori_loop(PROMPT, T, body, (tokens, jnp.broadcast_to(valid, (B, T)), jnp.zeros((B, T))))

    return sample


@pytest.mark.slow
def test_grpo_raises_reward_on_bandit(model, single_step, sampler):
    """Reward = fraction of completion tokens equal to TARGET; 4 prompts x 4 samples per step.
    Uses the real pipeline: rollout logprobs, reference logprobs (KL), group advantages, the step."""
    graphdef, params = nnx.split(model)
    group = 4
    ref_params = jax.tree.map(jnp.copy, params)  # the frozen initial policy
    ref_logprobs = make_logprob_fn(graphdef, temperature=ALGO.temperature)
    st = init_train_state(params, OPT)
    rng = np.random.default_rng(7)
    prompts = jnp.asarray(np.repeat(rng.integers(0, V, (B // group, PROMPT)), group, axis=0), jnp.int32)
    key = jax.random.key(0)
    rewards = []
    for i in range(40):
        tokens, valid, rollout_lp = sampler(st.params, prompts, jax.random.fold_in(key, i))
        loss_mask = (jnp.arange(T)[None, :] >= PROMPT) & valid
        reward = np.asarray(((tokens == TARGET) & loss_mask).sum(1) / loss_mask.sum(1))
        rewards.append(reward.mean())
        adv, _ = compute_advantages(reward.reshape(-1, group), ALGO.advantage_estimator)
        batch = {"tokens": tokens, "valid": valid, "loss_mask": loss_mask.astype(jnp.float32), "advantages": adv,
                 "old_logprobs": rollout_lp, "ref_logprobs": ref_logprobs(ref_params, tokens, valid)[0],
                 "rollout_logprobs": rollout_lp}
        st, metrics = single_step(st, batch)
        assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    # From ~1/V (chance) to several times that; observed 0.014 -> 0.22 with these seeds.
    assert last > first + 0.1 and last > 4 * first, rewards


@pytest.mark.slow
def test_on_policy_step_measures_the_old_policy_itself(model, batch):
    """Without `old_logprobs` the update's own forward pass is the old policy: the gradient and the
    rollout-mismatch metrics equal those of a batch that carries the old policy's logprobs."""
    graphdef, params = nnx.split(model)
    old, _ = make_logprob_fn(graphdef)(params, batch["tokens"], batch["valid"])
    with_old = dict(batch, old_logprobs=old)
    on_policy = {k: v for k, v in batch.items() if k != "old_logprobs"}
    assert not ALGO.needs_old_logprobs and ALGO.replace(minibatches=2).needs_old_logprobs
    fn = make_grad_fn(graphdef, ALGO)
    g_old, m_old = fn(params, with_old)
    g_on, m_on = fn(params, on_policy)
    assert max_rel(g_on, g_old) < 1e-5
    mask = np.asarray(batch["loss_mask"]) > 0
    diff = np.abs(np.asarray(old, np.float64) - np.asarray(batch["rollout_logprobs"], np.float64))[mask]
    for m in (m_old, m_on):
        np.testing.assert_allclose(float(m["mismatch/abs_diff_mean"]), diff.mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m["mismatch/abs_diff_max"]), diff.max(), rtol=1e-5)
        np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, rtol=1e-5)
    for key in WHOLE_BATCH_METRICS:
        np.testing.assert_allclose(float(m_on[key]), float(m_old[key]), rtol=1e-5, atol=1e-7)
