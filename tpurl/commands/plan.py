"""`tpurl plan`: memory per device and phase, whether it fits, predicted phase seconds and steps/hour
of the RL run a gin config describes, on a hardware preset; nothing is allocated or compiled.

    tpurl plan --gin_file configs/qwen3_8b_grpo.gin --hardware tpu-v5p-8
    tpurl plan --gin_file configs/demo.gin --hardware cpu --gin_param 'tpurl.RLConfig.batch_size=64'

`--hardware`: tpu-v4-N, tpu-v5e-N, tpu-v5p-N, tpu-v6e-N (Cloud TPU slice names), a100xN, h100xN,
h200xN, b200xN, or cpu (this machine, measured once and cached; `--calibration PATH` to choose
the file). See docs/plan.md for the formulas and the presets' sources.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from tpurl.commands.common import EXPECTED_ERRORS, ArgumentParser, fail
from tpurl.plan.plan import Plan, make_plan
from tpurl.sharding.cost import human_count

GIB = 2**30
PHASE_ORDER = ("rollout", "logprobs", "update", "sync")


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="tpurl plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding 'A.b=c' (repeatable)")
    ap.add_argument("--hardware", required=True, help="hardware preset, e.g. tpu-v5p-8, h100x8, cpu")
    ap.add_argument("--calibration", help="the cpu preset's calibration file (default: the user cache dir)")
    ap.add_argument("--response_len", type=int,
                    help="expected mean response length in tokens: with packing (RLConfig.packing) the update and "
                         "scoring passes are planned on it (default: the task's max_new_tokens, an upper bound; "
                         "memory is always planned for the longest responses)")
    ap.add_argument("--json", action="store_true", help="also print the plan's numbers as one JSON line")
    return ap


def _header(plan: Plan, out: TextIO) -> None:
    job, hw, chip = plan.job, plan.hardware, plan.hardware.chip
    size = human_count(job.model.num_params())
    placement = ("colocated" if job.colocated else
                 f"disaggregated ({job.n_train} train + {job.n_rollout} rollout devices)")
    print(f"model {job.model.model_type}, {size} parameters, remat={job.model.remat!r}, compute {job.model.dtype}",
          file=out)
    print(f"hardware {hw.name}: {hw.devices} x {chip.name} ({chip.hbm_bytes / GIB:.2f} GiB, "
          f"{chip.peak_flops / 1e12:.4g} TFLOP/s peak x {chip.efficiency:g}, HBM {chip.hbm_bandwidth / 1e9:.4g} GB/s, "
          f"link {chip.link_bandwidth / 1e9:.4g} GB/s, host {chip.host_bandwidth / 1e9:.4g} GB/s); {placement}", file=out)
    cfg = job.cfg
    print(f"step: {cfg.batch_size} sequences ({cfg.prompts_per_step} prompts x group {cfg.group_size}), prompt "
          f"{job.prompt_len} + response {job.new_tokens} tokens{_packed(job)}; train mesh {dict(job.train_mesh.shape)} "
          f"({cfg.train_layout.name}), rollout mesh {dict(job.rollout_mesh.shape)} ({cfg.rollout_layout.name})",
          file=out)
    if job.model.lora is not None:
        print(_lora_line(lora_summary(plan)), file=out)
    if job.model.moe is not None:
        print(_moe_line(moe_summary(plan)), file=out)
    kv = plan.kv
    print(f"KV pool: {kv.num_pages} pages of {job.engine.page_size} tokens x {kv.replicas} replica pool(s), "
          f"{kv.bytes_per_device / GIB:.3f} GiB per device; holds {kv.sequences} of the step's {cfg.batch_size} "
          f"sequences at once ({kv.pages_per_sequence} pages each)", file=out)


def lora_summary(plan: Plan) -> dict:
    """A LoRA run's setting: rank, alpha, targets, how the adapters reach the rollout, and the
    trained (adapters, plus PPO's value head) and frozen (the base) parameter counts."""
    job = plan.job
    lora, m = job.model.lora, job.model
    head = m.hidden_size + 1 if job.cfg.algorithm.uses_critic else 0  # `init_value_head`: w [D], b []
    return {"rank": lora.rank, "alpha": lora.alpha, "scale": lora.scale, "targets": list(lora.targets),
            "adapters": job.spec.adapters, "base_dtype": lora.base_dtype,
            "trained_params": m.adapter_params() + head, "frozen_params": m.num_params()}


def _lora_line(s: dict) -> str:
    form = {"merged": "merged into the rollout weights at each sync",
            "unmerged": "unmerged (the rollout engine adds the low-rank path; each sync moves the adapters)"}
    return (f"LoRA: rank {s['rank']}, alpha {s['alpha']:g} (scale {s['scale']:.4g}) on {', '.join(s['targets'])}; "
            f"adapters {form[s['adapters']]}; trained {human_count(s['trained_params'])} parameters, frozen "
            f"{human_count(s['frozen_params'])} (the base, in {s['base_dtype']})")


def moe_summary(plan: Plan) -> dict:
    """A mixture-of-experts model's setting: experts, experts per token, an expert's width, sparse
    and dense layers, total and active (per token) parameters, the experts' share of a decode
    step's reads, and the ways the rollout layout splits the experts."""
    from tpurl.plan.memory import expert_parallel_ways
    from tpurl.plan.timing import active_params

    job, m = plan.job, plan.job.model
    kinds = m.layer_kinds
    return {"experts": m.moe.num_experts, "experts_per_token": m.moe.experts_per_token,
            "expert_width": m.moe.intermediate_size, "sparse_layers": kinds.count("moe"),
            "dense_layers": kinds.count("dense"), "total_params": m.num_params(), "active_params": active_params(m),
            "experts_read_per_decode_step": plan.times.detail["decode_experts_read"],
            "rollout_expert_parallel": expert_parallel_ways(job.cfg.rollout_layout, job.rollout_mesh,
                                                            m.moe.num_experts)}


def _moe_line(s: dict) -> str:
    return (f"MoE: {s['experts']} experts of width {s['expert_width']}, {s['experts_per_token']} active per token; "
            f"{s['sparse_layers']} sparse layers of {s['sparse_layers'] + s['dense_layers']}; "
            f"{human_count(s['total_params'])} parameters in total, {human_count(s['active_params'])} active "
            f"per token; a decode step reads {100 * s['experts_read_per_decode_step']:.1f}% of the experts; rollout "
            f"experts over {s['rollout_expert_parallel']} device(s) (expert parallel)")


def _memory_table(plan: Plan, out: TextIO) -> None:
    for pool, phases in plan.memory.items():
        names = [p for p in PHASE_ORDER if p in phases]
        comps = list(dict.fromkeys(c for p in names for c in phases[p]))
        print(f"\nmemory per {'device' if pool == 'devices' else pool + ' device'} (GiB)".ljust(34)
              + "".join(f"{p:>10}" for p in names), file=out)
        for c in comps:
            print(f"  {c:<32}" + "".join(f"{phases[p][c] / GIB:>10.3f}" if c in phases[p] else f"{'-':>10}"
                                          for p in names), file=out)
        print(f"  {'total':<32}" + "".join(f"{sum(phases[p].values()) / GIB:>10.3f}" for p in names), file=out)
        print(f"  {'fits ' + f'{plan.hbm / GIB:.2f} GiB':<32}"
              + "".join(f"{'yes' if plan.fits(pool, p) else 'NO':>10}" for p in names), file=out)
    parked = ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in plan.host.items()) or "nothing"
    print(f"parked on host during the rollout, per device: {parked}", file=out)


