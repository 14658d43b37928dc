"""fp8 rollout weights made by the sync (SyncConfig.quantize="fp8", tpurl.sync.quantize): by every
method, whole and in sliced buckets, on one mesh and across disjoint pools, the rollout's values and
scales equal the one-device quantization of the train weights bit for bit, in the rollout layout,
without a host round trip; a LoRA run's merged weights are quantized after the merge; and the
engine's logprobs on them equal a dense forward of the dequantized model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tpurl.models import abstract_model, init_model
from tpurl.models import quant
from tpurl.models.lora import LoraConfig, adapter_names, adapter_state, base_state, merged_weight
from tpurl.sync.config import SyncConfig
from tpurl.sync.lora import LoraRollout
from tpurl.sync.reshard import sync_weights

from helpers import dense_logprobs
from sync_helpers import LAYOUTS, no_host_round_trip, place


def _shardings(model_cfg, layout, mesh):
    return LAYOUTS[layout].param_shardings(nnx.split(abstract_model(model_cfg.replace(quantization="fp8")))[1], mesh)


def _assert_quantized(train, rollout, shardings, dtype=jnp.bfloat16, exact=True):
    """Each quantized weight's values and scales equal `quant.quantize` of the (unsharded) train
    weight, every other leaf its cast to `dtype`; every leaf in its target sharding. Not `exact`
    (weights computed in a sharded program, whose float32 sums may round apart from one device's):
    scales within 1e-6 and the dequantized weight within e4m3's bound of the train weight."""
    flat_t, flat_r = dict(nnx.to_flat_state(train)), dict(nnx.to_flat_state(rollout))
    flat_s = dict(nnx.to_flat_state(nnx.State(shardings)))
    assert set(flat_r) == set(flat_s)
    for path, y in flat_r.items():
        y = y[...]
        assert y.sharding.is_equivalent_to(flat_s[path][...] if hasattr(flat_s[path], "value") else flat_s[path],
                                           y.ndim)
        name = str(path[-1])
        weight = quant.weight_of(name) or name
        if path[0] == "layers" and weight in quant.INPUT_AXES:
            w = np.asarray(flat_t[(*path[:-1], weight)][...])
            q, s = quant.quantize(jnp.asarray(w), weight)
            want = s if quant.weight_of(name) else q
            assert y.dtype == want.dtype
            if exact:
                np.testing.assert_array_equal(np.asarray(y).astype(np.float32), np.asarray(want).astype(np.float32))
            elif quant.weight_of(name):
                np.testing.assert_allclose(np.asarray(y), np.asarray(s), rtol=1e-6)
            else:
                deq = np.asarray(quant.dequantize(y, flat_r[(*path[:-1], quant.scale_name(name))][...], name,
                                                  jnp.float32))
                bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * np.asarray(quant.expand(s, name)))
                assert np.all(np.abs(deq - w) <= bound * (1 + 1e-5))
        else:
            assert y.dtype == dtype
            np.testing.assert_array_equal(np.asarray(y), np.asarray(flat_t[path][...]).astype(dtype))


@pytest.mark.parametrize("method,bucket", [("jit", 1 << 30), ("device_put", 1 << 30), ("jit", 4096),
                                           ("device_put", 4096)])
def test_values_and_scales_equal_a_one_device_quantization(params, model_cfg, mesh, method, bucket):
    train = place(params, "fsdp_tp", mesh)
    shardings = _shardings(model_cfg, "tp", mesh)
    cfg = SyncConfig(method=method, bucket_bytes=bucket, rollout_dtype="bfloat16", quantize="fp8")
    with no_host_round_trip():
        rollout, report = sync_weights(train, shardings, cfg)
    _assert_quantized(params, rollout, shardings)
    layers = params["layers"]
    quantized = [n for n in quant.INPUT_AXES if n in layers]
    elems = lambda shape: int(np.prod(shape))  # noqa: E731
    scale_bytes = sum(4 * elems(quant.drop_inputs(layers[n][...].shape, n)) for n in quantized)
    fp8_bytes = sum(elems(layers[n][...].shape) for n in quantized)
    other = sum(2 * elems(x[...].shape) for path, x in nnx.to_flat_state(params)
                if not (path[0] == "layers" and str(path[-1]) in quant.INPUT_AXES))
    assert report.bytes_moved == fp8_bytes + scale_bytes + other
    if bucket == 4096:  # a quantized weight is computed and moved layer by layer
        assert report.buckets > len(quantized)


