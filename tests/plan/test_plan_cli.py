"""`tpurl plan` on the Qwen3-8B GRPO config: every memory component, fit/no-fit and steps/hour are
printed; a config that does not fit names the component to shrink and by how much; a bad hardware
name is a one-line error listing the valid names (status 2). Nothing is allocated: abstract meshes."""

import json
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
    argv = ["plan", "--gin_file", GIN, "--hardware", hardware, "--json", *extra]
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
