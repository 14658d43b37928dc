"""Measure this machine for the `cpu` preset of `tpurl plan` (a few seconds, once: `cpu_hardware`
caches the record in a file per host allocator mode).

    matmul_flops      fp32 rate of a 1024^3 matmul (the "peak")
    efficiency        the fraction of it tpurl's own model reaches in an update (forward + backward
                      of a 2-layer model on 256 x 16 tokens, FLOPs counted by `tpurl.plan.timing`)
    forward_efficiency  the same for a forward (scoring) pass alone
    memory_bandwidth  bytes/s reading a 64 MiB array
    launch_s          launching one small program and reading its result on the host
    decode_slot_s     seconds each live sequence adds to one decode step of tpurl's engine beyond
                      its FLOPs (sampling and bookkeeping: on CPU they outweigh a small model's math)
    sequence_s        seconds the engine spends admitting one sequence (prefill, insert, host work)
    sync_host_s       a sync phase's host work: `RolloutSide.load` of `MODEL` whose layouts already agree
                      (a free sync: it moves nothing but compares every leaf's layouts), timed as a
                      run times its sync phase, with the CPU caches cold as after an update (warm,
                      it takes half as long)
    host_malloc       the host allocator mode it was measured under (`tpurl.hostmem`; a cached
                      calibration of another mode is refused)

The accelerator presets take these from datasheets instead (`tpurl.plan.hardware.CHIPS`).
"""

from __future__ import annotations

import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpurl import hostmem
from tpurl.files import atomic_write_json
from tpurl.models.config import preset
from tpurl.models.transformer import init_model
from tpurl.plan.hardware import CALIBRATION_FIELDS, Hardware, cpu_chip
from tpurl.plan.timing import forward_flops, matmul_params

MODEL = preset("tiny", vocab_size=16, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
               num_kv_heads=4, head_dim=32, max_position_embeddings=64)


def best_seconds(fn, *args, reps: int = 5) -> float:
    """The fastest of `reps` timed calls (after one warm-up): the least disturbed by other work."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def model_rates(rows: int = 256, length: int = 16) -> tuple[float, float]:
    """FLOP/s of `MODEL`'s scoring forward pass and of its forward + backward, on `rows` rows of
    `length` tokens (FLOPs as the planner counts them)."""
    from tpurl.train.logprobs import token_logprobs

    graphdef, params = nnx.split(init_model(MODEL, 0))
    tokens, valid = jnp.zeros((rows, length), jnp.int32), jnp.ones((rows, length), bool)

    def score(p):
        return jnp.sum(token_logprobs((graphdef, p), tokens, valid)[0])

    flops = forward_flops(MODEL, rows, length)
    forward = flops / best_seconds(jax.jit(score), params, reps=3)
    update = 3 * flops / best_seconds(jax.jit(jax.grad(score)), params, reps=3)
    return forward, update


def engine_seconds(rate: float, slots: int = 128) -> tuple[float, float]:
    """`(per sequence per decode step, per sequence admitted)`: what the engine spends beyond the
    FLOPs at `rate`, from `slots` sequences generating 4 and 12 tokens (the best of 3 each): the
    slope per step and the intercept (prefill, insert and their host work) per sequence."""
    from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate

    graphdef, params = nnx.split(init_model(MODEL, 0))
    engine = Engine(MODEL, EngineConfig(max_slots=slots, max_seq_len=32, prefill_buckets=(8,)), graphdef=graphdef)
    prompts = [[1, 2, 3, 4, 5, 6]] * (slots // 8)
    timed = {4: [], 12: []}
    for n in (4, 12) * 4:  # the first pair compiles
        t0 = time.perf_counter()
        generate(engine, params, prompts, n_samples=8, sampling=SamplingConfig(max_new_tokens=n), seed=0)
        timed[n].append(time.perf_counter() - t0)
    short, long_ = min(timed[4][1:]), min(timed[12][1:])
    per_step = (long_ - short) / 8
    step_flops = 2.0 * matmul_params(MODEL) * slots
    per_slot = max(0.0, (per_step - step_flops / rate) / slots)
    # The first token comes from the prefill: 4 tokens are 3 decode steps.
    admitted = max(0.0, (short - 3 * per_step) / slots)
    return per_slot, admitted


def sync_host_seconds(reps: int = 50) -> float:
    """Seconds of a free sync phase of `MODEL` (see the module docstring): the median of `reps`, since
    a fraction of a millisecond of host work varies more with the machine's state than with the work."""
    from tpurl.rl.loop import freeze_heap
    from tpurl.rl.rollout import RolloutSide
    from tpurl.rl.step import memory_timeline
    from tpurl.sync import SyncConfig
    from tpurl.tasks import AdditionConfig, AdditionTask

    params = nnx.state(init_model(MODEL, 0), nnx.Param)
    # The rollout side of a run whose layouts agree (no engine: loading weights does not use it).
    rollout = RolloutSide(None, jax.tree.map(lambda x: x.sharding, params), SyncConfig(rollout_dtype=None),
                      AdditionTask(AdditionConfig(digits=1, num_eval=4)), seq_len=8)
    freeze_heap()  # as a run does before its first step
    try:
        times = []
        evict = np.ones(2**24, np.float32)  # 64 MiB: a run's sync follows the update, its caches cold
        for version in range(reps):
            evict += 1.0
            tl, _ = memory_timeline()
            with tl.phase("sync") as res:  # as `tpurl.rl.step` times its sync
                rollout.load(params, version=version)
                res.value = rollout.params
            times.append(tl.seconds["sync"])
    finally:
        gc.unfreeze()
    return float(np.median(times))


