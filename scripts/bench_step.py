"""Per-phase seconds of one colocated RL step vs its compute floor; prints JSON.

Model: ~4M parameters (D=256, 4 layers, F=1024). Step: 16 prompts x 8 samples of 3-digit addition
(short completions), GRPO with a KL penalty to a reference policy, one update. Measured on one
device and on 8 fake CPU devices (a child process per device count, since the device count is
fixed when JAX starts). The compute floor is the step's model FLOPs over *valid* tokens -- rollout
(prefill of each prompt once + one forward per generated token), the reference forward, and the
update (forward + backward = 3 forwards) -- divided by this machine's fp32 matmul rate, measured in
the same run. The step is on-policy (one epoch, one minibatch), so it runs no separate old-policy
forward: the update's own forward pass is the old policy's. `phases_s` are the median timed step's
(of `--steps`). `ratio` = measured step seconds / floor seconds (target <= 1.5 on one device);
`flops_padded` / `ratio_padded` count every sequence padded to the task's full length (the
reference and update forwards run packed by default, `RLConfig.packing`, so they compute less).
`update_matmuls_s` (one device) times just the update's matmuls (forward + backward of a skeleton
with the model's projection shapes, `tpurl.plan.calibrate.model_matmuls_seconds`) over the tokens
its forward runs on (`update_tokens`: packed rows x row length), and `update_over_matmuls` is the
update phase over them: what attention, norms, activations, the layer scan's buffers, the loss and
the optimizer add (target <= 1.3).
`update_padded_floor_s` is the padded update's FLOPs at the matmul rate.

`--packing` instead compares the update and the reference-logprobs phases padded vs packed
(`tpurl.train.packing`) on one device, at 128 new tokens with a random-init vocab-64 model's
completion lengths (eos drawn with probability 1/64 per token, capped at 128: mean ~55), with the
`bench_vs_trl` model (Qwen3-shaped, D=256, 4 layers, 4 q / 2 kv heads of 64, F=1024, fp32; `--size
30m`: its 30m model, D=512, 8 layers, 8 q / 4 kv heads, F=2048), 16 prompts x 8 samples, GRPO with KL
to a reference; one JSON object, with `update_matmuls_s` at the packed shapes and
`update_packed_over_matmuls`.

`--bitwise` instead runs the one-device step in fast and in bitwise mode
(`ModelConfig.consistency`, `tpurl.models.invariant`) one after the other and reports each
phase's seconds in both, their ratios (`bitwise_over_fast`) and each mode's
`mismatch/abs_diff_max` (bitwise: 0). The model's `max_position_embeddings` is 64 in every run
(the bitwise attention window; fast mode does not depend on it).

    python scripts/bench_step.py [--steps 5] [--devices 1 8] [--remat dots|none|full] [--unroll-layers 4]
    python scripts/bench_step.py --packing [--size 4m|30m] [--steps 5] [--remat none] [--unroll-layers 4]
    python scripts/bench_step.py --bitwise [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _config(run_dir: str, devices: int, remat: str = "dots", unroll_layers: int = 1, consistency: str = "fast"):
    from tpurl.checkpoint import CheckpointConfig
    from tpurl.logging import LoggingConfig
    from tpurl.models import preset
    from tpurl.rl.config import EvalConfig, RLConfig
    from tpurl.sharding.layout import MeshConfig
    from tpurl.sharding.placement import PlacementConfig
    from tpurl.tasks import AdditionConfig, TaskConfig
    from tpurl.train.config import OptimizerConfig, algorithm_preset

    axes = ("data", "fsdp", "tensor")
    train_shape, rollout_shape = ((1, 1, 1), (1, 1, 1)) if devices == 1 else ((1, 4, 2), (2, 1, 4))
    return RLConfig(
        seed=0, steps=0, batch_size=128,
        model=preset("tiny", hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=8,
                     head_dim=32, remat=remat, unroll_layers=unroll_layers, consistency=consistency,
                     max_position_embeddings=64),
        task=TaskConfig(addition=AdditionConfig(digits=3, pad_operands=True, reverse_answer=True, num_eval=16)),
        algorithm=algorithm_preset("grpo", group_size=8, kl_coef=0.04),
        optimizer=OptimizerConfig(lr=1e-4),
        placement=PlacementConfig(train_mesh=MeshConfig(axes=axes, shape=train_shape),
                                  rollout_mesh=MeshConfig(axes=axes, shape=rollout_shape)),
        eval=EvalConfig(pass_k=1), checkpoint=CheckpointConfig(export_hf=False),
        logging=LoggingConfig(run_dir=run_dir, trackers=(), progress_bar=False))


def child(devices: int, steps: int, remat: str, unroll_layers: int = 1, consistency: str = "fast") -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpurl.plan.calibrate import matmul_rate, model_matmuls_seconds
    from tpurl.rl.loop import freeze_heap, freeze_if_compiled, prepare
    from tpurl.rl.runtime import RLRuntime
    from tpurl.rl.step import LoopState, rl_step

    cfg = _config(tempfile.mkdtemp(prefix="bench_step_"), devices, remat, unroll_layers, consistency)
    rt = RLRuntime(*prepare(cfg, devices))
    train = rt.new_train_state(rt.init_params(0))
    ref = jax.tree.map(jnp.copy, train.params)
    rt.rollout.load(train.params, version=0)
    state = LoopState(train=train, ref_params=ref, step=0, cursor=0, policy_version=0)
    state, _, _, _ = rl_step(rt, state)  # compiles everything
    freeze_heap()
    runs, mismatch = [], []
    tokens, prompt_valid, seq_valid, update_tokens = [], [], [], []
    g = cfg.group_size
    for _ in range(steps):
        state, metrics, records, _ = rl_step(rt, state)
        freeze_if_compiled(metrics)  # as the run loop does
        runs.append({k[len("time/"):-2]: v for k, v in metrics.items() if k.startswith("time/")})
        mismatch.append(metrics["mismatch/abs_diff_max"])
        tokens.append(metrics["rollout/tokens_generated"])
        # Real (unpadded) tokens: each group's prompt is prefilled once; the trainer's forwards see
        # every sequence's prompt + completion (at most seq_len of them).
        prompt_valid.append(sum(len(r["prompt_ids"]) for r in records[::g]))
        seq_valid.append(sum(min(len(r["prompt_ids"]) + len(r["completion_ids"]), rt.seq_len) for r in records))
        update_tokens.append(update_shape_tokens(cfg, records, rt.seq_len))
    # The median step's phases (a shared host's hiccups land in single steps; the median ignores them).
    median = sorted(range(len(runs)), key=lambda i: runs[i]["step"])[len(runs) // 2]
    phases = runs[median]

    # Model FLOPs: 2 x (matmul params) per token per forward; the backward is 2 forwards.
    mc = rt.model_cfg
    d, n, k, h, f = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size
    # Matmul weights a token meets: q/k/v/o and the SwiGLU MLP per layer, and the unembedding (the
    # embedding is a gather, norms are elementwise).
    matmul_params = mc.num_layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f) + d * mc.vocab_size
    per_token = 2 * matmul_params
    gen_tokens = float(np.mean(tokens))

    def step_flops(prompt_tokens: float, seq_tokens: float) -> dict[str, float]:
        return {"rollout": per_token * (prompt_tokens + gen_tokens), "reference": per_token * seq_tokens,
                "update": 3 * per_token * seq_tokens}

    # The floor counts useful work only (valid tokens); the padded figure is what the fixed-shape
    # programs compute (prompts padded to the prefill bucket, sequences to seq_len).
    flops = step_flops(float(np.mean(prompt_valid)), float(np.mean(seq_valid)))
    flops_padded = step_flops(cfg.prompts_per_step * rt.spec.lengths.prompt_len, cfg.batch_size * rt.seq_len)
    rate = matmul_rate()
    floor_s = sum(flops.values()) / rate
    padded_floor_s = sum(flops_padded.values()) / rate
    matmuls_s = model_matmuls_seconds(mc, update_tokens[median], backward=True) if devices == 1 else None
    return {"devices": devices, "remat": remat, "unroll_layers": unroll_layers, "params": mc.num_params(),
            "consistency": consistency, "mismatch_abs_diff_max": max(mismatch),
            "phases_s": phases, "step_s": phases["step"],
            "all_steps_s": [r["step"] for r in runs],
            "tokens_generated": gen_tokens, "valid_seq_tokens": float(np.mean(seq_valid)),
            "padded_seq_tokens": cfg.batch_size * rt.seq_len, "flops": flops, "flops_padded": flops_padded,
            "matmul_flops_per_s": rate, "floor_s": floor_s, "padded_floor_s": padded_floor_s,
            "ratio": phases["step"] / floor_s, "ratio_padded": phases["step"] / padded_floor_s,
            # One device: the update's matmuls alone at the shapes its forward ran on (packed rows x
            # row length), and the update phase over them; the padded shapes' FLOP floor.
            "update_tokens": update_tokens[median], "update_matmuls_s": matmuls_s,
            "update_over_matmuls": phases["update"] / matmuls_s if matmuls_s else None,
            "update_padded_floor_s": flops_padded["update"] / rate,
            "backend": jax.default_backend(), "device_count": len(jax.devices())}


def update_shape_tokens(cfg, records, seq_len: int) -> int:
    """Tokens the update's model forward runs on: rows x row length of the step's sequences packed
    as the step packs them (`RLConfig.packing`; one batch shard), or the padded batch unpacked."""
    import numpy as np

    from tpurl.train.packing import pack_batch

    if not cfg.packing.enabled:
        return cfg.batch_size * seq_len
    tokens = np.zeros((len(records), seq_len), np.int32)
    for i, r in enumerate(records):
        seq = (list(r["prompt_ids"]) + list(r["completion_ids"]))[:seq_len]
        tokens[i, :len(seq)] = seq
    valid = np.arange(seq_len)[None, :] < np.asarray([len(r["prompt_ids"]) + len(r["completion_ids"])
                                                      for r in records])[:, None]
    return pack_batch(tokens, valid, cfg.packing, micro_batches=cfg.algorithm.micro_batches)["packed_tokens"].size


def _median_s(fn, repeats: int) -> float:
    """Median seconds of `fn()` (blocked on its outputs) over `repeats` runs after one warm-up."""
    import jax
    import numpy as np

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def packing_batch(rng, prompts: int = 16, group: int = 8, new_tokens: int = 128, vocab: int = 64):
    """A GRPO batch shaped like a random-init model's rollouts of 2-digit `a+b=` prompts: each
    completion ends at the first eos, drawn with probability 1/vocab per token, or at new_tokens."""
    import numpy as np

    b, prompt = prompts * group, 6  # bos + "ab+cd=" style prompts, padded to the longest
    t = prompt + new_tokens
    lens = np.minimum(rng.geometric(1.0 / vocab, b), new_tokens)
    valid = np.arange(t)[None, :] < (prompt + lens)[:, None]
    loss_mask = (valid & (np.arange(t)[None, :] >= prompt)).astype(np.float32)
    lp = np.where(loss_mask > 0, -np.log(vocab) + 0.1 * rng.normal(size=(b, t)), 0.0).astype(np.float32)
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    tokens[:, :prompt] = np.repeat(tokens[::group, :prompt], group, axis=0)  # a group's samples share its prompt
    return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask,
            "advantages": rng.normal(size=b).astype(np.float32), "ref_logprobs": lp, "rollout_logprobs": lp}


# `--packing --size`: bench_vs_trl's model sizes, its Hugging Face config fields as ModelConfig's.
HF_TO_MODEL_CONFIG = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                      "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                      "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim"}


def _bench_vs_trl_sizes() -> dict:
    """bench_vs_trl's SIZES (its module imports only the standard library at its top)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from bench_vs_trl import SIZES

    return SIZES


