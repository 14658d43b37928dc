"""MoE experts benchmark: the dropless grouped computation vs every expert on every token, masked.

`tpurl.models.moe.grouped_experts` (the T x K (token, expert) pairs sorted by expert, three
`jax.lax.ragged_dot` grouped matmuls, unsorted) against `dense_experts` (all E experts on all T
tokens, masked by the routes), on the same inputs and the same routes, fp32, one device. Routes come
from a random router (`tpurl.models.moe.route`, softmax, top-K, renormalized), so the experts' loads
are uneven. Both are compiled first; each is run once untimed (those outputs give the correctness
check), then `--repeats` timed runs of the two alternate (the order flips every round, so load from
other processes hits both alike) and the best of each is kept. Prints one JSON document (progress
goes to stderr):

  backend, devices, dtype, matmul_rate     the device, and its fp32 1024^3 matmul FLOP/s (this run)
  results[]: per size
    size, tokens T, embed D, expert_mlp F, experts E, experts_per_token K
    routing       tokens_per_expert_min / _max / _mean, max_over_mean: the groups' sizes
    forward, forward_backward   (the backward: gradients w.r.t. the input and the three expert
                  weights of sum(out * a fixed random cotangent)); each with, for v in grouped, dense:
      v_s                 best seconds of one call
      v_tokens_per_s      T / v_s
      v_flops             the expert matmuls' FLOPs v performs, counted: grouped 6*T*K*D*F forward
                          (gate, up, down on the K routed experts per token), dense 6*T*E*D*F (E/K
                          times that); x3 with the backward. The dense combine (2*T*E*D) and the
                          elementwise work are not counted
      v_xla_flops         XLA's cost_analysis() "flops" of the compiled program
      v_xla_over_counted  v_xla_flops / v_flops
      v_xla_flops_per_s   v_xla_flops / v_s: the rate the device sustained on what it ran
      grouped_over_dense  grouped_tokens_per_s / dense_tokens_per_s (> 1: grouped is faster)
      max_abs_diff, max_abs   the largest |grouped - dense| over the outputs (forward) or over the
                          four gradients (forward_backward), and the largest |value| for scale
  xla_flops_note          what XLA's count for ragged_dot means on this backend
  wall_s

On CPU, jax lowers `ragged_dot` through its reference expansion (`_ragged_dot_general_impl`: the
rows broadcast to every group, masked, one dot over all groups), so XLA counts, and the device
runs, E x the active FLOPs: K x the dense-masked computation's. `grouped_xla_over_counted` shows it;
the counted FLOPs are what a grouped kernel would do (TPU's native ragged_dot lowering).

Sizes (D=512, F=256: Qwen3-30B-A3B's layer scaled to CPU): e8k2 (8 experts, 2 per token, 2048
tokens), e32k4 (32, 4, 2048 tokens), e128k8 (Qwen3-30B-A3B's 128 experts, 8 per token, 256 tokens:
on CPU its grouped program does T*K*E*D*F work, 64x e8k2's per token). Default run: 2.5 minutes
on 2 CPU cores: `PYTHONPATH=. python scripts/bench_moe.py [--sizes e8k2,e32k4,e128k8]
[--tokens T] [--repeats N]`; `--tiny` runs a seconds-fast size (D=32, F=16, E=4, K=2, T=64).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.models.moe import dense_experts, grouped_experts, route
from tpurl.plan.calibrate import matmul_rate

SIZES = {
    "e8k2": dict(embed=512, expert_mlp=256, experts=8, experts_per_token=2, tokens=2048),
    "e32k4": dict(embed=512, expert_mlp=256, experts=32, experts_per_token=4, tokens=2048),
    "e128k8": dict(embed=512, expert_mlp=256, experts=128, experts_per_token=8, tokens=256),
    "tiny": dict(embed=32, expert_mlp=16, experts=4, experts_per_token=2, tokens=64),
}
DEFAULT_SIZES = "e8k2,e32k4,e128k8"
VARIANTS = {"grouped": grouped_experts, "dense": dense_experts}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def inputs(size: dict, seed: int = 0) -> dict:
    """Random fp32 tokens, expert weights (fan-in scaled), a random router's routes and a cotangent."""
    t, d, f, e, k = (size[n] for n in ("tokens", "embed", "expert_mlp", "experts", "experts_per_token"))
    keys = jax.random.split(jax.random.key(seed), 6)
    h = jax.random.normal(keys[0], (t, d), jnp.float32)
    w_router = jax.random.normal(keys[1], (d, e), jnp.float32) * d**-0.5
    weights, experts, _ = route(h, w_router, k, True)
    return {"h": h, "weights": weights, "experts": experts,
            "w_gate": jax.random.normal(keys[2], (e, d, f), jnp.float32) * d**-0.5,
            "w_up": jax.random.normal(keys[3], (e, d, f), jnp.float32) * d**-0.5,
            "w_down": jax.random.normal(keys[4], (e, f, d), jnp.float32) * f**-0.5,
            "cotangent": jax.random.normal(keys[5], (t, d), jnp.float32)}


def programs(fn, x: dict) -> dict:
    """The compiled forward and forward+backward of one experts function, with their arguments."""
    args = (x["h"], x["weights"], x["experts"], x["w_gate"], x["w_up"], x["w_down"], x["cotangent"])

    def forward(h, weights, experts, wg, wu, wd, ct):
        return fn(h, weights, experts, wg, wu, wd)

    def loss(h, wg, wu, wd, weights, experts, ct):
        return jnp.sum(fn(h, weights, experts, wg, wu, wd) * ct)

    def forward_backward(h, weights, experts, wg, wu, wd, ct):
        # The loss too: without it the down projection's forward is dead code (the loss is linear
        # in it), where a layer's output in a model is not.
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(h, wg, wu, wd, weights, experts, ct)

    return {phase: jax.jit(p).lower(*args).compile() for phase, p in
            (("forward", forward), ("forward_backward", forward_backward))}, args


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def counted_flops(size: dict, variant: str, phase: str) -> int:
    """The expert matmuls' FLOPs (see the module docstring)."""
    rows = size["experts_per_token"] if variant == "grouped" else size["experts"]
    forward = 3 * 2 * size["tokens"] * rows * size["embed"] * size["expert_mlp"]
    return forward * (3 if phase == "forward_backward" else 1)