def model_matmuls(mc, rows: int, *, backward: bool):
    """`(fn, args)`: just the matmuls of `mc`'s forward over `rows` tokens (and of its backward too
    with `backward`), jitted: a skeleton with the model's projection shapes (q/k/v/o, the SwiGLU's
    three, the unembedding), each layer's weights their own arrays, and no attention, norms,
    activations, sampling or optimizer."""
    d, hq, hk = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = {"q": (d, hq), "k": (d, hk), "v": (d, hk), "o": (hq, d), "g": (d, mc.intermediate_size),
              "u": (d, mc.intermediate_size), "d": (mc.intermediate_size, d)}
    key = iter(jax.random.split(jax.random.key(0), len(shapes) * mc.num_layers + 3))
    ws = {"layers": [{name: 0.02 * jax.random.normal(next(key), shape) for name, shape in shapes.items()}
                     for _ in range(mc.num_layers)],
          "unembed": 0.02 * jax.random.normal(next(key), (d, mc.vocab_size))}

    def forward(ws, x):
        kv = []
        for w in ws["layers"]:
            kv += [x @ w["k"], x @ w["v"]]
            x = x + (x @ w["q"]) @ w["o"]
            x = x + ((x @ w["g"]) * (x @ w["u"])) @ w["d"]
        return x @ ws["unembed"], kv

    def backward_fn(ws, x, cotangents):
        # The forward's outputs (else XLA drops the matmuls whose results only a loss would read) and
        # the gradients of the weights and the input (a model's embedding needs the latter too),
        # pulled back from random cotangents (a constant one, a sum's, XLA would fold into sums).
        outs, pull_back = jax.vjp(forward, ws, x)
        return outs, pull_back(cotangents)

    # x is an argument: as a closed-over constant XLA would fold it at compile time.
    x = jax.random.normal(next(key), (rows, d))
    if not backward:
        return jax.jit(forward), (ws, x)
    outs = jax.eval_shape(forward, ws, x)
    keys = iter(jax.random.split(next(key), len(jax.tree.leaves(outs))))
    cotangents = jax.tree.map(lambda o: jax.random.normal(next(keys), o.shape), outs)
    return jax.jit(backward_fn), (ws, x, cotangents)


def model_matmuls_seconds(mc, rows: int, *, backward: bool, reps: int = 5) -> float:
    """Seconds of `model_matmuls` on this device, the best of `reps`. Next to a measured phase it
    splits the gap to the FLOP floor into the backend's matmul rate at these shapes (e.g. a decode
    step's few rows) and everything else."""
    fn, args = model_matmuls(mc, rows, backward=backward)
    return best_seconds(fn, *args, reps=reps)


def matmul_rate(n: int = 1024) -> float:
    """FLOP/s of an `n x n` fp32 matmul on the default device (best of a few)."""
    a = jnp.ones((n, n), jnp.float32)
    return 2 * n**3 / best_seconds(jax.jit(lambda x: x @ x), a)


def read_bandwidth(nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of reading an fp32 array of `nbytes` (a sum over it; best of a few)."""
    big = jnp.ones((nbytes // 4,), jnp.float32)
    return big.nbytes / best_seconds(jax.jit(jnp.sum), big)


def measure_cpu() -> dict[str, float | str]:
    """The calibration record (see the module docstring)."""
    peak, bandwidth = matmul_rate(), read_bandwidth()
    add = jax.jit(lambda v: v + 1.0)
    launch = best_seconds(lambda v: np.asarray(add(v)), jnp.ones((8,), jnp.float32), reps=50)
    forward, update = model_rates()
    per_slot, admitted = engine_seconds(forward)
    return {"matmul_flops": peak, "efficiency": min(1.0, update / peak), "forward_efficiency": min(1.0, forward / peak),
            "memory_bandwidth": bandwidth, "launch_s": launch, "decode_slot_s": per_slot, "sequence_s": admitted,
            "sync_host_s": sync_host_seconds(), "host_malloc": hostmem.applied_mode()}


def cpu_hardware(calibration_path: str | None = None, devices: int | None = None) -> Hardware:
    """The `cpu` preset: this machine's calibration (measured now and cached at `calibration_path`,
    default `cpu_calibration_path()`, when there is none) shared by `devices` JAX devices (default:
    all of them)."""
    path = calibration_path or cpu_calibration_path()
    n = jax.device_count() if devices is None else devices
    return Hardware("cpu", cpu_chip(cached_calibration(path), n, source=path), n)


def cpu_calibration_path() -> str:
    """The default calibration file, one per host allocator mode (`tpurl.hostmem`: the rates differ)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpurl", f"cpu_calibration_{hostmem.applied_mode()}.json")


def cached_calibration(path: str) -> dict:
    """The calibration at `path`; measured now (and written there atomically) when there is none or
    it lacks a field. One measured under another host allocator mode (`tpurl.hostmem`) is an error,
    not overwritten."""
    if os.path.exists(path):
        with open(path) as f:
            try:
                cal = json.load(f)
            except json.JSONDecodeError:
                raise ValueError(f"CPU calibration {path} is not JSON; delete it to measure again") from None
        if isinstance(cal, dict) and all(k in cal for k in (*CALIBRATION_FIELDS, "host_malloc")):
            if cal["host_malloc"] != hostmem.applied_mode():
                raise ValueError(f"CPU calibration {path} was measured with host_malloc={cal['host_malloc']!r}, "
                                 f"this process runs with {hostmem.applied_mode()!r} ({hostmem.ENV}, "
                                 "tpurl/hostmem.py); use a calibration of this mode or delete it to measure again")
            return cal
    cal = measure_cpu()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_json(path, cal)
    return cal