def _time_table(plan: Plan, out: TextIO) -> None:
    t, d = plan.times.seconds, plan.times.detail
    step = sum(t.values())
    print("\npredicted seconds per step (this placement)", file=out)
    exchange = (f", {d['decode_step_exchange_bytes'] / 1e6:.3g} MB of expert exchange"
                if d["decode_step_exchange_bytes"] else "")
    notes = {"rollout": f"decode {d['decode']:.4g} s ({d['decode_steps']:.0f} steps, "
                        f"{d['decode_step_bytes'] / 1e9:.3g} GB read{exchange} per step per device), "
                        f"prefill {d['prefill']:.3g} s",
             "update": f"{d['update_flops'] / 1e12:.4g} TFLOP; optimizer {d['update_optimizer']:.3g} s",
             "sync": f"{d['sync_bytes_max_device'] / 1e9:.3g} GB into the busiest device"}
    for phase, s in t.items():
        print(f"  {phase:<10}{s:>12.4g}  {notes.get(phase, '')}", file=out)
    print(f"  {'step':<10}{step:>12.4g}", file=out)
    print(f"bottleneck: {plan.bottleneck} ({100 * t[plan.bottleneck] / step:.0f}% of the step)", file=out)
    print("steps/hour:", file=out)
    for mode, v in plan.steps_per_hour.items():
        print(f"  {mode:<14}{'n/a' if v is None else f'{v:.4g}':>10}  ({plan.notes[mode]})", file=out)


def print_plan(plan: Plan, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    _header(plan, out)
    _memory_table(plan, out)
    _time_table(plan, out)
    advice = plan.advice()
    print(f"\nfits: {'yes' if not advice else 'NO'}", file=out)
    for line in advice:
        print(f"  {line}", file=out)


def _packed(job) -> str:
    rows = job.spec.train_rows
    per_episode = job.spec.lengths.rows_per_episode
    trained = f" (each episode {per_episode} rows: {rows} rows)" if per_episode > 1 else ""
    if job.updated_rows == job.scored_rows == rows:
        return trained
    return (f"{trained} (update on ~{job.updated_rows} and scoring on ~{job.scored_rows} packed rows for mean "
            f"responses of {job.response_len})")


def plan_json(plan: Plan) -> dict:
    """The plan's numbers; a LoRA run's also its setting (`lora_summary`), a mixture of experts'
    its (`moe_summary`)."""
    out = {"hardware": plan.hardware.name, "fits": plan.fits_all, "memory_bytes": plan.memory, "host_bytes": plan.host,
           "kv_sequences": plan.kv.sequences, "seconds": plan.times.seconds, "steps_per_hour": plan.steps_per_hour,
           "bottleneck": plan.bottleneck}
    if plan.job.model.lora is not None:
        out["lora"] = lora_summary(plan)
    if plan.job.model.moe is not None:
        out["moe"] = moe_summary(plan)
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not args.gin_file:
        _parser().error("at least one --gin_file is required (e.g. configs/qwen3_8b_grpo.gin)")
    try:
        from tpurl.commands.train import build_config
        from tpurl.plan.calibrate import cpu_hardware
        from tpurl.plan.hardware import hardware, is_cpu
        from tpurl.plan.job import make_job

        # The cpu preset is measured (once, then cached): a step of this command, not of a lookup.
        hw = cpu_hardware(args.calibration) if is_cpu(args.hardware) else hardware(args.hardware)
        job = make_job(build_config(args.gin_file, args.gin_param), hw.devices, response_len=args.response_len)
        plan = make_plan(job, hw)
    except EXPECTED_ERRORS as e:
        return fail("tpurl plan", e)
    print_plan(plan)
    if args.json:
        print(json.dumps(plan_json(plan)))
    return 0
