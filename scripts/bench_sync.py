"""Weight sync benchmark: reshard train -> rollout vs. a plain device-to-device copy vs. disk.

For models of about 10M, 50M and 200M parameters (tiny-preset shapes), with fp32 master weights
in the train layout (FSDP x TP) and bf16 rollout weights in the rollout layout (TP with replicas)
on one (data=1, fsdp=4, tensor=2) mesh of 8 devices, prints one JSON object with, per model:

  reshard_s         the sync as tpurl does it (`sync_weights`, the method `auto` picks), best of N
  reshard_<method>  each method's best time
  copy_d2d_s        a plain device-to-device copy of the same bytes: every device sends each of
                    its shards of the bf16 rollout params (already in the rollout layout) to the
                    next device, one jitted collective permute (`ppermute`), best of N
  copy_local_s      a device-local copy of those bytes (jitted copy; one memcpy per device)
  copy_floor_s      the faster of the two: the cheapest way this backend writes those bytes
  disk_s            the orbax checkpoint write + restore into the rollout shardings, best of >= 2
  reshard_over_floor, disk_over_reshard   the ratios (targets: <= 1.5 and >= 20)

Run: `python scripts/bench_sync.py [--sizes 10m,50m,200m] [--repeats N] [--mesh 1,-1,2]`. Uses 8
fake CPU devices when no accelerator is present. On CPU every "device" is the same host memory, so a
"transfer" is a memcpy and the numbers measure software overhead and memory bandwidth, not
interconnect.

`--cross_process` measures disaggregated placement instead (train pool `fsdp_tp` on a (1, 2, 2)
mesh of 4 devices, rollout pool `tp_replicas` on a (2, 1, 2) mesh of 4 others), per model:

  single_process_device_put_s  both pools in this process (8 devices), `device_put` (what auto picks)
  single_process_permute_s     both pools in this process, `permute` (one collective permute)
  cross_process_permute_s      the pools in two processes (`tpurl.commands.launch`, 2 x 4 fake CPU devices,
                               gloo): process 0 trains, process 1 generates; the slower process's
                               best time (auto picks `permute` there)
  cross_over_single            cross_process_permute_s / single_process_device_put_s

Run: `python scripts/bench_sync.py --cross_process [--sizes 10m,50m] [--repeats N]` (CPU only: the
two processes get fake CPU devices).

`--lora RANK` measures a LoRA model's syncs instead (adapters of rank RANK on all seven
projections, fp32; the base frozen in bf16), in the same layouts and mesh, per model:

  full_s, full_bytes            the full fine-tune's sync (fp32 masters -> bf16 rollout weights)
  merged_s, merged_bytes        `SyncConfig.adapters="merged"`: W + scale * A @ B computed inside the
                                resharding programs, the targeted projections moved
  unmerged_s, unmerged_bytes    `adapters="unmerged"`: the adapters alone moved (the base synced once)
  full_over_unmerged_bytes, full_over_merged_bytes   the byte ratios (target: unmerged >> 10x)

Run: `python scripts/bench_sync.py --lora 16 [--sizes 50m] [--repeats N]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from tpurl.commands.launch import launch  # noqa: E402
from tpurl.models import abstract_model, preset  # noqa: E402
from tpurl.models.lora import LoraConfig, adapter_state, base_state  # noqa: E402
from tpurl.models.transformer import Transformer  # noqa: E402
from tpurl.sharding.distributed import DistributedConfig, initialize  # noqa: E402
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh  # noqa: E402
from tpurl.sharding.placement import PlacementConfig, make_placement
from tpurl.sync import reshard  # noqa: E402
from tpurl.sync.disk import disk_sync  # noqa: E402
from tpurl.sync.config import SyncConfig  # noqa: E402
from tpurl.sync.reshard import sync_weights  # noqa: E402

_TP = ("heads", "kv_heads", "mlp", "vocab")
TRAIN = Layout(name="fsdp_tp", rules=(("embed", ("fsdp",)),) + tuple((t, ("tensor",)) for t in _TP))
ROLLOUT = Layout(name="tp_replicas", rules=tuple((t, ("tensor",)) for t in _TP))

SIZES = {
    "10m": dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=32),
    "50m": dict(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=64),
    "200m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=9, num_heads=16,
                 num_kv_heads=8, head_dim=64),
}
# More timed runs where they are cheap: on a shared host the best of a few is the stable number.
DEFAULT_REPEATS = {"10m": 7, "50m": 5, "200m": 3}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def train_params(cfg, mesh):
    """fp32 params created directly in the train layout (no single-device copy of the model)."""
    abstract = nnx.state(abstract_model(cfg))
    shardings = TRAIN.param_shardings(abstract, mesh)
    init = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=0))), out_shardings=shardings)
    return init(), abstract


def ring_copy(tree, mesh: Mesh):
    """A jitted copy in which every device's shard of every leaf of `tree` moves to the next device
    of the mesh (device i -> i+1): a device-to-device copy of exactly the resident bytes."""
    axes, n = tuple(mesh.axis_names), mesh.devices.size
    perm = [(i, (i + 1) % n) for i in range(n)]
    leaves, treedef = jax.tree.flatten(tree)
    # check_vma off: a replicated leaf's copies differ after the shift; only the bytes matter here.
    shifts = [jax.shard_map(lambda s: jax.lax.ppermute(s, axes, perm), mesh=mesh, in_specs=x.sharding.spec,
                            out_specs=x.sharding.spec, check_vma=False) for x in leaves]
    return jax.jit(lambda t: jax.tree.unflatten(treedef, [f(x) for f, x in zip(shifts, jax.tree.leaves(t))]))


def bench_size(name: str, mesh: Mesh, repeats: int, bucket_bytes: int) -> dict:
    cfg = preset("tiny", **SIZES[name])
    params, abstract = train_params(cfg, mesh)
    shardings = ROLLOUT.param_shardings(abstract, mesh)
    base = SyncConfig(rollout_dtype="bfloat16", bucket_bytes=bucket_bytes)
    out: dict = {"model": name, "params": cfg.num_params(), "repeats": repeats}

    times = reshard.calibrate(params, shardings, base, repeats=repeats)
    for method, seconds in times.items():
        out[f"reshard_{method}_s"] = seconds
    rollout, report = sync_weights(params, shardings, base)
    out.update(method=report.method, reshard_s=times[report.method], bytes_moved=report.bytes_moved,
               buckets=report.buckets, max_bucket_bytes=report.max_bucket_bytes)
    resident = sum(x.addressable_shards[0].data.nbytes * len(x.sharding.device_set)
                   for x in jax.tree.leaves(rollout))
    out["rollout_resident_bytes"] = resident
    log(f"[{name}] reshard {times}")

    # The floor: the same resident rollout bytes copied device-to-device, every device sending
    # each of its shards to the next device (a collective permute).
    ring = ring_copy(rollout, mesh)
    out["copy_d2d_s"] = best_of(lambda: ring(rollout), repeats)
    local_copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    out["copy_local_s"] = best_of(lambda: local_copy(rollout), repeats)
    out["copy_floor_s"] = min(out["copy_d2d_s"], out["copy_local_s"])
    log(f"[{name}] copy d2d {out['copy_d2d_s']:.4f}s local {out['copy_local_s']:.4f}s")
    del rollout

    disk_times = []
    for _ in range(max(2, repeats // 2)):  # the first run of a process pays orbax's start-up
        with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
            restored, disk_report = disk_sync(params, shardings, base, directory=tmp)
            disk_times.append(disk_report.seconds)
            del restored
    out["disk_s"] = min(disk_times)
    log(f"[{name}] disk {out['disk_s']:.3f}s")

    out["reshard_over_floor"] = out["reshard_s"] / out["copy_floor_s"]
    out["reshard_over_d2d_copy"] = out["reshard_s"] / out["copy_d2d_s"]
    out["disk_over_reshard"] = out["disk_s"] / out["reshard_s"]
    out["meets_targets"] = out["reshard_over_floor"] <= 1.5 and out["disk_over_reshard"] >= 20
    return out


def bench_lora(name: str, mesh: Mesh, repeats: int, bucket_bytes: int, rank: int) -> dict:
    """The full, merged and unmerged syncs of `name` with rank-`rank` adapters, side by side."""
    from tpurl.sync.lora import LoraRollout

    cfg = preset("tiny", **SIZES[name]).replace(lora=LoraConfig(rank=rank, base_dtype="bfloat16"))
    params, abstract = train_params(cfg, mesh)
    sync_cfg = SyncConfig(rollout_dtype="bfloat16", bucket_bytes=bucket_bytes)
    out: dict = {"model": name, "params": cfg.num_params(), "adapter_params": cfg.adapter_params(), "rank": rank,
                 "repeats": repeats}
    full_params = base_state(params)
    full_shardings = ROLLOUT.param_shardings(base_state(abstract), mesh)
    out["full_s"] = best_of(lambda: sync_weights(full_params, full_shardings, sync_cfg)[0], repeats)
    out["full_bytes"] = sync_weights(full_params, full_shardings, sync_cfg)[1].bytes_moved
    adapters = adapter_state(params)
    frozen = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base_state(params))
    for form in ("merged", "unmerged"):
        model = cfg.replace(lora=None) if form == "merged" else cfg
        shardings = ROLLOUT.param_shardings(nnx.state(abstract_model(model)), mesh)
        lora = LoraRollout(cfg.lora, form, shardings, sync_cfg)
        lora.set_base(frozen)
        out[f"{form}_s"] = best_of(lambda: lora.sync(adapters)[0], repeats)
        out[f"{form}_bytes"] = lora.sync(adapters)[1].bytes_moved
        log(f"[{name}] lora {form}: {out[f'{form}_s']:.4f}s, {out[f'{form}_bytes']} bytes")
    for form in ("merged", "unmerged"):
        out[f"full_over_{form}_bytes"] = out["full_bytes"] / out[f"{form}_bytes"]
        out[f"full_over_{form}_s"] = out["full_s"] / out[f"{form}_s"]
    return out


POOLS = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4, device_split="in_order",
                        train_mesh=MeshConfig(shape=(1, 2, 2)), rollout_mesh=MeshConfig(shape=(2, 1, 2)))


def bench_pools(name: str, methods: tuple[str, ...], repeats: int, bucket_bytes: int) -> dict:
    """Best sync seconds per method between the disaggregated pools of `POOLS` (every process of
    a multi-process run calls this together)."""
    cfg = preset("tiny", **SIZES[name])
    placement = make_placement(POOLS)
    params, abstract = train_params(cfg, placement.train_mesh)
    shardings = ROLLOUT.param_shardings(abstract, placement.rollout_mesh)
    out: dict = {"model": name, "params": cfg.num_params(), "repeats": repeats}
    for method in methods:
        sub = SyncConfig(rollout_dtype="bfloat16", method=method, bucket_bytes=bucket_bytes)
        sync_weights(params, shardings, sub)  # compile
        times = []
        for _ in range(repeats):
            rollout, report = sync_weights(params, shardings, sub)
            times.append(report.seconds)
            del rollout
        out[f"{method}_s"], out[f"{method}_method"] = min(times), report.method
        out["bytes_moved"] = report.bytes_moved
    return out


def cross_process_worker(out_dir: str, sizes: list[str], repeats: int | None, bucket_bytes: int) -> int:
    """One of the two processes of `--cross_process`: the "auto" sync between pools on two processes."""
    initialize(DistributedConfig(mode="on"))
    results = [bench_pools(s, ("auto",), repeats or DEFAULT_REPEATS[s], bucket_bytes) for s in sizes]
    with open(os.path.join(out_dir, f"p{jax.process_index()}.json"), "w") as f:
        json.dump(results, f)
    jax.distributed.shutdown()
    return 0


def cross_process_main(sizes: list[str], repeats: int | None, bucket_bytes: int) -> int:
    """Both pools in this process, then in two processes (launched here); one JSON object."""
    if jax.default_backend() != "cpu" or len(jax.devices()) < 8:
        raise SystemExit("--cross_process runs on 8 fake CPU devices; unset JAX_PLATFORMS and XLA_FLAGS")
    start = time.perf_counter()
    single = {s: bench_pools(s, ("device_put", "permute"), repeats or DEFAULT_REPEATS[s], bucket_bytes)
              for s in sizes}
    log(f"single process: {single}")
    with tempfile.TemporaryDirectory(prefix="bench_sync_xp_") as tmp:
        args = ["--_worker_dir", tmp, "--sizes", ",".join(sizes), "--bucket_mib", str(bucket_bytes // 2**20)]
        args += ["--repeats", str(repeats)] if repeats else []
        with contextlib.redirect_stdout(sys.stderr):  # the workers' lines; stdout keeps only the JSON
            status = launch(args, num_processes=2, devices_per_process=4,
                            env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                            program=(sys.executable, os.path.abspath(__file__)))
        if status:
            raise SystemExit(f"the cross-process run failed (status {status})")
        procs = [json.load(open(os.path.join(tmp, f"p{i}.json"))) for i in range(2)]
    results = []
    for i, s in enumerate(sizes):
        row = {k: v for k, v in single[s].items() if not k.endswith("_method")}
        row = {("single_process_" + k if k.endswith("_s") else k): v for k, v in row.items()}
        row["cross_process_method"] = procs[1][i]["auto_method"]
        row["cross_process_permute_s"] = max(p[i]["auto_s"] for p in procs)
        row["cross_over_single"] = row["cross_process_permute_s"] / row["single_process_device_put_s"]
        results.append(row)
    print(json.dumps({"backend": jax.default_backend(), "placement": "disaggregated 4 train + 4 rollout devices",
                      "train_layout": TRAIN.name, "rollout_layout": ROLLOUT.name, "rollout_dtype": "bfloat16",
                      "bucket_bytes": bucket_bytes, "results": results, "wall_s": time.perf_counter() - start},
                     indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated, from {sorted(SIZES)}; default "
                        "10m,50m,200m (10m,50m with --cross_process)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per measurement (best is kept); default 7/5/3 for 10m/50m/200m")
    parser.add_argument("--bucket_mib", type=int, default=256)
    parser.add_argument("--mesh", default=None,
                        help="data,fsdp,tensor sizes (-1: the rest); default 1,-1,2, or 1,1,1 on a single device "
                             "(where the sync is a cast in place: layouts coincide)")
    parser.add_argument("--cross_process", action="store_true",
                        help="disaggregated pools in one process and in two processes (see the docstring)")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="a LoRA model's full, merged and unmerged syncs at this adapter rank (see the docstring)")
    parser.add_argument("--_worker_dir", default=None, help=argparse.SUPPRESS)  # a --cross_process worker
    args = parser.parse_args(argv)
    default_sizes = "10m,50m" if args.cross_process or args._worker_dir else "10m,50m,200m"
    sizes = [s.strip() for s in (args.sizes or default_sizes).split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {sorted(SIZES)}")
    if args._worker_dir:
        return cross_process_worker(args._worker_dir, sizes, args.repeats, args.bucket_mib * 2**20)
    if args.cross_process:
        return cross_process_main(sizes, args.repeats, args.bucket_mib * 2**20)
    if args.mesh is not None:
        try:
            shape = tuple(int(x) for x in args.mesh.split(","))
        except ValueError:
            parser.error(f"--mesh {args.mesh!r}: give three integers, e.g. 1,-1,2")
    else:
        shape = (1, -1, 2) if len(jax.devices()) > 1 else (1, 1, 1)
    mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=shape))
    start = time.perf_counter()
    if args.lora is not None:
        results = [bench_lora(s, mesh, args.repeats or DEFAULT_REPEATS[s], args.bucket_mib * 2**20, args.lora)
                   for s in sizes]
    else:
        results = [bench_size(s, mesh, args.repeats or DEFAULT_REPEATS[s], args.bucket_mib * 2**20) for s in sizes]
    print(json.dumps({
        "backend": jax.default_backend(), "devices": len(jax.devices()), "mesh": dict(mesh.shape),
        "train_layout": TRAIN.name, "rollout_layout": ROLLOUT.name, "rollout_dtype": "bfloat16",
        "bucket_bytes": args.bucket_mib * 2**20, "results": results,
        "wall_s": time.perf_counter() - start,
    }, indent=2))
    return 0


if __name__ == "__main__":
    # Host memory and XLA:CPU's compile flags as `tpurl` sets them (tpurl/startup.py), before JAX starts.
    from tpurl.startup import apply_at_start

    apply_at_start("bench_sync")
    sys.exit(main())