def test_across_disjoint_pools(params, model_cfg, devices):
    train_mesh = Mesh(np.asarray(devices[:4]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    rollout_mesh = Mesh(np.asarray(devices[4:]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    shardings = _shardings(model_cfg, "tp_replicas", rollout_mesh)
    rollout, report = sync_weights(place(params, "fsdp", train_mesh), shardings,
                                   SyncConfig(rollout_dtype="float32", quantize="fp8", bucket_bytes=4096))
    assert report.method == "device_put"
    assert {d for x in jax.tree.leaves(rollout) for d in x.devices()} <= set(devices[4:])
    _assert_quantized(params, rollout, shardings, jnp.float32)


def test_lora_merged_weights_are_quantized_after_the_merge(model_cfg, mesh):
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"), base_dtype="float32")
    model = init_model(model_cfg.replace(lora=lora), seed=0)
    keys = iter(jax.random.split(jax.random.key(1), 16))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapter_state(model))
    base = base_state(model)
    shardings = _shardings(model_cfg, "tp", mesh)
    lr = LoraRollout(lora, "merged", shardings, SyncConfig(quantize="fp8"))
    lr.set_base(place(base, "fsdp_tp", mesh))
    rollout, _, _ = lr.sync(place(adapters, "fsdp_tp", mesh))
    merged = dict(nnx.to_flat_state(base))
    for target in lora.targets:
        a, b = adapter_names(target)
        w = merged_weight(merged[("layers", target)][...], adapters["layers"][a][...], adapters["layers"][b][...],
                          lora.scale, target)
        merged[("layers", target)] = merged[("layers", target)].replace(w)
    _assert_quantized(nnx.from_flat_state(list(merged.items())), rollout, shardings, jnp.float32, exact=False)


def test_auto_method_quantizes_once(params, model_cfg, mesh, monkeypatch):
    """`method="auto"` on a backend not yet measured calibrates on the train weights themselves (it
    quantizes them once, as the sync does), then syncs."""
    from tpurl.sync import reshard

    monkeypatch.setattr(reshard, "_AUTO_CHOICE", {})
    shardings = _shardings(model_cfg, "tp", mesh)
    rollout, report = sync_weights(place(params, "fsdp_tp", mesh), shardings, SyncConfig(quantize="fp8"))
    assert report.method in ("jit", "device_put")
    _assert_quantized(params, rollout, shardings, jnp.float32)


def test_lora_unmerged_quantizes_the_base_and_moves_the_adapters(model_cfg, mesh):
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"), base_dtype="float32")
    lcfg = model_cfg.replace(lora=lora)
    model = init_model(lcfg, seed=0)
    base, adapters = base_state(model), adapter_state(model)
    shardings = LAYOUTS["tp"].param_shardings(nnx.split(abstract_model(lcfg.replace(quantization="fp8")))[1], mesh)
    lr = LoraRollout(lora, "unmerged", shardings, SyncConfig(quantize="fp8"))
    lr.set_base(place(base, "fsdp_tp", mesh))
    rollout, report, _ = lr.sync(place(adapters, "fsdp_tp", mesh))
    assert report.bytes_moved == sum(x.size * 4 for x in jax.tree.leaves(adapters))  # the adapters alone
    _assert_quantized(nnx.merge_state(base, adapters), rollout, shardings, jnp.float32)


@pytest.mark.slow
def test_the_engines_logprobs_equal_a_plain_model_on_the_dequantized_weights(params, model_cfg, mesh):
    """The engine's quantized model against an independent reference: the plain (unquantized) model
    whose weights are the rollout's values times their scales, dequantized here in numpy."""
    from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate

    qcfg = model_cfg.replace(quantization="fp8")
    graphdef = nnx.graphdef(abstract_model(qcfg))
    rollout, _ = sync_weights(place(params, "fsdp_tp", mesh), _shardings(model_cfg, "tp", mesh),
                              SyncConfig(quantize="fp8"))
    engine = Engine(qcfg, EngineConfig(max_slots=4, max_seq_len=32, page_size=4, prefill_buckets=(8,)),
                    mesh=mesh, layout=LAYOUTS["tp"], graphdef=graphdef)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model_cfg.vocab_size, n).tolist() for n in (3, 6, 8)]
    out = generate(engine, rollout, prompts, n_samples=2,
                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=10), seed=0)
    flat = dict(nnx.to_flat_state(jax.device_get(rollout)))
    plain = dict(nnx.to_flat_state(params))
    for path in plain:
        name = str(path[-1])
        if path[0] == "layers" and name in quant.INPUT_AXES:
            q = np.asarray(flat[path][...]).astype(np.float64)
            s = np.asarray(flat[(*path[:-1], quant.scale_name(name))][...])
            s = np.expand_dims(s, tuple(1 + a for a in quant.INPUT_AXES[name]))
            plain[path] = plain[path].replace(jnp.asarray((q * s).astype(np.float32)))
        else:
            plain[path] = plain[path].replace(jnp.asarray(np.asarray(flat[path][...])))
    dense = nnx.merge(nnx.graphdef(init_model(model_cfg, 0)), nnx.from_flat_state(list(plain.items())))
    for prompt, completions in zip(prompts, out):
        for c in completions:
            np.testing.assert_allclose(c.logprobs, dense_logprobs(dense, prompt, c.token_ids), atol=1e-5)
