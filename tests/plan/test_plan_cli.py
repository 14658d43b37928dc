"""`tpurl plan` on the Qwen3-8B GRPO config: every memory component, fit/no-fit and steps/hour are
printed; a config that does not fit names the component to shrink and by how much; a bad hardware
name is a one-line error listing the valid names (status 2). Nothing is allocated: abstract meshes."""

import json
import math
import os

import pytest

from tpurl.commands.main import main
from tpurl.models import preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIN = os.path.join(ROOT, "configs", "qwen3_8b_grpo.gin")
COMPONENTS = ("master_params", "optimizer_state", "gradients", "reference_params", "rollout_params", "kv_pool",
              "activations", "gathered_weights", "logits", "scoring", "sync_bucket")
GIB = 2**30


def plan(capsys, hardware, *params, extra=()):
    return plan_gin(capsys, GIN, hardware, *params, extra=extra)


def plan_gin(capsys, gin, hardware, *params, extra=()):
    """`tpurl plan --json` of `gin` with `--gin_param`s: (the printed plan, its JSON numbers)."""
    argv = ["plan", "--gin_file", gin, "--hardware", hardware, "--json", *extra]
    for p in params:
        argv += ["--gin_param", p]
    status = main(argv)
    out = capsys.readouterr()
    assert status == 0, out.err
    lines = out.out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])


@pytest.mark.parametrize("hardware,devices", [("tpu-v5p-8", 4), ("h100x8", 8)])
def test_qwen3_8b_prints_every_component_fit_and_steps_per_hour(capsys, hardware, devices):
    text, numbers = plan(capsys, hardware)
    for name in COMPONENTS:
        assert f"  {name} " in text, name
    assert "parked on host during the rollout" in text and "optimizer_state" in text.split("parked on host")[1]
    assert "fits:" in text and "bottleneck:" in text
    for mode in ("colocated", "disaggregated", "async"):
        assert numbers["steps_per_hour"][mode] > 0
    # Independent check: FSDP over every device shards the fp32 master weights evenly (up to the few
    # small vectors it cannot split), and AdamW's two moments are twice that.
    update = numbers["memory_bytes"]["devices"]["update"]
    expected = preset("qwen3-8b").num_params() * 4 / devices
    assert abs(update["master_params"] - expected) < 0.01 * expected
    assert abs(update["optimizer_state"] - 2 * update["master_params"]) < 1e-3 * update["master_params"]
    assert update["reference_params"] == update["master_params"]  # kl_coef > 0: a reference copy


def test_a_config_that_does_not_fit_names_the_component_to_shrink(capsys):
    text, numbers = plan(capsys, "tpu-v5e-4", "tpurl.HandoverConfig.offload_opt_state=False")
    assert numbers["fits"] is False
    hbm = 16 * GIB
    advice = text.split("fits: NO")[1]
    for phase, parts in numbers["memory_bytes"]["devices"].items():
        over = sum(parts.values()) - hbm
        if over > 0:
            largest = max(parts, key=parts.get)
            assert f"devices/{phase} is {over / GIB:.2f} GiB over: shrink {largest}" in advice
    assert "fits: NO" in text


def test_unknown_hardware_is_one_line_listing_valid_names(capsys):
    status = main(["plan", "--gin_file", GIN, "--hardware", "tpu-v9-8"])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    for name in ("tpu-v4-N", "tpu-v5e-N", "tpu-v5p-N", "tpu-v6e-N", "a100xN", "h100xN", "h200xN", "b200xN", "cpu"):
        assert name in err


