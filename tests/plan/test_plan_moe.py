"""The planner on a mixture-of-experts model (Qwen3-MoE, `tpurl.models.moe`): every expert's bytes in
the weights it holds against the real run's arrays (tiny, 8 CPU devices, a dense layer between two
sparse ones); the update and forward FLOPs against XLA's `cost_analysis()`; the Qwen3-30B-A3B plan
counting only the active experts' FLOPs, reading the experts a decode step touches, and saying so in
its header."""

import dataclasses
import math
import os

import jax
import pytest
from flax import nnx

from test_plan_vs_run import (CONFIGS, _scoring_flops, assert_every_device, bytes_by_device,
                              compiled_update, runtime_and_job, tiny)
from tpurl.commands.main import main
from tpurl.models import preset
from tpurl.models.moe import MoeConfig
from tpurl.models.transformer import abstract_model
from tpurl.plan.job import make_job
from tpurl.plan.memory import (EXPERT_NAMES, expert_parallel_ways, kv_plan, rollout_expert_bytes, state_bytes,
                               synced_state)
from tpurl.plan.timing import active_expert_params, update_flops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE_GIN = os.path.join(ROOT, "configs", "qwen3_30b_a3b_grpo.gin")
# Layers 0 and 2 sparse (8 experts of width 32, 2 per token), layer 1 dense: every segment of the
# layer scan is one layer, so XLA's cost analysis (which counts a scan's body once) counts them all.
MOE = MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=32, dense_layers=(1,))


def tiny_moe(run_dir, **kw):
    cfg = tiny(run_dir, **kw)
    model = preset("tiny-moe", num_layers=3, num_kv_heads=cfg.model.num_kv_heads, remat=cfg.model.remat, moe=MOE)
    return cfg.replace(model=model)


def _resharded_bytes(job) -> int:
    """Global bytes, at the rollout dtype, of the synced leaves whose train and rollout shardings
    differ (a sync passes the others through when their dtype stays: `SyncReport.bytes_moved`
    counts what it moves)."""
    from tpurl.sync.reshard import rollout_dtype_of

    moving = synced_state(job)
    src = job.cfg.train_layout.placements(moving, job.train_mesh)
    dst = job.cfg.rollout_layout.placements(moving, job.rollout_mesh)
    cast = job.cfg.sync.copies_every_leaf(job.model.param_dtype) or not job.colocated
    return sum(math.prod(q.shape) * rollout_dtype_of(q, job.cfg.sync).itemsize
               for p, q in zip(src, dst) if cast or p.spec != q.spec)