def max_abs_diff(a, b) -> tuple[float, float]:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))
    return diff, max(float(jnp.max(jnp.abs(x))) for x in a)


def bench_size(name: str, size: dict, repeats: int) -> dict:
    x = inputs(size)
    t, e = size["tokens"], size["experts"]
    loads = np.bincount(np.asarray(x["experts"]).reshape(-1), minlength=e)
    out = {"size": name, "tokens": t, "embed": size["embed"], "expert_mlp": size["expert_mlp"], "experts": e,
           "experts_per_token": size["experts_per_token"],
           "routing": {"tokens_per_expert_min": int(loads.min()), "tokens_per_expert_max": int(loads.max()),
                       "tokens_per_expert_mean": float(loads.mean()),
                       "max_over_mean": float(loads.max() / loads.mean())}}
    compiled, args = {}, None
    for variant, fn in VARIANTS.items():
        start = time.perf_counter()
        compiled[variant], args = programs(fn, x)
        log(f"[{name}] {variant} compiled in {time.perf_counter() - start:.1f}s")
    for phase in ("forward", "forward_backward"):
        # One untimed run each (first-run costs; its results are the correctness check).
        results = {v: jax.block_until_ready(compiled[v][phase](*args)) for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(repeats):
            for v in (tuple(VARIANTS) if r % 2 == 0 else tuple(reversed(VARIANTS))):
                start = time.perf_counter()
                jax.block_until_ready(compiled[v][phase](*args))
                times[v].append(time.perf_counter() - start)
        row: dict = {}
        for v in VARIANTS:
            seconds = min(times[v])
            row[f"{v}_s"] = seconds
            row[f"{v}_tokens_per_s"] = t / seconds
            row[f"{v}_flops"] = counted_flops(size, v, phase)
            row[f"{v}_xla_flops"] = xla_flops(compiled[v][phase])
            row[f"{v}_xla_over_counted"] = row[f"{v}_xla_flops"] / row[f"{v}_flops"]
            row[f"{v}_xla_flops_per_s"] = row[f"{v}_xla_flops"] / seconds
        row["grouped_over_dense"] = row["grouped_tokens_per_s"] / row["dense_tokens_per_s"]
        compared = {v: r if phase == "forward" else r[1] for v, r in results.items()}  # the gradients
        row["max_abs_diff"], row["max_abs"] = max_abs_diff(compared["grouped"], compared["dense"])
        out[phase] = row
        log(f"[{name}] {phase}: grouped {row['grouped_s'] * 1e3:.1f} ms, dense {row['dense_s'] * 1e3:.1f} ms, "
            f"grouped/dense speed {row['grouped_over_dense']:.2f}x, XLA flops grouped "
            f"{row['grouped_xla_over_counted']:.1f}x its counted, diff {row['max_abs_diff']:.2e}")
    return out


def xla_note(results: list[dict]) -> str:
    """What the grouped programs' XLA FLOP counts say, from the counts themselves: near E x the
    active FLOPs means ragged_dot ran as every row against every group, masked."""
    parts = []
    for r in results:
        ratio = r["forward"]["grouped_xla_over_counted"]
        kind = ("every row against every group, masked" if ratio > max(2.0, 0.5 * r["experts"])
                else "close to the active FLOPs: a grouped kernel")
        parts.append(f"{r['size']} {ratio:.1f}x ({kind}; E={r['experts']})")
    return (f"grouped_xla_flops is XLA's cost_analysis() count for the compiled ragged_dot program on "
            f"{jax.default_backend()}, reported as XLA gives it, not the counted active FLOPs: forward "
            + ", ".join(parts) + ". On CPU jax lowers ragged_dot through its reference expansion "
            "(lax._ragged_dot_general_impl: the rows broadcast to every group and masked, one dot over all "
            "groups), so E x the active FLOPs is what the device runs there")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated, from {sorted(SIZES)}; default {DEFAULT_SIZES}")
    parser.add_argument("--tokens", type=int, default=None, help="tokens T for every size (default: each size's own)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each variant (best kept); default 3, "
                        "1 with --tiny")
    parser.add_argument("--tiny", action="store_true", help="the seconds-fast size alone (for the test)")
    args = parser.parse_args(argv)
    sizes = ["tiny"] if args.tiny and args.sizes is None else [
        s.strip() for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {sorted(SIZES)}")
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 3)
    if repeats < 1:
        parser.error(f"--repeats {repeats} must be >= 1")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens {args.tokens} must be >= 1")
    start = time.perf_counter()
    rate = matmul_rate()
    log(f"fp32 1024^3 matmul rate {rate / 1e9:.0f} GFLOP/s")
    results = []
    for s in sizes:
        size = dict(SIZES[s], **({"tokens": args.tokens} if args.tokens is not None else {}))
        results.append(bench_size(s, size, repeats))
    print(json.dumps({"backend": jax.default_backend(), "devices": len(jax.devices()), "dtype": "float32",
                      "matmul_rate": rate, "repeats": repeats, "results": results, "xla_flops_note": xla_note(results),
                      "wall_s": time.perf_counter() - start}, indent=2))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_moe")
    sys.exit(main())