def test_an_expected_response_length_plans_the_packed_update_and_scoring(capsys):
    """With packing, mean responses of a quarter of max_new_tokens (and a group's prompt held once)
    fill fewer rows: the update and scoring are planned on them (FLOPs scale with the rows); memory
    stays planned for the longest."""
    from tpurl.plan.job import make_job
    from tpurl.commands.train import build_config

    job = make_job(build_config([GIN], []), 8)
    short = job.new_tokens // 4
    _, full = plan(capsys, "h100x8")
    text, packed = plan(capsys, "h100x8", extra=("--response_len", str(short)))
    packed_job = make_job(job.cfg, 8, response_len=short)
    rows = packed_job.updated_rows
    assert f"update on ~{rows} and scoring on ~{packed_job.scored_rows} packed rows" in text
    assert rows < job.cfg.batch_size
    assert packed["memory_bytes"] == full["memory_bytes"]
    for phase in ("update", "logprobs"):
        assert packed["seconds"][phase] < full["seconds"][phase]
    assert packed["seconds"]["rollout"] == full["seconds"]["rollout"]
    _, unpacked = plan(capsys, "h100x8", "tpurl.RLConfig.packing=@tpurl.PackingConfig()",
                       "tpurl.PackingConfig.enabled=False", extra=("--response_len", str(short)))
    assert unpacked["seconds"] == full["seconds"]  # padded rows: the response length changes nothing


@pytest.mark.parametrize("micro_batches,minibatches,share,layout", [
    (1, 1, True, None), (4, 1, True, None), (1, 1, False, None), (2, 2, True, None), (1, 1, True, "dp"),
    (4, 2, True, "dp")])
def test_packed_rows_planned_as_the_packer_fills_them(micro_batches, minibatches, share, layout):
    """The planner's packed rows against the packer's real tokens (in rows of the padded length)
    on a batch of groups that share their prompts, every response `response_len` long: the scoring
    pass packs the whole batch per batch shard and micro-batch, the update each minibatch of whole
    groups."""
    import dataclasses

    import numpy as np

    from tpurl.commands.train import build_config
    from tpurl.plan.job import make_job
    from tpurl.sharding.presets import layout_preset
    from tpurl.train.packing import packed_batch

    cfg = build_config([GIN], [])
    cfg = cfg.replace(algorithm=dataclasses.replace(cfg.algorithm, micro_batches=micro_batches,
                                                    minibatches=minibatches),
                      packing=dataclasses.replace(cfg.packing, share_prefixes=share))
    if layout is not None:
        cfg = cfg.replace(train_layout=layout_preset(layout))
    base = make_job(cfg, 8)
    r = base.new_tokens // 3
    job = make_job(cfg, 8, response_len=r)
    shards = job.spec.batch_shards
    if layout == "dp":
        assert shards == 8  # every device holds its own rows
    b, g, p, t = cfg.batch_size, cfg.group_size, job.prompt_len, job.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 1000, (b, t)).astype(np.int32)
    tokens[:, :p] = np.repeat(tokens[::g, :p], g, axis=0)
    valid = np.broadcast_to(np.arange(t)[None, :] < p + r, (b, t))

    def real_rows(rows):
        packed = packed_batch({"tokens": tokens[rows], "valid": valid[rows]}, cfg.packing, shards=shards,
                              micro_batches=micro_batches)
        return (packed["packed_ends"] > 0).sum() / t

    scored = real_rows(slice(None))
    size = b // minibatches
    updated = sum(real_rows(slice(m * size, (m + 1) * size)) for m in range(minibatches))
    assert abs(job.scored_rows - scored) <= 0.05 * scored + 1, (job.scored_rows, scored)
    assert abs(job.updated_rows - updated) <= 0.05 * updated + 1, (job.updated_rows, updated)


def test_a_response_length_beyond_max_new_tokens_is_a_one_line_error(capsys):
    status = main(["plan", "--gin_file", GIN, "--hardware", "h100x8", "--response_len", "1000000"])
    err = capsys.readouterr().err
    assert status != 0 and len(err.strip().splitlines()) == 1 and "--response_len 1000000" in err


def test_bypass_mode_plans_one_scoring_pass_fewer():
    """Two minibatches need the old policy's logprobs; bypass takes the rollout's instead, and the
    planner counts one forward pass fewer (`tpurl.train.correction`)."""
    import dataclasses

    from tpurl.commands.train import build_config
    from tpurl.plan.job import make_job
    from tpurl.plan.timing import scoring_passes
    from tpurl.train.correction import correction_preset

    cfg = build_config([GIN], [])
    two = cfg.replace(algorithm=dataclasses.replace(cfg.algorithm, minibatches=2))
    bypass = two.replace(algorithm=dataclasses.replace(two.algorithm, correction=correction_preset("bypass")))
    assert scoring_passes(make_job(bypass, 8)) == scoring_passes(make_job(two, 8)) - 1