def packing_arch(size: str) -> dict:
    """bench_vs_trl's model of `size` as ModelConfig fields."""
    hf_config = _bench_vs_trl_sizes()[size]
    return {ours: hf_config[hf] for hf, ours in HF_TO_MODEL_CONFIG.items()}


def packing_child(steps: int, row_buckets: int | None, remat: str = "dots", unroll_layers: int = 1,
                  query_blocks: int = 3, size: str = "4m") -> dict:
    """Update and reference-logprobs seconds, padded vs packed, on one device (see the docstring)."""
    import jax
    import numpy as np
    from flax import nnx

    from tpurl.models import init_model, preset
    from tpurl.plan.calibrate import model_matmuls_seconds
    from tpurl.train.config import OptimizerConfig, algorithm_preset
    from tpurl.train.logprobs import make_logprob_fn
    from tpurl.train.packing import PackingConfig, pack_batch
    from tpurl.train.state import init_train_state
    from tpurl.train.step import make_train_step

    arch = packing_arch(size)
    mc = preset("tiny-qwen3", vocab_size=64, **arch, remat=remat, unroll_layers=unroll_layers,
                attention_query_blocks=query_blocks)
    model = init_model(mc, 0)
    graphdef, params = nnx.split(model)
    algo, opt = algorithm_preset("grpo", group_size=8, kl_coef=0.04), OptimizerConfig(lr=1e-4)
    batch = packing_batch(np.random.default_rng(0))
    packing = PackingConfig() if row_buckets is None else PackingConfig(row_buckets=row_buckets)
    rows, row_length = pack_batch(batch["tokens"], batch["valid"], packing)["packed_tokens"].shape
    out = {"config": f"bench_vs_trl's {size} model (vocab 64, D {arch['hidden_size']}, {arch['num_layers']} layers), "
                     "16 x 8 sequences, 128 new tokens, GRPO + KL",
           "remat": remat, "unroll_layers": unroll_layers, "attention_query_blocks": query_blocks,
           "params": mc.num_params(), "rows_padded": batch["tokens"].shape[0], "rows_packed": rows,
           "row_length": batch["tokens"].shape[1], "packed_row_length": row_length, "row_buckets": packing.row_buckets,
           "mean_completion_tokens": float(batch["loss_mask"].sum(1).mean()),
           "valid_token_frac": float(batch["valid"].mean())}
    for name, pack in (("padded", None), ("packed", packing)):
        score = make_logprob_fn(graphdef, temperature=algo.temperature, packing=pack)
        out[f"logprobs_{name}_s"] = _median_s(lambda: score(params, batch["tokens"], batch["valid"]), steps)
        step = make_train_step(graphdef, algo, opt, packing=pack)
        state = {"s": init_train_state(params, opt)}

        def update():
            state["s"], metrics = step(state["s"], batch)
            return metrics

        out[f"update_{name}_s"] = _median_s(update, steps)
    out["logprobs_speedup"] = out["logprobs_padded_s"] / out["logprobs_packed_s"]
    out["update_speedup"] = out["update_padded_s"] / out["update_packed_s"]
    out["update_matmuls_s"] = model_matmuls_seconds(mc, rows * row_length, backward=True, reps=steps)
    out["update_packed_over_matmuls"] = out["update_packed_s"] / out["update_matmuls_s"]
    out.update(backend=jax.default_backend(), device_count=len(jax.devices()))
    return out


