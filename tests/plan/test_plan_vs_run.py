"""The planner's memory against the real run at tiny size: parameters, optimizer state, rollout
weights and the KV pool equal the bytes of the arrays the runtime builds, on every device, exactly
(and a decode step's bytes are counted at the pool's real bytes per cached token);
the update's temporaries are within 1.5x of XLA's `memory_analysis()` of the compiled update."""

import math

import jax
import numpy as np
import pytest

from tpurl.checkpoint import CheckpointConfig
from tpurl.generate import EngineConfig
from tpurl.logging import LoggingConfig
from tpurl.models import preset
from tpurl.models.lora import LoraConfig, adapter_names
from tpurl.plan.job import make_job
from tpurl.plan.memory import kv_plan, state_bytes, update_temporaries
from tpurl.plan.hardware import CHIPS
from tpurl.plan.timing import rollout_seconds, update_flops
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.rl.loop import prepare
from tpurl.rl.runtime import RLRuntime
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.sync import SyncConfig
from tpurl.tasks import AdditionConfig, TaskConfig
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.correction import correction_preset

MESH3 = ("data", "fsdp", "tensor")


def tiny(run_dir, *, remat="none", placement=None, engine=EngineConfig(), sync=SyncConfig(rollout_dtype=None, method="device_put"),
         batch_size=16, kv_heads=2):
    model = preset("tiny", hidden_size=64, intermediate_size=256, head_dim=16, num_heads=4, num_kv_heads=kv_heads,
                   num_layers=2, remat=remat)
    placement = placement or PlacementConfig(train_mesh=MeshConfig(axes=MESH3, shape=(1, 4, 2)),
                                             rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 4)))
    return RLConfig(seed=0, steps=1, batch_size=batch_size, model=model,
                    task=TaskConfig(addition=AdditionConfig(digits=1, num_eval=4, reverse_answer=True)),
                    algorithm=algorithm_preset("grpo", group_size=4), optimizer=OptimizerConfig(lr=1e-3),
                    placement=placement, engine=engine, sync=sync, sft=SFTConfig(steps=0), eval=EvalConfig(pass_k=1),
                    checkpoint=CheckpointConfig(every_steps=0, export_hf=False),
                    logging=LoggingConfig(run_dir=str(run_dir), progress_bar=False, trackers=()))


def runtime_and_job(cfg):
    spec, task = prepare(cfg)
    rt = RLRuntime(spec, task)
    job = make_job(cfg, len(jax.devices()), lengths=spec.lengths)
    return rt, job


def bytes_by_device(tree) -> dict:
    """Bytes of `tree`'s shards on each device (what the planner predicts per device)."""
    out = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def assert_every_device(tree, devices, expected):
    got = bytes_by_device(tree)
    assert set(got) == set(devices)
    assert set(got.values()) == {expected}, got


