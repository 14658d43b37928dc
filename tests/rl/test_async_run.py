"""Asynchronous RL end to end on 8 fake devices (4 train, 4 rollout), `max_staleness=1`: every
batch at most one version old (from the logged versions), the rollout of the next batch overlapping
the update in the logged timeline, the off-policy correction in the loss, exact resume, syncs that
land mid-decode (`in_flight="continue"`), the rollout on the main thread (`overlap="dispatch"`),
and the configurations it refuses."""

import os
import threading

import pytest

from tpurl.checkpoint import CheckpointConfig
from tpurl.logging import read_jsonl
from tpurl.rl import async_step, loop
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import EvalConfig, SFTConfig
from tpurl.rl.loop import prepare, run
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.train.config import algorithm_preset
from tpurl.train.correction import CorrectionConfig, correction_preset
from tpurl.train.packing import PackingConfig

from inflight_landing import pin_landings
from test_loop import MESH3, tiny_config

STEPS = 4
VOLATILE = ("time", "throughput/", "memory/", "compile/", "timeline/", "rollout_side/")
DISAGG = PlacementConfig(mode="disaggregated", train_devices=4, rollout_devices=4,
                         train_mesh=MeshConfig(axes=MESH3, shape=(1, 2, 2)),
                         rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 2)))


def async_config(run_dir, **overrides):
    base = dict(placement=DISAGG, async_rollout=AsyncConfig(max_staleness=1), steps=STEPS,
                algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.01, correction=correction_preset("tis")),
                sft=SFTConfig(steps=0), eval=EvalConfig(every_steps=0, pass_k=1),
                checkpoint=CheckpointConfig(every_steps=0, export_hf=False))
    base.update(overrides)
    return tiny_config(run_dir, **base)