LORA_GIN = os.path.join(ROOT, "configs", "qwen3_8b_lora.gin")
# One GPU: the rollout without tensor parallelism, and a KV pool of half the chip (the step's
# sequences then decode in waves).
ONE_GPU = ("rollout/tpurl.MeshConfig.shape=(1,1,1)", "tpurl.EngineConfig.kv_memory_fraction=0.5")


def _lora32():
    """configs/qwen3_8b_lora.gin's adapters."""
    from tpurl.models.lora import LoraConfig

    return LoraConfig(rank=32, alpha=64.0)


def test_qwen3_8b_lora_fits_one_h100_where_full_fine_tuning_does_not(capsys):
    """Rank 32 on every projection: the adapters train (fp32, with AdamW's moments), the base is
    frozen in bf16 and is the KL reference (no weights of its own). On one H100 the LoRA run fits;
    full fine-tuning's fp32 weights, moments, gradients and reference do not; the trained
    parameters' bytes are over 50x smaller. The header states the setting."""
    text, lora = plan_gin(capsys, LORA_GIN, "h100x1", *ONE_GPU)
    _, full = plan_gin(capsys, GIN, "h100x1", *ONE_GPU)
    assert lora["fits"] and not full["fits"]
    base = preset("qwen3-8b")
    adapters = base.replace(lora=_lora32()).adapter_params()
    assert ("LoRA: rank 32, alpha 64 (scale 2) on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; "
            "adapters merged into the rollout weights") in text
    assert f"trained {adapters / 1e6:.2f} M parameters, frozen {base.num_params() / 1e9:.2f} B" in text
    assert "  frozen_params " in text
    assert lora["lora"] == {"rank": 32, "alpha": 64.0, "scale": 2.0, "targets": list(_lora32().targets),
                            "adapters": "merged", "base_dtype": "bfloat16", "trained_params": adapters,
                            "frozen_params": base.num_params()}
    for phase, parts in lora["memory_bytes"]["devices"].items():
        # One device holds everything: the adapters in fp32, the base in bf16 (in every phase).
        assert parts["master_params"] == 4 * adapters and parts["frozen_params"] == 2 * base.num_params(), phase
        assert parts["reference_params"] == 0
    update, full_update = lora["memory_bytes"]["devices"]["update"], full["memory_bytes"]["devices"]["update"]
    assert full_update["master_params"] >= 50 * update["master_params"]
    assert full_update["optimizer_state"] >= 50 * update["optimizer_state"]
    assert update["rollout_params"] == 2 * base.num_params()  # merged: the base model's weights, bf16
    assert "optimizer_state" in lora["host_bytes"] and "frozen_params" not in lora["host_bytes"]