CONFIGS = {
    "colocated": {},
    # Disaggregated 4 + 4, a bf16 rollout, 4 kv heads over the tensor axis, a pool sized by bytes.
    "disaggregated": dict(
        kv_heads=4, sync=SyncConfig(rollout_dtype="bfloat16", method="device_put"), engine=EngineConfig(kv_memory_bytes=300_000, page_size=4),
        placement=PlacementConfig(mode="disaggregated", train_devices=4,
                                  train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 2)),
                                  rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 2)))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_rollout_params_and_kv_pool_bytes_are_exact(tmp_path, name):
    rt, job = runtime_and_job(tiny(tmp_path, **CONFIGS[name]))
    plan = state_bytes(job)
    train_devs, rollout_devs = rt.placement.train_devices, rt.placement.rollout_devices
    params = rt.init_params(0)
    state = rt.new_train_state(params)
    assert_every_device(state.params, train_devs, plan["master_params"])
    assert_every_device(state.opt_state, train_devs, plan["optimizer_state"])
    rt.rollout.load(state.params, version=0)
    assert_every_device(rt.rollout.params, rollout_devs, plan["rollout_params"])
    kv = kv_plan(job)
    engine = rt.rollout.engine
    decode_state = engine.init_decode_state()
    assert (kv.num_pages, kv.replicas) == (engine.num_pages, engine.replicas)
    assert_every_device(decode_state["cache"], rollout_devs, kv.bytes_per_device)
    slots = {k: v for k, v in decode_state.items() if k != "cache"}
    assert_every_device(slots, rollout_devs, kv.slot_bytes)
    # How many whole sequences fit, from the engine's own page accounting.
    held = min(engine.config.max_slots,
               engine.replicas * (engine.num_pages // engine.shape.sequence_pages(job.prompt_len, job.new_tokens)))
    assert kv.sequences == held
    # A decode step's bytes: the rollout weights on a device plus the cached tokens its sequences
    # attend to, each at the bytes per cached token that the engine's page pool really takes.
    cache_bytes = bytes_by_device(decode_state["cache"])[rollout_devs[0]]
    token_bytes = cache_bytes / (engine.num_pages * engine.config.page_size)
    per_replica = min(kv.sequences, job.cfg.batch_size) / engine.replicas
    context = job.prompt_len + job.new_tokens / 2  # on average over the completion
    read = rollout_seconds(job, kv, plan["rollout_params"], CHIPS["h200"])["decode_step_bytes"]
    assert read == pytest.approx(plan["rollout_params"] + per_replica * context * token_bytes, rel=1e-9)



def test_async_weight_copies_are_planned_at_the_bytes_a_run_holds(tmp_path):
    """Asynchronous drain mode publishes each new version (in the rollout dtype, train layout) until
    the rollout side loads it: the planner counts `max_staleness` such copies on every train device,
    each the bytes of the copy a run publishes; in-flight ("continue") the rollout side holds two
    rollout weights instead, and synchronous runs hold neither."""
    from tpurl.plan.hardware import hardware
    from tpurl.plan.plan import make_plan
    from tpurl.rl.async_rollout import AsyncConfig
    from tpurl.rl.async_step import _rollout_copy

    base = dict(CONFIGS["disaggregated"], sync=SyncConfig(rollout_dtype="bfloat16", method="device_put"))
    cfg = tiny(tmp_path, **base).replace(async_rollout=AsyncConfig(max_staleness=2),
                                         algorithm=algorithm_preset("grpo", group_size=4, correction=correction_preset("tis")))
    rt, job = runtime_and_job(cfg)

    def planned(async_cfg):
        return make_plan(make_job(cfg.replace(async_rollout=async_cfg), job.num_devices,
                                  lengths=job.spec.lengths), hw)

    state = rt.new_train_state(rt.init_params(0))
    published = _rollout_copy(state.params, sync_cfg=rt.rollout.sync_cfg)
    assert_every_device(published, rt.placement.train_devices, state_bytes(job)["published_params"])
    hw = hardware("h100x8")
    plan = make_plan(job, hw)
    assert plan.memory["train"]["update"]["published_params"] == 2 * state_bytes(job)["published_params"]
    assert "rollout_params_next" not in plan.memory["rollout"]["rollout"]
    plan = planned(AsyncConfig(max_staleness=1, in_flight="continue"))
    assert plan.memory["rollout"]["rollout"]["rollout_params_next"] == state_bytes(job)["rollout_params"]
    assert "published_params" not in plan.memory["train"]["update"]
    synchronous = planned(AsyncConfig())
    assert not {"published_params", "rollout_params_next"} & {
        k for phases in synchronous.memory.values() for parts in phases.values() for k in parts}

def compiled_update(rt, job):
    state = rt.new_train_state(rt.init_params(0))
    b, t = job.cfg.batch_size, rt.seq_len
    f32 = np.zeros((b, t), np.float32)
    # Distinct full-length sequences: packing can neither drop padding nor share a prefix, so the
    # program computes the padded batch's tokens, which is what the planner counts.
    tokens = np.random.default_rng(0).integers(0, job.model.vocab_size, (b, t)).astype(np.int32)
    tokens[:, 0] = np.arange(b) % job.model.vocab_size
    batch = {"tokens": tokens, "valid": np.ones((b, t), bool), "loss_mask": f32 + 1,
             "advantages": np.zeros((b,), np.float32), "rollout_logprobs": f32, "ref_logprobs": f32}
    return rt.train_step.lower(state, batch).compile()


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_update_temporaries_within_1_5x_of_xla(tmp_path, remat):
    """Two layers: the planner's update temporaries (gradients, optimizer update, gathered weights,
    activations, logits) against the compiled update's `memory_analysis()` temp bytes."""
    rt, job = runtime_and_job(tiny(tmp_path, remat=remat))
    temp = compiled_update(rt, job).memory_analysis().temp_size_in_bytes
    predicted = sum(update_temporaries(job, state_bytes(job)).values())
    assert temp / 1.5 <= predicted <= 1.5 * temp, (predicted, temp)


@pytest.mark.slow
def test_update_flops_match_xla_cost_analysis(tmp_path):
    """One layer and one micro-batch, because XLA counts a scan's body once: only then is its
    count the whole program's. The planner's update FLOPs per device (3x forward; the optimizer's
    few FLOPs per parameter left out) are within 15% of `cost_analysis()`'s."""
    cfg = tiny(tmp_path)
    rt, job = runtime_and_job(cfg.replace(model=cfg.model.replace(num_layers=1)))
    xla = compiled_update(rt, job).cost_analysis()["flops"]
    predicted = update_flops(job) / job.n_train
    assert abs(predicted - xla) <= 0.15 * xla, (predicted, xla)


def _scoring_flops(m, b: int, t: int) -> tuple[float, float]:
    """(the planner's forward FLOPs, XLA's count of the compiled scoring pass) over `b` x `t` tokens
    on one device."""
    from flax import nnx

    from tpurl.models.transformer import init_model
    from tpurl.plan.timing import forward_flops
    from tpurl.train.logprobs import token_logprobs

    graphdef, params = nnx.split(init_model(m, 0))
    tokens, valid = np.zeros((b, t), np.int32), np.ones((b, t), bool)
    score = jax.jit(lambda p, x, v: token_logprobs((graphdef, p), x, v))
    return forward_flops(m, b, t), score.lower(params, tokens, valid).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.slow
def test_forward_flops_count_the_attention_query_blocks(blocks):
    """A model whose attention dominates its FLOPs (192 tokens, 256-wide heads over a 32-wide
    residual): the planner's forward FLOPs are within 10% of XLA's count with one product and
    with three causal query blocks (which skip a third of the scores)."""
    m = preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=64, num_heads=4,
               num_kv_heads=2, num_layers=1, max_position_embeddings=256, attention_query_blocks=blocks)
    predicted, xla = _scoring_flops(m, 2, 192)
    assert abs(predicted - xla) <= 0.10 * xla, (predicted, xla)


def test_forward_flops_match_xla_cost_analysis():
    """A scoring pass (one layer, one logits chunk, one device): the planner's forward FLOPs are
    within 10% of XLA's count of the compiled program."""
    m = preset("tiny", vocab_size=64, hidden_size=64, intermediate_size=256, head_dim=16, num_heads=4,
               num_kv_heads=2, num_layers=1)
    predicted, xla = _scoring_flops(m, 8, 32)
    assert abs(predicted - xla) <= 0.10 * xla, (predicted, xla)


# LoRA (tpurl.models.lora): rank 4 on every projection, the base frozen in bf16.
LORA = LoraConfig(rank=4, alpha=8.0)
LORA_CONFIGS = {
    # Colocated: the adapters merged into the rollout weights (SyncConfig.adapters="auto").
    "merged": {},
    # Disaggregated 4 + 4 with a bf16 rollout: the adapters beside the base, unmerged.
    "unmerged": CONFIGS["disaggregated"],
}


def tiny_lora(run_dir, lora=LORA, **kw):
    cfg = tiny(run_dir, **kw)
    return cfg.replace(model=cfg.model.replace(lora=lora))


def _global_rollout_bytes(job, state) -> int:
    """Global bytes of `state`'s leaves at the sync's rollout dtype (what a `SyncReport` counts)."""
    from tpurl.sync.reshard import rollout_dtype_of

    return sum(math.prod(p.shape) * rollout_dtype_of(p, job.cfg.sync).itemsize
               for p in job.cfg.train_layout.placements(state, job.train_mesh))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LORA_CONFIGS))