def _run_child(devices: int, args, consistency: str = "fast") -> dict | int:
    """One `child` in a fresh process with `devices` fake devices: its JSON, or its exit status."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, __file__, "--child", str(devices), "--steps", str(args.steps),
                          "--remat", args.remat, "--unroll-layers", str(args.unroll_layers),
                          "--consistency", consistency], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return out.returncode
    return json.loads(out.stdout.strip().splitlines()[-1])


def bitwise_summary(args) -> int:
    """The one-device step in fast and in bitwise mode, one after the other; prints JSON."""
    runs = {}
    for mode in ("fast", "bitwise"):
        result = _run_child(1, args, mode)
        if isinstance(result, int):
            return result
        runs[mode] = result
    fast, bitwise = runs["fast"]["phases_s"], runs["bitwise"]["phases_s"]
    print(json.dumps({
        "config": "~4M params, 16 prompts x 8 samples, 3-digit addition, GRPO + KL to reference, one device",
        "phases_fast_s": fast, "phases_bitwise_s": bitwise,
        "bitwise_over_fast": {k: bitwise[k] / fast[k] for k in fast if k in bitwise and fast[k] > 0},
        "mismatch_abs_diff_max": {mode: r["mismatch_abs_diff_max"] for mode, r in runs.items()}}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one compile step); the median is reported")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--remat", default="dots", choices=("none", "dots", "full"),
                        help="the model's remat policy (dots: keep matmul outputs, recompute the elementwise "
                             "ops; no extra matmul FLOPs, and on CPU fewer stacked residuals than none)")
    parser.add_argument("--unroll-layers", type=int, default=1,
                        help="ModelConfig.unroll_layers: layers per layer-scan iteration in the update and scoring "
                             "forwards (the model's layer count, 4 or 8 with --size 30m: straight-line code)")
    parser.add_argument("--packing", action="store_true",
                        help="compare the update and logprobs phases padded vs packed at 128 new tokens instead")
    parser.add_argument("--size", default=None, choices=sorted(_bench_vs_trl_sizes()),
                        help="--packing's model: bench_vs_trl's 4m (the default) or 30m one")
    parser.add_argument("--row-buckets", type=int, default=None,
                        help="PackingConfig.row_buckets for --packing (default: its default)")
    parser.add_argument("--attention-query-blocks", type=int, default=3,
                        help="ModelConfig.attention_query_blocks of --packing's model (1: one attention "
                             "product over all keys; the colocated-step runs keep the default)")
    parser.add_argument("--bitwise", action="store_true",
                        help="compare the one-device step in fast and bitwise mode (ModelConfig.consistency) instead")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--consistency", default="fast", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size is not None and not args.packing:
        parser.error("--size is --packing's model: add --packing (the colocated-step runs use their own ~4M model)")
    if args.packing:
        print(json.dumps(packing_child(args.steps, args.row_buckets, args.remat, args.unroll_layers,
                                       args.attention_query_blocks, args.size or "4m")))
        return 0
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps, args.remat, args.unroll_layers, args.consistency)))
        return 0
    if args.bitwise:
        return bitwise_summary(args)
    results = {}
    for n in args.devices:
        result = _run_child(n, args)
        if isinstance(result, int):
            return result
        results[f"{n}_device" + ("s" if n > 1 else "")] = result
    summary = {"config": "~4M params, 16 prompts x 8 samples, 3-digit addition, GRPO + KL to reference, colocated",
               "target_ratio_one_device": 1.5, "results": results}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_step")
    sys.exit(main())
