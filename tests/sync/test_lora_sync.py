"""The rollout weights of a LoRA run (tpurl.sync.lora): merged (W + scale * A @ B computed inside
the resharding programs) and unmerged (the adapters beside a base synced once), by every method,
whole and in sliced buckets, on one mesh and across two disjoint pools; both exact against the
dense forward of the merged weights (fp32, 1e-5). The merged sync moves the targeted projections,
the unmerged one the adapters only, and neither moves the base's other weights again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tpurl.models import abstract_model, forward_logits, init_model, preset
from tpurl.models.lora import LoraConfig, adapter_names, adapter_state, base_state, merged_weight
from tpurl.sync.lora import LoraRollout, resolve_adapters
from tpurl.sync.config import SyncConfig

from sync_helpers import LAYOUTS, no_host_round_trip

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"), base_dtype="float32")
BASE = preset("tiny", vocab_size=64, num_heads=8, num_kv_heads=4, head_dim=8)
CFG = BASE.replace(lora=LORA)


@pytest.fixture(scope="module")
def trained():
    """A LoRA model with trained-looking adapters (B nonzero): its adapters, its base, and the
    logits of the dense model with merged weights on fixed tokens."""
    model = init_model(CFG, seed=0)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapter_state(model))
    base = base_state(model)
    merged = dict(nnx.to_flat_state(base))
    for target in LORA.targets:
        a, b = adapter_names(target)
        path = ("layers", target)
        merged[path] = merged[path].replace(merged_weight(merged[path][...], adapters["layers"][a][...],
                                                          adapters["layers"][b][...], LORA.scale, target))
    graphdef = nnx.graphdef(init_model(BASE, seed=0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
    want = forward_logits(nnx.merge(graphdef, nnx.from_flat_state(list(merged.items()))), tokens)
    return adapters, base, tokens, np.asarray(want)


def _rollout(form, mesh, layout, cfg):
    model_cfg = CFG if form == "unmerged" else BASE
    graphdef, abstract = nnx.split(abstract_model(model_cfg))
    return graphdef, LoraRollout(LORA, form, LAYOUTS[layout].param_shardings(abstract, mesh), cfg)


def _bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


@pytest.mark.parametrize("form", ["merged", "unmerged"])
@pytest.mark.parametrize("method,bucket", [("jit", 1 << 30), ("device_put", 1 << 30), ("jit", 4096),
                                           ("device_put", 4096)])
def test_rollout_weights_equal_the_merged_dense_model(trained, mesh, form, method, bucket):
    adapters, base, tokens, want = trained
    src = LAYOUTS["fsdp_tp"]
    train_adapters = jax.device_put(adapters, src.param_shardings(adapters, mesh))
    train_base = jax.device_put(base, src.param_shardings(base, mesh))
    graphdef, lr = _rollout(form, mesh, "tp", SyncConfig(method=method, bucket_bytes=bucket))
    first = lr.set_base(train_base)
    with no_host_round_trip():
        params, report, made = lr.sync(train_adapters)
    np.testing.assert_allclose(np.asarray(forward_logits(nnx.merge(graphdef, params), tokens)), want, atol=1e-5)
    targeted = sum(_bytes(base["layers"][t]) for t in LORA.targets)
    n_base = len(jax.tree.leaves(base))
    if form == "unmerged":  # the adapters each sync; the whole base once (norms pass through: same layout)
        assert report.bytes_moved == _bytes(adapters)
        assert first.leaves_resharded + first.leaves_unchanged == n_base
    else:  # the targeted projections each sync, merged; the rest of the base once
        assert report.bytes_moved == targeted
        assert first.leaves_resharded + first.leaves_unchanged == n_base - len(LORA.targets)

    assert len(made) == report.leaves_resharded
    if bucket == 4096 and form == "merged":  # each merged projection is computed and moved layer by layer
        assert report.buckets == CFG.num_layers * len(LORA.targets)
        # A bucket counts what its program holds: one layer's merged weight and its float32 merge.
        layer = max(base["layers"][t][...].nbytes // CFG.num_layers for t in LORA.targets)
        assert report.max_bucket_bytes == layer + 4 * layer // 4
    # The next sync leaves the static part alone: the same arrays.
    params2, _, _ = lr.sync(train_adapters)
    static = lambda p: {id(x) for x in jax.tree.leaves(p)} - {id(x) for x in made}  # noqa: E731
    assert static(params) <= {id(x) for x in jax.tree.leaves(params2)}


@pytest.mark.parametrize("form", ["merged", "unmerged"])
def test_across_disjoint_pools(trained, devices, form):
    """Disaggregated placement: train layout on devices 0-3, rollout layout on 4-7."""
    adapters, base, tokens, want = trained
    train_mesh = Mesh(np.asarray(devices[:4]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    rollout_mesh = Mesh(np.asarray(devices[4:]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    src = LAYOUTS["fsdp"]
    graphdef, lr = _rollout(form, rollout_mesh, "tp_replicas", SyncConfig(rollout_dtype="float32"))
    lr.set_base(jax.device_put(base, src.param_shardings(base, train_mesh)))
    params, report, _ = lr.sync(jax.device_put(adapters, src.param_shardings(adapters, train_mesh)))
    assert {d for x in jax.tree.leaves(params) for d in x.devices()} <= set(devices[4:])
    assert report.method == "device_put"
    np.testing.assert_allclose(np.asarray(forward_logits(nnx.merge(graphdef, params), tokens)), want, atol=1e-5)


def test_bf16_rollout_of_merged_weights_rounds_once(trained, mesh):
    """The merge runs in float32 and the result is rounded to bf16 once (not W rounded, then the
    delta added in bf16)."""
    adapters, base, _, _ = trained
    src = LAYOUTS["dp"]
    graphdef, lr = _rollout("merged", mesh, "dp", SyncConfig(rollout_dtype="bfloat16"))
    lr.set_base(jax.device_put(base, src.param_shardings(base, mesh)))
    params, _, _ = lr.sync(jax.device_put(adapters, src.param_shardings(adapters, mesh)))
    w = merged_weight(base["layers"]["q_proj"][...], adapters["layers"]["q_proj_lora_a"][...],
                      adapters["layers"]["q_proj_lora_b"][...], LORA.scale, "q_proj")
    got = params["layers"]["q_proj"][...]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w.astype(jnp.bfloat16)))


def test_sync_before_the_base_is_one_line(trained, mesh):
    adapters, *_ = trained
    _, lr = _rollout("unmerged", mesh, "tp", SyncConfig())
    with pytest.raises(RuntimeError, match="before set_base"):
        lr.sync(adapters)


def test_auto_merges_on_shared_devices_and_moves_adapters_across():
    assert resolve_adapters("auto", colocated=True) == "merged"
    assert resolve_adapters("auto", colocated=False) == "unmerged"
    assert resolve_adapters("unmerged", colocated=True) == "unmerged"


@pytest.mark.slow
@pytest.mark.parametrize("form", ["merged", "unmerged"])
def test_the_engines_logprobs_equal_the_merged_dense_forward(trained, mesh, form):
    """Sampled on the paged engine with each form's rollout weights (tensor-parallel rollout layout),
    every sampled token's logprob equals the dense forward of the merged weights (fp32, 1e-5)."""
    from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate

    adapters, base, _, _ = trained
    src = LAYOUTS["fsdp_tp"]
    model_cfg = CFG if form == "unmerged" else BASE
    graphdef, lr = _rollout(form, mesh, "tp", SyncConfig())
    lr.set_base(jax.device_put(base, src.param_shardings(base, mesh)))
    params, _, _ = lr.sync(jax.device_put(adapters, src.param_shardings(adapters, mesh)))
    engine = Engine(model_cfg, EngineConfig(max_slots=4, max_seq_len=32, page_size=4, prefill_buckets=(8,)),
                    mesh=mesh, layout=LAYOUTS["tp"], graphdef=graphdef)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 6, 8)]
    out = generate(engine, params, prompts, n_samples=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10),
                   seed=0)
    merged = dict(nnx.to_flat_state(base))
    for target in LORA.targets:
        a, b = adapter_names(target)
        merged[("layers", target)] = merged[("layers", target)].replace(merged_weight(
            merged[("layers", target)][...], adapters["layers"][a][...], adapters["layers"][b][...], LORA.scale,
            target))
    dense = nnx.merge(nnx.graphdef(init_model(BASE, seed=0)), nnx.from_flat_state(list(merged.items())))
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq = jnp.asarray([prompt + c.token_ids.tolist()], jnp.int32)
            logp = jax.nn.log_softmax(forward_logits(dense, seq)[0].astype(jnp.float32), axis=-1)
            n = len(prompt)
            want = np.asarray(logp)[np.arange(n - 1, n - 1 + len(c.token_ids)), c.token_ids]
            np.testing.assert_allclose(c.logprobs, want, atol=1e-5)