def test_lora_state_rollout_and_sync_bytes_are_exact(tmp_path, name):
    """A LoRA run's arrays against the planner, on every device: the adapters (master params,
    AdamW state, the published copy), the frozen base in bf16, no reference weights, and the
    rollout weights (merged: the base model's; unmerged: base + adapters); each sync moves what the
    planner says (merged: the targeted projections; unmerged: the adapters)."""
    from tpurl.plan.memory import synced_state
    from tpurl.rl.async_step import _rollout_copy

    rt, job = runtime_and_job(tiny_lora(tmp_path, **LORA_CONFIGS[name]))
    assert job.spec.adapters == name and not rt.keeps_reference
    plan = state_bytes(job)
    train_devs, rollout_devs = rt.placement.train_devices, rt.placement.rollout_devices
    state = rt.new_train_state(rt.init_params(0))
    assert_every_device(state.params, train_devs, plan["master_params"])
    assert_every_device(state.opt_state, train_devs, plan["optimizer_state"])
    assert_every_device(state.frozen, train_devs, plan["frozen_params"])
    assert plan["reference_params"] == 0 and plan["gradients"] == plan["master_params"]
    assert_every_device(_rollout_copy(state.params, sync_cfg=rt.rollout.sync_cfg), train_devs,
                        plan["published_params"])
    report = rt.rollout.load(state.params, version=0, frozen=state.frozen)
    assert_every_device(rt.rollout.params, rollout_devs, plan["rollout_params"])
    assert report.bytes_moved == _global_rollout_bytes(job, synced_state(job))
    moved = synced_state(job)["layers"]
    assert set(moved) == ({*LORA.targets} if name == "merged" else {n for t in LORA.targets for n in adapter_names(t)})


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_lora_update_temporaries_within_1_5x_of_xla(tmp_path, remat):
    """The LoRA update's temporaries (the adapters' gradients and update tree, the gathered base,
    activations with the adapters' path, logits) against the compiled update's temp bytes."""
    rt, job = runtime_and_job(tiny_lora(tmp_path, remat=remat))
    temp = compiled_update(rt, job).memory_analysis().temp_size_in_bytes
    predicted = sum(update_temporaries(job, state_bytes(job)).values())
    assert temp / 1.5 <= predicted <= 1.5 * temp, (predicted, temp)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_lora_update_flops_match_xla_cost_analysis(tmp_path, remat):
    """One layer, one micro-batch (as for full fine-tuning): the planner's LoRA update FLOPs (the
    base's matmuls forward + activation gradients, attention and adapters 3x, +1 forward with
    remat; the adapters' residual-stream side on each of the 2 tensor ways) are within 15% of
    `cost_analysis()`'s, where full fine-tuning's 3x forward is not."""
    from tpurl.plan.timing import forward_flops

    cfg = tiny_lora(tmp_path, remat=remat)
    rt, job = runtime_and_job(cfg.replace(model=cfg.model.replace(num_layers=1)))
    xla = compiled_update(rt, job).cost_analysis()["flops"]
    predicted = update_flops(job) / job.n_train
    assert abs(predicted - xla) <= 0.15 * xla, (predicted, xla)
    full_ft = (3 + (remat != "none")) * forward_flops(job.model, job.updated_rows, job.seq_len) / job.n_train
    assert abs(full_ft - xla) > 0.15 * xla, (full_ft, xla)
