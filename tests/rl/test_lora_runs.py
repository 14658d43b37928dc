"""LoRA RL runs (tpurl.models.lora, tpurl.sync.lora): a colocated step trains the adapters alone
(the base bit for bit unchanged) and syncs merged weights equal to W + scale * A @ B; a
disaggregated asynchronous run serves the adapters unmerged and syncs only their bytes, the
engine's logprobs matching the trainer's; the reference policy is the base; a LoRA run resumes
exactly and exports its base and PEFT adapter, which a new run continues from (`init_adapter`);
the warm start trains adapters or the whole model."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from algo_helpers import MESH3, fresh_state, tiny_rl_config
from tpurl.checkpoint import CheckpointConfig
from tpurl.logging import read_jsonl
from tpurl.models.lora import LoraConfig, adapter_names, merged_weight
from tpurl.models.transformer import abstract_model
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import SFTConfig
from tpurl.rl.loop import prepare, run
from tpurl.rl.run_state import fresh_state as loop_fresh_state
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.step import rl_step
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.correction import correction_preset
from tpurl.train.logprobs import make_logprob_fn

pytestmark = pytest.mark.slow  # whole RL steps and runs

LORA = LoraConfig(rank=4, alpha=8.0, base_dtype="float32")
DISAGG = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4,
                         train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 2)),
                         rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 2)))
VOLATILE = ("time", "throughput/", "memory/", "compile/", "timeline/", "rollout_side/")


def lora_config(run_dir, lora=LORA, **overrides):
    algo = overrides.pop("algorithm", algorithm_preset("grpo", group_size=4, kl_coef=0.05))
    cfg = tiny_rl_config(run_dir, algo, **overrides)
    return cfg.replace(model=cfg.model.replace(lora=lora))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_colocated_step_trains_the_adapters_and_syncs_merged_weights(tmp_path):
    rt = RLRuntime(*prepare(lora_config(tmp_path, steps=1)))
    assert rt.spec.adapters == "merged" and rt.spec.rollout_model.lora is None
    state = fresh_state(rt)
    base0, adapters0 = _leaves(state.train.frozen), _leaves(state.train.params)
    state, m, _, _ = rl_step(rt, state)
    train = state.train
    for before, after in zip(base0, _leaves(train.frozen)):
        np.testing.assert_array_equal(after, before)
    assert all(np.abs(a - b).max() > 0 for a, b in zip(_leaves(train.params), adapters0) if b.shape[-1] != 4 or
               np.abs(b).max() == 0)  # every B moved off zero (A's too, most of them)
    # The rollout weights are the merged weights (the engine runs the plain model).
    rollout = rt.rollout.params
    for target in LORA.targets:
        a, b = adapter_names(target)
        want = merged_weight(train.frozen["layers"][target][...], train.params["layers"][a][...],
                             train.params["layers"][b][...], LORA.scale, target)
        np.testing.assert_allclose(np.asarray(rollout["layers"][target][...]), np.asarray(want), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rollout["embed_tokens"][...]), base0[0])
    targeted = sum(train.frozen["layers"][t][...].nbytes for t in LORA.targets)
    assert m["sync/bytes_moved"] == targeted
    # The reference is the base: at step 1 the adapters' B were zero, so policy = reference.
    assert abs(m["train/kl"]) < 1e-6 and m["train/grad_norm"] > 0
    assert "ref" not in dir(state) or state.ref_params is None


@pytest.mark.parametrize("in_flight", ["drain", "continue"])
def test_an_async_disaggregated_run_serves_adapters_unmerged(tmp_path, in_flight):
    cfg = lora_config(tmp_path, steps=3, placement=DISAGG,
                      async_rollout=AsyncConfig(max_staleness=1, in_flight=in_flight),
                      algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.05,
                                                 correction=correction_preset("tis")))
    rt = RLRuntime(*prepare(cfg))
    assert rt.spec.adapters == "unmerged" and rt.spec.rollout_model.lora == LORA
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(rt.abstract_train_state().params))
    result = run(cfg, verbose=False)
    metrics = read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
    assert len(metrics) == 3
    synced = [m["sync/bytes_moved"] for m in metrics if "sync/bytes_moved" in m]
    # Each sync moves the adapters alone (a step may report two syncs together).
    assert synced and all(b > 0 and b % adapter_bytes == 0 for b in synced)
    # fp32 rollout of base + adapters: the engine's logprobs are the trainer's (up to float noise),
    # the fresh batch's correction weights exactly 1 then.
    assert metrics[0]["mismatch/abs_diff_max"] < 1e-4


def test_resume_repeats_the_run_and_the_export_continues(tmp_path):
    ck = CheckpointConfig(every_steps=1, export_hf=True)
    whole = run(lora_config(tmp_path / "whole", steps=2, checkpoint=ck), verbose=False)
    first = lora_config(tmp_path / "parts", steps=1, checkpoint=ck)
    run(first, verbose=False)
    resumed = run(first.replace(steps=2), resume=True, allow_changed=("steps",), verbose=False)
    assert resumed.resumed_from == 1

    def stable(result):
        return [{k: v for k, v in m.items() if not k.startswith(VOLATILE)}
                for m in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))]

    assert stable(resumed) == stable(whole)
    # The manifest and the report say what trains: the adapters, against the frozen base.
    from tpurl.report.data import load_run
    from tpurl.report.summary import what_ran

    sizes = load_run(whole.run_dir).manifest["extra"]["train_state"]
    model = RLRuntime(*prepare(lora_config(tmp_path / "sizes"))).model_cfg
    assert sizes["trained_params"] == model.adapter_params() and sizes["frozen_params"] == model.num_params()
    assert sizes["trained_bytes"] == 4 * model.adapter_params() and sizes["optimizer_bytes"] >= 8 * model.adapter_params()
    assert (f"LoRA (merged in the rollout): {model.adapter_params():,} trained parameters"
            in what_ran(load_run(whole.run_dir)))
    # The export: the base as a Hugging Face checkpoint and the adapter beside it, in PEFT's format.
    export = whole.export_dir
    assert os.path.exists(os.path.join(export, "config.json"))
    with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
        adapter_cfg = json.load(f)
    assert adapter_cfg["r"] == LORA.rank and adapter_cfg["lora_alpha"] == LORA.alpha
    # A new run from the exported base and adapter starts where this one ended.
    cont = lora_config(tmp_path / "cont", lora=None, steps=1, init_from=export,
                       init_adapter=os.path.join(export, "adapter"))
    rt = RLRuntime(*prepare(cont))
    assert rt.model_cfg.lora.rank == LORA.rank
    state = fresh_state(rt)
    rt_whole = RLRuntime(*prepare(lora_config(tmp_path / "whole", steps=2, checkpoint=ck)))
    _, tree, _ = _restore_latest(rt_whole, whole.run_dir)
    for got, want in zip(_leaves(state.train.params), _leaves(tree["train"].params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _restore_latest(rt, run_dir):
    from tpurl.checkpoint import Checkpointer
    from tpurl.logging.run_dir import CHECKPOINT_DIR

    ck = Checkpointer(os.path.join(run_dir, CHECKPOINT_DIR), max_to_keep=2)
    try:
        return ck.restore_latest({"train": rt.abstract_train_state()})
    finally:
        ck.close()


@pytest.mark.parametrize("whole_model", [False, True])
def test_the_warm_start_trains_adapters_or_the_whole_model(tmp_path, whole_model):
    cfg = lora_config(tmp_path, steps=0, sft=SFTConfig(steps=3, batch_size=8, whole_model=whole_model))
    rt = RLRuntime(*prepare(cfg))
    from tpurl.rl.sft import warm_start

    params = rt.init_params(0)
    before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    after, _, metrics = warm_start(rt, params, 0)
    changed = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(after)[0]
               if np.abs(np.asarray(x) - before[jax.tree_util.keystr(p)]).max() > 0}
    adapters = {k for k in before if "_lora_" in k}
    # Adapters alone, or the base alone (the adapters stay new: RL starts them from zero).
    assert changed == (set(before) - adapters if whole_model else adapters)
    assert np.isfinite(metrics["sft/loss"])


def test_the_kl_reference_is_the_policy_at_the_start_of_rl(tmp_path):
    """After an adapters-only warm start the adapters start RL trained: the reference is a copy of
    them on the base (not the base alone, which the warm start moved away from), so the first
    step's KL is zero."""
    cfg = lora_config(tmp_path, steps=1, sft=SFTConfig(steps=4, batch_size=8, optimizer=OptimizerConfig(lr=3e-2)))
    rt = RLRuntime(*prepare(cfg))
    assert rt.spec.reference == "adapters" and rt.keeps_reference
    state, _ = loop_fresh_state(rt, cfg, say=lambda _: None)
    assert [x.shape for x in jax.tree.leaves(state.ref_params)] == [x.shape for x in jax.tree.leaves(state.train.params)]
    state, m, _, _ = rl_step(rt, state)
    assert abs(m["train/kl"]) < 1e-6
    # The base alone is another policy by now: a reference of it would have pulled the warm start back.
    placed = rt.train_step.prepare({"tokens": np.tile(np.arange(12, dtype=np.int32) % 10, (8, 1)),
                                    "valid": np.ones((8, 12), bool), "loss_mask": np.ones((8, 12), bool)})
    base_graph = nnx.graphdef(abstract_model(rt.model_cfg.replace(lora=None)))
    base_lp = make_logprob_fn(base_graph, mesh=rt.train_mesh, layout=rt.train_layout).on_batch(state.train.frozen,
                                                                                            placed)[0]
    ref_lp = rt.reference_logprobs(state.train, state.ref_params, placed)
    assert float(jnp.abs(base_lp - ref_lp).max()) > 1e-3