def _logs(result):
    return (read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")),
            read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl")))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """The run, with each update held until the rollout thread has started the next batch: whether
    the threads overlap on their own depends on how a loaded machine schedules them, and the
    tests check what the logs record of an overlap (`scripts/bench_async.py` measures the gain)."""
    started = {step: threading.Event() for step in range(STEPS)}
    learning_started = {step: threading.Event() for step in range(STEPS)}
    sample, learn = async_step._sample, async_step.learn

    def sampling(rt, step, cursor, tl):  # batch k + 1 is sampled once update k has begun ...
        if step > 0:
            assert learning_started[step - 1].wait(120), f"the update of step {step - 1} never started"
        started[step].set()
        return sample(rt, step, cursor, tl)

    def learning(rt, train, ref, ro, step, tl, **kw):  # ... which ends after batch k + 1 has begun
        learning_started[step].set()
        if step + 1 < STEPS:
            assert started[step + 1].wait(120), f"the batch of step {step + 1} never started"
        return learn(rt, train, ref, ro, step, tl, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(async_step, "_sample", sampling)
        patch.setattr(async_step, "learn", learning)
        result = run(async_config(tmp_path_factory.mktemp("async")), verbose=False)
    assert not [t for t in threading.enumerate() if t.name == "tpurl-rollout"]
    return result


@pytest.mark.slow
def test_batches_are_at_most_one_version_old(async_run):
    metrics, traj = _logs(async_run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        trained = m["policy_version"]  # the version the update of this step starts from
        assert trained == m["step"] - 1
        assert trained - 1 <= m["staleness/version_min"] <= m["staleness/version_max"] <= trained
        # The first batch and the second are sampled by version 0, then one version behind.
        assert m["staleness/version_min"] == max(0, m["step"] - 2)
        assert m["staleness/max"] == min(1, m["step"] - 1)
    assert len(traj) == STEPS * 16
    for t in traj:  # every logged trajectory names the weights that sampled it
        assert (t["step"] - 1) - 1 <= t["policy_version"] <= t["step"] - 1
        assert t["policy_version"] == max(0, t["step"] - 2)


@pytest.mark.slow
def test_rollout_overlaps_the_update_in_the_timeline(async_run):
    metrics, _ = _logs(async_run)
    for m in metrics:
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k not in ("time/step_s", "time/other_s"))
        assert phases + m["time/other_s"] == pytest.approx(m["time/step_s"], rel=1e-9)
        assert m["timeline/step_start_s"] <= m["timeline/train_start_s"] <= m["timeline/train_end_s"]
        assert m["timeline/train_end_s"] == pytest.approx(m["timeline/step_end_s"])
        assert m["timeline/rollout_end_s"] <= m["timeline/train_start_s"]  # the batch was ready first
        for side in ("train", "rollout"):
            assert 0.0 <= m[f"timeline/{side}_idle_frac"] <= 1.0
    # Batch k + 1 is sampled while step k updates: their intervals intersect, by the overlap.
    for now, nxt in zip(metrics[:-1], metrics[1:]):
        lo = max(now["timeline/train_start_s"], nxt["timeline/rollout_start_s"])
        hi = min(now["timeline/train_end_s"], nxt["timeline/rollout_end_s"])
        assert hi > lo and now["timeline/overlap_s"] >= hi - lo - 1e-6
    assert "time/publish_s" in metrics[0] and "time/sync_s" in metrics[-1]  # the segment ends synced
    assert all("rollout_side/rollout_s" in m for m in metrics)


@pytest.mark.slow
def test_the_loss_corrects_the_stale_batches(async_run, tmp_path):
    metrics, traj = _logs(async_run)
    # The truncated weights proximal / behaviour differ from 1 once batches are stale.
    fresh, stale = metrics[0]["correction/weight_mean"], metrics[1]["correction/weight_mean"]
    assert abs(fresh - 1.0) < 1e-4 and abs(stale - 1.0) > 1e-3
    # The same run with the correction removed (past the config's check) ...
    uncorrected = async_config(tmp_path / "uncorrected", steps=3)
    object.__setattr__(uncorrected, "algorithm", uncorrected.algorithm.replace(correction=CorrectionConfig()))
    plain, plain_traj = _logs(run(uncorrected, verbose=False))
    assert all(m["correction/weight_mean"] == 1.0 for m in plain)
    # ... samples the same batches (the first update differs by float noise only: behaviour and
    # proximal policy are the same weights) ...
    assert [t["completion_ids"] for t in plain_traj] == [t["completion_ids"] for t in traj[:len(plain_traj)]]
    assert abs(plain[0]["train/pg_loss"] - metrics[0]["train/pg_loss"]) < 1e-7
    # ... but its loss on a stale batch with a learning signal is another.
    k = 2  # step 3: version 1 sampled, version 2 updates; step 2's groups all have equal rewards
    assert metrics[k]["staleness/max"] == 1 and metrics[k]["advantages/adv_std"] > 0
    assert abs(plain[k]["train/pg_loss"] - metrics[k]["train/pg_loss"]) > 1e-5


@pytest.mark.slow
def test_resume_from_a_checkpoint_repeats_the_run(tmp_path):
    """... and the whole run, compiling its other packed shape ahead on a thread beside the rollout
    thread, computes what the parts did without."""
    ck, packing = CheckpointConfig(every_steps=2, export_hf=False), PackingConfig(row_buckets=2, min_row_length=0)
    whole = run(async_config(tmp_path / "whole", checkpoint=ck, packing=packing, compile_ahead=True), verbose=False)
    assert whole.compile["ahead_programs"] >= 1 and whole.compile["ahead_seconds"] > 0, whole.compile
    first = async_config(tmp_path / "parts", checkpoint=ck, steps=2, packing=packing)
    run(first, verbose=False)
    resumed = run(first.replace(steps=STEPS), resume=True, allow_changed=("steps",), verbose=False)
    assert resumed.resumed_from == 2

    def stable(result):
        return [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in _logs(result)[0]]

    assert stable(resumed) == stable(whole)
    assert _logs(resumed)[1] == _logs(whole)[1]
    assert stable(whole)[2]["staleness/max"] == 0  # the segment restarted at the checkpoint


@pytest.mark.slow
def test_an_error_on_the_rollout_thread_ends_the_run(tmp_path, monkeypatch):
    real = async_step.collect_rollouts

    def flaky(rt, *, seed, cursor, tl):
        if cursor >= 8:  # the third batch (4 prompts a step)
            raise RuntimeError("engine fell over")
        return real(rt, seed=seed, cursor=cursor, tl=tl)

    monkeypatch.setattr(async_step, "collect_rollouts", flaky)
    with pytest.raises(RuntimeError, match="engine fell over"):
        run(async_config(tmp_path / "flaky"), verbose=False)
    assert not [t for t in threading.enumerate() if t.name == "tpurl-rollout"]
    metrics = read_jsonl(os.path.join(str(tmp_path / "flaky"), "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2]


@pytest.mark.slow
def test_in_flight_syncs_land_mid_decode_within_the_bound(tmp_path, monkeypatch):
    """With `in_flight="continue"` the main thread loads every new version while the rollout thread
    decodes. Made deterministic by two holds: the load of version 2 waits until step 3's batch (the
    rollout thread's third `generate` call, started on version 1) has decoded once, and that batch's second decode
    step waits until version 2 has landed; so the batch switches mid-decode: its tokens carry
    versions 1 and 2. Every batch stays within the bound."""
    from tpurl.generate import driver
    from tpurl.rl.rollout import RolloutSide

    started, landed, calls = threading.Event(), threading.Event(), []
    real_decode, real_load = driver._Scheduler.decode, RolloutSide.load

    def decode(self):
        if threading.current_thread().name != "tpurl-rollout":  # e.g. the evaluation before step 1
            return real_decode(self)
        if not hasattr(self, "test_decodes"):  # the rollout thread's n-th generate call: step n+1's batch
            self.test_call, self.test_decodes = len(calls), 0
            calls.append(self.version)
        self.test_decodes += 1
        if self.test_call == 2 and self.test_decodes == 1:
            started.set()
        if self.test_call == 2 and self.test_decodes == 2:
            assert landed.wait(120), "version 2 never landed"
        return real_decode(self)

    def load(self, params, *, version, frozen=None):
        if version == 2:
            assert started.wait(120), "step 3's batch never started"
        report = real_load(self, params, version=version, frozen=frozen)
        if version == 2:
            landed.set()
        return report

    monkeypatch.setattr(driver._Scheduler, "decode", decode)
    monkeypatch.setattr(RolloutSide, "load", load)
    cfg = async_config(tmp_path / "inflight", async_rollout=AsyncConfig(max_staleness=1, in_flight="continue"))
    metrics, _ = _logs(run(cfg, verbose=False))
    assert not [t for t in threading.enumerate() if t.name == "tpurl-rollout"]
    for m in metrics:
        trained = m["policy_version"]
        assert trained - 1 <= m["staleness/version_min"] <= m["staleness/version_max"] <= trained
    assert calls[2] == 1  # step 3's batch started on version 1
    third = metrics[2]
    assert (third["staleness/version_min"], third["staleness/version_max"]) == (1, 2)  # switched mid-batch
    assert "time/sync_s" in metrics[0] and "time/publish_s" not in metrics[0]  # loaded by the main thread


@pytest.mark.parametrize("change, match", [
    (dict(placement=PlacementConfig()), r"mode='colocated' runs both on the same devices"),
    (dict(algorithm=algorithm_preset("grpo", group_size=4)), r"set AlgorithmConfig.correction"),
])
def test_async_refuses_what_cannot_work(tmp_path, change, match):
    with pytest.raises(ValueError, match=match) as e:
        prepare(async_config(tmp_path / "never", **change))
    assert "\n" not in str(e.value) and not (tmp_path / "never").exists()


def test_a_rollout_thread_is_refused_across_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="AsyncConfig.overlap='thread': across processes the rollout cannot run "
                                         "on a thread of its own") as e:
        prepare(async_config(tmp_path / "never"))
    assert "\n" not in str(e.value)
    prepare(async_config(tmp_path / "never", async_rollout=AsyncConfig(max_staleness=1, overlap="dispatch")))


@pytest.mark.slow
def test_dispatch_overlap_samples_the_same_batches_on_the_main_thread(async_run, tmp_path, monkeypatch):
    """`overlap="dispatch"`: the main thread samples batch k + 1 between dispatching update k and
    waiting for it. The same batches, versions and updates as the rollout thread's run, no thread,
    and a timeline whose phases add up and whose overlap is within the sampling."""
    from tpurl.rl import step as rl_step

    threads, events, real_sample, real_update = set(), [], async_step._sample, rl_step._update

    def sampling(rt, step, cursor, tl):
        threads.add(threading.current_thread().name)
        events.append(("sample", step))
        return real_sample(rt, step, cursor, tl)

    def updating(rt, train, ro, placed, adv_batch, old_lp, ref_lp, step):
        events.append(("update", step))
        return real_update(rt, train, ro, placed, adv_batch, old_lp, ref_lp, step)

    monkeypatch.setattr(async_step, "_sample", sampling)
    monkeypatch.setattr(rl_step, "_update", updating)
    cfg = async_config(tmp_path / "dispatch", async_rollout=AsyncConfig(max_staleness=1, overlap="dispatch"))
    metrics, traj = _logs(run(cfg, verbose=False))
    assert threads == {"MainThread"}
    # Batch k + 1 is sampled after update k is dispatched (and before update k + 1).
    assert events == [("sample", 0)] + [e for k in range(STEPS) for e in
                                        ([("update", k), ("sample", k + 1)] if k + 1 < STEPS else [("update", k)])]
    want_metrics, want_traj = _logs(async_run)
    stable = lambda ms: [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in ms]  # noqa: E731
    assert stable(metrics) == stable(want_metrics) and traj == want_traj
    assert [m["staleness/max"] for m in metrics] == [0, 1, 1, 1]
    for m in metrics:
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k not in ("time/step_s", "time/other_s"))
        assert phases + m["time/other_s"] == pytest.approx(m["time/step_s"], rel=1e-9)
        assert 0.0 <= m["timeline/overlap_s"] <= m.get("time/sample_ahead_s", 0.0) + 1e-6
        assert 0.0 <= m["timeline/train_idle_frac"] <= 1.0
    assert all(metrics[k]["time/sample_ahead_s"] > 0 for k in range(STEPS - 1))  # batches 2..4 sampled ahead


@pytest.mark.slow
def test_dispatch_in_flight_lands_mid_decode_on_the_main_thread(tmp_path, monkeypatch):
    """`overlap="dispatch"` with `in_flight="continue"`: before each decode step of the batch
    sampled beside an update, the main thread loads the update's weights once it has finished.
    Pinned (`inflight_landing`): update 0 never counts as finished during batch 1 (its weights are
    loaded between the batches, by `load_next`), update 1 at batch 2's third poll (that batch's
    first token and two decode steps sample with version 1, the rest with 2), update 2 at batch
    3's first (all of it with version 3, newer than the schedule's 2)."""
    threads, real_sample = set(), async_step._sample

    def sampling(rt, step, cursor, tl):
        threads.add(threading.current_thread().name)
        return real_sample(rt, step, cursor, tl)

    monkeypatch.setattr(async_step, "_sample", sampling)
    polls = pin_landings({1: None, 2: 3, 3: 1}, monkeypatch.setattr)
    cfg = async_config(tmp_path / "dispatch_inflight",
                       async_rollout=AsyncConfig(max_staleness=1, overlap="dispatch", in_flight="continue"))
    metrics, _ = _logs(run(cfg, verbose=False))
    assert threads == {"MainThread"}
    assert [(m["staleness/version_min"], m["staleness/version_max"]) for m in metrics] == [(0, 0), (0, 0), (1, 2),
                                                                                          (3, 3)]
    assert [m["staleness/max"] for m in metrics] == [0, 1, 1, 0]
    assert polls[1] >= 3 and polls[2] == 3 and polls[3] == 1  # batch 1: every round polled, none landed
    # Each step reports the loads it ran: metrics[1] two (version 1 before its update, version 2
    # mid-batch), metrics[2] one (version 3, before batch 3's first decode step), metrics[3] the
    # segment's closing sync.
    moved = [m.get("sync/bytes_moved") for m in metrics]
    assert moved[0] is None and moved[1] == 2 * moved[2] == 2 * moved[3] > 0


def test_the_gin_example_builds_an_async_config():
    import gin

    from tpurl.commands.train import build_config

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    try:
        cfg = build_config([os.path.join(configs, "test_tiny.gin"), os.path.join(configs, "async.gin")], [])
    finally:
        gin.clear_config()
    assert cfg.async_rollout.max_staleness == 1 and cfg.algorithm.correction == correction_preset("tis")
    assert cfg.placement.mode == "disaggregated" and cfg.placement.split(8) == (4, 4)
    prepare(cfg)


def test_a_published_copy_is_in_the_rollout_dtype_and_syncs_to_the_same_weights(devices):
    """Drain mode publishes the new weights for a later batch: a copy cast to the rollout dtype
    (half the bytes of fp32 masters) that syncs to the same rollout weights, bit for bit, as the
    masters themselves, and that shares no buffer with them (the next update donates those)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpurl.sync import SyncConfig, sync_weights

    train = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("fsdp", "tensor"))
    rollout = Mesh(np.asarray(devices[4:]), ("tensor",))
    rng = np.random.default_rng(0)
    masters = {"w": jax.device_put(rng.normal(size=(8, 16)).astype(np.float32), NamedSharding(train, P("fsdp", "tensor"))),
               "step": jax.device_put(np.arange(4, dtype=np.int32), NamedSharding(train, P()))}
    targets = {"w": NamedSharding(rollout, P(None, "tensor")), "step": NamedSharding(rollout, P())}
    cfg = SyncConfig(rollout_dtype="bfloat16", method="device_put")
    copy = async_step._rollout_copy(masters, sync_cfg=cfg)
    assert copy["w"].dtype == np.dtype("bfloat16") and copy["step"].dtype == np.int32
    assert copy["w"].sharding == masters["w"].sharding
    for c, m in zip(jax.tree.leaves(copy), jax.tree.leaves(masters)):
        assert {s.data.unsafe_buffer_pointer() for s in c.addressable_shards}.isdisjoint(
            {s.data.unsafe_buffer_pointer() for s in m.addressable_shards})
    want, _ = sync_weights(masters, targets, cfg)
    got, _ = sync_weights(copy, targets, cfg)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g.astype(np.float32) if g.dtype != np.int32 else g),
                                      np.asarray(w.astype(np.float32) if w.dtype != np.int32 else w))


def test_the_main_threads_memory_account_leaves_the_rollout_pool_out():
    """The step's live-array account counts the train pool's devices alone: a batch being sampled
    on the rollout pool (another thread's arrays) does not show in the main thread's phases."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpurl.rl import step as rl_step

    train, rollout = jax.devices()[:4], jax.devices()[4:]

    def placed(devices, n):
        return jax.device_put(jnp.ones((4, n), jnp.float32), NamedSharding(Mesh(np.array(devices), ("d",)), P("d")))

    def account(*arrays):
        tl, memory = rl_step.memory_timeline(train)
        with tl.phase("update"):
            pass
        return memory.get("memory/update/device_bytes", 0.0)

    base = account()
    kv = placed(rollout, 1 << 16)  # 1 MiB on the rollout pool
    assert account(kv) == base
    params = placed(train, 1 << 16)  # 1 MiB on the train pool
    assert account(kv, params) == base + params.nbytes