def test_qwen3_8b_lora_on_a_v5e_8_shards_the_adapters_as_the_layout_does(capsys):
    """On 8 chips with FSDP the base (bf16) and the adapters' `embed` halves split 8 ways, while
    the other halves (rank x heads or MLP: axes FSDP does not shard) are on every chip; the
    per-device master bytes say so exactly, and full fine-tuning's are still over 15x larger."""
    from tpurl.models.lora import PROJECTIONS

    _, lora = plan_gin(capsys, LORA_GIN, "tpu-v5e-8")
    _, full = plan_gin(capsys, GIN, "tpu-v5e-8")
    m, r = preset("qwen3-8b"), 32
    shapes, per_layer = m.projection_shapes(), 0
    for target, (ins, _) in PROJECTIONS.items():
        fan_in, fan_out = math.prod(shapes[target][:len(ins)]), math.prod(shapes[target][len(ins):])
        embed_in = ins == ("embed",)
        per_layer += r * ((fan_in // 8 + fan_out) if embed_in else (fan_in + fan_out // 8))
    update = lora["memory_bytes"]["devices"]["update"]
    assert update["master_params"] == 4 * m.num_layers * per_layer
    assert abs(update["frozen_params"] - 2 * m.num_params() / 8) < 1e-3 * update["frozen_params"]
    assert full["memory_bytes"]["devices"]["update"]["master_params"] > 15 * update["master_params"]
    assert lora["seconds"]["update"] < full["seconds"]["update"]


def test_merged_adapters_sync_the_projections_unmerged_only_the_adapters():
    """The 8B LoRA run on 8 H100s, colocated: merged, each sync moves the targeted projections (at
    bf16) and the engine runs the base model; unmerged, each sync moves only the adapters (over
    50x fewer bytes into the busiest device), the rollout weights and every decode step read
    the adapters too, and prefill computes their path."""
    from tpurl.commands.train import build_config
    from tpurl.plan.hardware import hardware
    from tpurl.plan.job import make_job
    from tpurl.plan.plan import make_plan

    hw = hardware("h100x8")
    plans = {form: make_plan(make_job(build_config([LORA_GIN], [f"tpurl.SyncConfig.adapters='{form}'"]), 8), hw)
             for form in ("merged", "unmerged")}
    merged, unmerged = plans["merged"], plans["unmerged"]
    assert merged.job.spec.adapters == "merged" and unmerged.job.spec.adapters == "unmerged"
    moved = {form: p.times.detail["sync_bytes_max_device"] for form, p in plans.items()}
    adapters = preset("qwen3-8b").replace(lora=_lora32()).adapter_params()
    assert 0 < moved["unmerged"] <= 2 * adapters and moved["merged"] > 50 * moved["unmerged"]
    assert unmerged.times.seconds["sync"] < merged.times.seconds["sync"]
    extra = unmerged.state["rollout_params"] - merged.state["rollout_params"]
    assert 0 < extra <= 2 * adapters  # the bf16 adapters beside the base
    read = {form: p.times.detail["decode_step_bytes"] for form, p in plans.items()}
    assert read["unmerged"] - read["merged"] == extra
    assert unmerged.times.detail["prefill"] > merged.times.detail["prefill"]
    assert merged.times.detail["update_flops"] == unmerged.times.detail["update_flops"]
    assert merged.state["published_params"] == unmerged.state["published_params"]  # the adapters, either way


def test_a_lora_base_that_does_not_fit_names_base_dtype(capsys):
    """An fp32 base on one 16 GiB chip: the frozen base is the component to shrink, and the advice
    names `LoraConfig.base_dtype`."""
    text, numbers = plan_gin(capsys, LORA_GIN, "tpu-v5e-1", "rollout/tpurl.MeshConfig.shape=(1,1,1)",
                             "tpurl.LoraConfig.base_dtype='float32'")
    assert not numbers["fits"]
    fp32_base = 4 * preset("qwen3-8b").num_params() / GIB
    assert f"shrink frozen_params ({fp32_base:.2f} GiB)" in text and "LoraConfig.base_dtype" in text


def test_an_agent_episode_is_planned_as_its_trained_sequences_rows(monkeypatch, capsys):
    """`AgentConfig.trained_sequences` = 2: the update batch has two rows per episode, and the
    planner's padded scoring and update rows and their activations double; packed with an expected
    response length, the episode's tokens are one sequence's (its other rows hold none)."""
    import dataclasses

    from tpurl.commands.train import build_config
    from tpurl.plan.job import make_job
    from tpurl.plan.memory import update_temporaries

    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "agent"))
    cfg = build_config([os.path.join(ROOT, "examples", "agent", "agent_demo.gin")], [])
    two = cfg.replace(task=dataclasses.replace(cfg.task, agent=dataclasses.replace(cfg.task.agent,
                                                                                 trained_sequences=2)))
    a, b = make_job(cfg, 8), make_job(two, 8)
    assert b.spec.train_rows == 2 * a.spec.train_rows == 2 * cfg.batch_size
    assert (b.scored_rows, b.updated_rows) == (2 * a.scored_rows, 2 * a.updated_rows)
    state = {"gradients": 0, "master_params": 0}
    assert update_temporaries(b, state)["activations"] > update_temporaries(a, state)["activations"]
    r = a.new_tokens // 4
    assert make_job(two, 8, response_len=r).scored_rows == make_job(cfg, 8, response_len=r).scored_rows
    text, _ = plan_gin(capsys, os.path.join(ROOT, "examples", "agent", "agent_demo.gin"), "h100x1",
                       "tpurl.AgentConfig.trained_sequences=2")
    assert f"(each episode 2 rows: {2 * cfg.batch_size} rows)" in text