def _experts(tree) -> dict:
    return {name: tree["layers"][name] for name in EXPERT_NAMES}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_state_rollout_and_sync_bytes_are_exact(tmp_path, name):
    """Every expert in every weight-holding component, on every device, byte for byte: the fp32
    master params and AdamW state (experts over fsdp, each expert's MLP over tensor: `fsdp_tp`),
    the published copy, the rollout weights (experts over the tensor axes: `tp`, expert parallel),
    the experts' share of them that a decode step may skip, the KV pool; each sync moves every
    parameter, experts included."""
    from tpurl.rl.async_step import _rollout_copy

    rt, job = runtime_and_job(tiny_moe(tmp_path, **CONFIGS[name]))
    plan = state_bytes(job)
    train_devs, rollout_devs = rt.placement.train_devices, rt.placement.rollout_devices
    state = rt.new_train_state(rt.init_params(0))
    gate = jax.tree.leaves(state.params["layers"]["experts_gate"])[0]
    fsdp, tensor = job.train_mesh.shape["fsdp"], job.train_mesh.shape["tensor"]
    assert gate.sharding.shard_shape(gate.shape) == (2, 8 // fsdp, 64, 32 // tensor)
    assert_every_device(state.params, train_devs, plan["master_params"])
    assert_every_device(state.opt_state, train_devs, plan["optimizer_state"])
    assert plan["reference_params"] == plan["gradients"] == plan["master_params"]
    assert_every_device(_rollout_copy(state.params, sync_cfg=rt.rollout.sync_cfg), train_devs,
                        plan["published_params"])
    report = rt.rollout.load(state.params, version=0)
    assert_every_device(rt.rollout.params, rollout_devs, plan["rollout_params"])
    ways = expert_parallel_ways(job.cfg.rollout_layout, job.rollout_mesh, MOE.num_experts)
    assert ways == job.rollout_mesh.shape["tensor"] > 1
    assert_every_device(_experts(rt.rollout.params), rollout_devs, rollout_expert_bytes(job))
    assert report.bytes_moved == _resharded_bytes(job)
    assert set(EXPERT_NAMES) <= set(synced_state(job)["layers"])
    decode_state = rt.rollout.engine.init_decode_state()
    assert_every_device(decode_state["cache"], rollout_devs, kv_plan(job).bytes_per_device)


def _cpu_expert_flops(job) -> float:
    """XLA's count, on CPU, of the experts' grouped matmuls in one update on one device: the CPU
    lowers `ragged_dot` to every expert on every routed row, masked (E x a row's active FLOPs), and
    the routing's sort over the flattened batch hands every batch shard the micro-batch's routed
    rows of all shards (`[rows T X, G / te]` operands on every device in the compiled HLO). Forward
    + backward: 3x."""
    m, te = job.model, job.train_mesh.shape["tensor"]
    per_token = 2 * active_expert_params(m)  # the X chosen experts of every sparse layer
    return 3.0 * per_token * job.updated_rows * job.seq_len * m.moe.num_experts / te


@pytest.mark.slow
def test_moe_update_flops_against_xla_cost_analysis(tmp_path):
    """The planner counts the router and each token's X active experts (what a grouped matmul of the
    rows routed to each expert computes); XLA on CPU computes more, and says so: its `ragged_dot` is
    every expert on every routed row, masked, and every batch shard computes the whole micro-batch's
    routed rows (`_cpu_expert_flops`). The planner's update FLOPs with its expert part replaced by
    that count are within 15% of `cost_analysis()`, so everything else (attention, projections, the
    dense layer, the router, the unembedding) is counted as the dense test counts it; the active
    count itself is several times below XLA's here."""
    rt, job = runtime_and_job(tiny_moe(tmp_path))
    xla = compiled_update(rt, job).cost_analysis()["flops"]
    tokens = job.updated_rows * job.seq_len
    active = 3.0 * 2 * active_expert_params(job.model) * tokens
    planned = update_flops(job)
    cpu = (planned - active) / job.n_train + _cpu_expert_flops(job)
    assert abs(cpu - xla) <= 0.15 * xla, (cpu, xla)
    assert xla > 4 * planned / job.n_train, (planned / job.n_train, xla)


@pytest.mark.parametrize("dense_layers,layers", [((), 1), ((1,), 3)])
def test_moe_forward_flops_against_xla_on_one_device(dense_layers, layers):
    """A scoring forward on one device (no batch shards): the planner's forward FLOPs with each
    token's X expert matmuls counted E times (the CPU's masked `ragged_dot`) are within 10% of
    `cost_analysis()`."""
    from tpurl.plan.timing import forward_flops

    m = preset("tiny-moe", num_layers=layers, moe=MoeConfig(num_experts=8, experts_per_token=2,
                                                            intermediate_size=32, dense_layers=dense_layers))
    b, t = 8, 32
    planned, xla = _scoring_flops(m, b, t)
    assert planned == forward_flops(m, b, t)
    cpu = planned + (m.moe.num_experts - 1) * 2.0 * active_expert_params(m) * b * t
    assert abs(cpu - xla) <= 0.10 * xla, (cpu, xla)


def _job_30b(*params: str, experts_per_token: int | None = None):
    """configs/qwen3_30b_a3b_grpo.gin on 8 devices, with gin bindings `params` and optionally another
    number of experts per token."""
    from tpurl.commands.train import build_config

    cfg = build_config([MOE_GIN], list(params))
    if experts_per_token is not None:
        moe = dataclasses.replace(cfg.model.moe, experts_per_token=experts_per_token)
        cfg = cfg.replace(model=cfg.model.replace(moe=moe))
    return make_job(cfg, 8)


def _expert_params_in_tree(m) -> int:
    """Every expert's parameters, counted from the model's abstract parameter tree."""
    layers = nnx.state(abstract_model(m), nnx.Param)["layers"]
    return sum(math.prod(layers[name].get_value().shape) for name in EXPERT_NAMES)


def test_qwen3_30b_update_counts_the_active_experts_only():
    """Qwen3-30B-A3B (128 experts, 8 per token): the update's FLOPs are the other matmuls and
    attention plus K/E = 1/16 of what every expert would compute. With all 128 experts active the
    update grows by exactly the idle experts' FLOPs, counted from the real parameter tree (2 per
    parameter per token, x4: forward, backward, full remat's recompute); what is left, the
    non-expert part, is the parameter tree's other matmul weights' FLOPs plus the attention."""
    from tpurl.plan.timing import attention_flops

    job, every = _job_30b(), _job_30b(experts_per_token=128)
    m = job.model
    e, k = m.moe.num_experts, m.moe.experts_per_token
    assert m.remat == "full" and job.cfg.algorithm.epochs == 1
    tokens = job.updated_rows * job.seq_len
    all_experts = 4 * 2.0 * _expert_params_in_tree(m) * tokens
    idle = update_flops(every) - update_flops(job)
    assert idle == pytest.approx((e - k) / e * all_experts, rel=1e-9)
    others = update_flops(job) - k / e * all_experts
    embed = m.vocab_size * m.hidden_size  # a lookup, not a matmul
    norms = m.num_layers * (2 * m.hidden_size + 2 * m.head_dim) + m.hidden_size
    matmul_weights = m.num_params() - _expert_params_in_tree(m) - embed - norms
    expected = 4 * (2.0 * matmul_weights * tokens + attention_flops(m, job.updated_rows, job.seq_len))
    assert others == pytest.approx(expected, rel=1e-9)
    assert (update_flops(job) - others) / (update_flops(every) - others) == pytest.approx(k / e, rel=1e-9)
    assert update_flops(job) < 0.2 * update_flops(every)


def test_qwen3_30b_decode_reads_the_experts_its_tokens_touch():
    """A decode step with B live tokens per replica reads every weight but the experts none of them
    chose, E (1 - K/E)^B of each sparse layer's (in expectation: 98.4% read at B = 64 on 8 H100s with
    four replica pools, 64% at B = 16), and adds the expert-parallel exchange of the tokens' K routed
    copies over the two tensor devices that split the experts."""
    from tpurl.plan.hardware import hardware
    from tpurl.plan.plan import make_plan

    hw = hardware("h100x8")
    for live, read in ((256, 0.984), (64, 0.644)):
        job = _job_30b(f"tpurl.RLConfig.batch_size={live}", f"tpurl.algorithm_preset.micro_batches={live // 16}")
        plan = make_plan(job, hw)
        d, m, kv = plan.times.detail, job.model, plan.kv
        b = min(kv.sequences, live) / kv.replicas
        untouched = (1 - m.moe.experts_per_token / m.moe.num_experts) ** b
        assert d["decode_experts_read"] == pytest.approx(1 - untouched) and abs(d["decode_experts_read"] - read) < 0.01
        experts = rollout_expert_bytes(job)
        assert 0.9 * plan.state["rollout_params"] < experts < plan.state["rollout_params"]
        kv_read = b * (job.prompt_len + job.new_tokens / 2) * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
        assert d["decode_step_bytes"] == pytest.approx(plan.state["rollout_params"] - untouched * experts
                                                       + kv_read / kv.kv_shards, rel=1e-9)
        ways = expert_parallel_ways(job.cfg.rollout_layout, job.rollout_mesh, m.moe.num_experts)
        assert ways == 2
        exchange = 2 * 48 * b * 8 * m.hidden_size * 2 * (ways - 1) / ways**2
        assert d["decode_step_exchange_bytes"] == pytest.approx(exchange, rel=1e-9)


@pytest.mark.parametrize("hardware,devices", [("h100x8", 8), ("tpu-v5p-8", 4)])
def test_qwen3_30b_plan_states_the_experts(capsys, hardware, devices):
    """The header's MoE line (experts, active per token, sparse layers, total vs active parameters),
    the JSON's `moe`; the fp32 master params are every expert's, sharded over all devices."""
    from test_plan_cli import plan_gin

    text, numbers = plan_gin(capsys, MOE_GIN, hardware)
    m = preset("qwen3-30b-a3b")
    idle = 48 * (128 - 8) * 3 * 2048 * 768
    active = m.num_params() - idle
    assert 3.2e9 < active < 3.5e9  # "A3B": about 3.3 B active
    assert (f"MoE: 128 experts of width 768, 8 active per token; 48 sparse layers of 48; "
            f"{m.num_params() / 1e9:.2f} B parameters in total, {active / 1e9:.2f} B active per token") in text
    moe = numbers["moe"]
    assert (moe["experts"], moe["experts_per_token"], moe["sparse_layers"], moe["dense_layers"]) == (128, 8, 48, 0)
    assert (moe["total_params"], moe["active_params"]) == (m.num_params(), active)
    master = numbers["memory_bytes"]["devices"]["update"]["master_params"]
    assert abs(master - 4 * m.num_params() / devices) < 0.01 * master
