"""A whole plan: memory per phase and whether it fits, phase seconds, steps/hour per placement, the
bottleneck, and what to shrink when it does not fit (`tpurl plan`).

Phases and what is on a device during each (colocated: one pool, taking turns):

    rollout   rollout params, KV pool + decode slots, and the update's tensors not parked on host
    logprobs  master params, optimizer state, reference, rollout params, a scoring pass's temporaries
    update    the same, with the update's temporaries (gradients, optimizer update, gathered
              weights, activations, logits) instead
    sync      master params, optimizer state, reference, the new rollout params, one sync bucket

Disaggregated: the train pool holds the update's tensors, the rollout pool the rollout params and
the KV pool; asynchronous, the train pool also holds up to `max_staleness` published copies of the
weights (drain mode), or the rollout pool a second set of rollout params (in-flight). Steps/hour: colocated and disaggregated run the phases one after another;
asynchronous (rollout of step k+1 during the update of step k, disaggregated meshes) takes the
longer of the two pools' phase sums, a prediction of the overlap, not a measurement.

A LoRA run's train devices also hold its frozen base (`frozen_params`) in every phase: the
colocated handover never parks it. Its master params, optimizer state and gradients are the
adapters', and so is its reference copy when it keeps one (`tpurl.plan.memory`).

A mixture-of-experts model's components hold every expert (its total parameters, not the active
ones), sharded as the layouts shard `experts`; its FLOPs count the active experts only
(`tpurl.plan.timing`). The rollout params stay on the devices in every colocated phase, so a
rollout mesh with more tensor ways (which split the experts) is often the first thing to change.
"""

from __future__ import annotations

import dataclasses

from tpurl.plan.hardware import Hardware
from tpurl.plan.job import PlanJob
from tpurl.plan.memory import KVPlan, kv_plan, scoring_temporaries, state_bytes, update_temporaries
from tpurl.plan.timing import PhaseTimes, phase_times
from tpurl.sharding.placement import PlacementConfig

# What to change to shrink each component (named in the no-fit advice).
SHRINK = {
    "kv_pool": "EngineConfig.num_pages / kv_memory_fraction, or max_slots",
    "activations": "ModelConfig.remat='full', or more AlgorithmConfig.micro_batches",
    "gathered_weights": "ModelConfig.remat='full' (gathers one layer at a time)",
    "logits": "fewer rows per micro-batch (AlgorithmConfig.micro_batches)",
    "optimizer_state": "HandoverConfig.offload_opt_state (rollout), or more devices to shard over",
    "master_params": "a layout that shards more (fsdp), more devices, or HandoverConfig.offload_master_params",
    "frozen_params": "LoraConfig.base_dtype, a layout that shards more (fsdp), more devices",
    "reference_params": "HandoverConfig.offload_reference_params, or kl_coef=0",
    "rollout_params": "a rollout layout that shards more (tp over more axes)",
    "published_params": "a smaller AsyncConfig.max_staleness (one copy per version waiting to be loaded)",
    "rollout_params_next": "AsyncConfig.in_flight='drain' (the old weights go before the new ones load)",
    "gradients": "more devices to shard over (the gradients follow the train layout)",
    "optimizer_update": "more devices to shard over",
    "scoring": "more AlgorithmConfig.micro_batches, a smaller RLConfig.batch_size or shorter sequences",
    "sync_bucket": "SyncConfig.bucket_bytes",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """`memory[pool][phase][component]`: bytes per device (`pool` is "devices" when colocated, else
    "train"/"rollout"); `host`: bytes per device parked in host memory during the rollout;
    `steps_per_hour[placement]`: None with `notes[placement]` saying why when it cannot be planned."""

    job: PlanJob
    hardware: Hardware
    state: dict[str, int]
    kv: KVPlan
    memory: dict[str, dict[str, dict[str, int]]]
    host: dict[str, int]
    times: PhaseTimes
    steps_per_hour: dict[str, float | None]
    notes: dict[str, str]

    @property
    def hbm(self) -> float:
        return self.hardware.chip.hbm_bytes

    def fits(self, pool: str, phase: str) -> bool:
        return sum(self.memory[pool][phase].values()) <= self.hbm

    @property
    def fits_all(self) -> bool:
        return all(self.fits(pool, ph) for pool, phases in self.memory.items() for ph in phases)

    @property
    def bottleneck(self) -> str:
        return max(self.times.seconds, key=self.times.seconds.get)

    def advice(self) -> list[str]:
        """For each phase that does not fit: its largest component and the bytes it must lose."""
        out = []
        for pool, phases in self.memory.items():
            for phase, parts in phases.items():
                over = sum(parts.values()) - self.hbm
                if over <= 0:
                    continue
                out.append(f"{pool}/{phase} is {over / 2**30:.2f} GiB over: " + _shrink(parts, over))
        return out


def _shrink(parts: dict[str, int], over: float) -> str:
    """Which components to shrink by how much: the largest, or the largest few that together hold
    `over` bytes (then more devices are usually the answer)."""
    ranked = sorted(parts, key=parts.get, reverse=True)
    name = ranked[0]
    if parts[name] > over:
        return (f"shrink {name} ({parts[name] / 2**30:.2f} GiB) by {over / 2**30:.2f} GiB "
                f"({100 * over / parts[name]:.0f}%): {SHRINK.get(name, 'fewer or smaller')}")
    chosen, held = [], 0
    for c in ranked:
        chosen.append(c)
        held += parts[c]
        if held >= over:
            break
    listed = ", ".join(f"{c} {parts[c] / 2**30:.2f} GiB" for c in chosen)
    return (f"shrink {name} ({parts[name] / 2**30:.2f} GiB) and more: no one component holds "
            f"{over / 2**30:.2f} GiB; together {listed} ({SHRINK.get(name, 'fewer or smaller')}; or more devices)")


def train_components(job: PlanJob) -> tuple[str, ...]:
    """The train devices' resident state: a LoRA run's frozen base besides the trained params."""
    frozen = ("frozen_params",) if job.model.lora is not None else ()
    return ("master_params", *frozen, "optimizer_state", "reference_params")


def _memory(job: PlanJob, state: dict[str, int], kv: KVPlan, backend: str):
    cfg, h = job.cfg, job.cfg.handover
    temps = update_temporaries(job, state, backend)
    scoring = scoring_temporaries(job, backend)
    train = {k: state[k] for k in train_components(job)}
    rollout = {"rollout_params": state["rollout_params"], "kv_pool": kv.bytes_per_device,
               "decode_slots": kv.slot_bytes}
    bucket = min(cfg.sync.bucket_bytes, state["rollout_params"])
    if not job.colocated:
        train, rollout = _with_async_copies(job, state, train, rollout)
        return {"train": {"logprobs": {**train, "scoring": scoring}, "update": {**train, **temps},
                          "sync": {**train, "sync_bucket": bucket}},
                "rollout": {"rollout": rollout, "sync": {**rollout, "sync_bucket": bucket}}}, {}
    parked = {"optimizer_state": h.offload_opt_state, "master_params": h.offload_master_params,
              "reference_params": h.offload_reference_params}
    host = {k: train[k] for k, off in parked.items() if off and train[k]}
    during_rollout = {k: v for k, v in train.items() if k not in host}
    with_rollout = {**train, "rollout_params": state["rollout_params"]}
    return {"devices": {"rollout": {**during_rollout, **rollout},
                        "logprobs": {**with_rollout, "scoring": scoring},
                        "update": {**with_rollout, **temps},
                        "sync": {**with_rollout, "sync_bucket": bucket}}}, host


def _with_async_copies(job: PlanJob, state: dict[str, int], train: dict[str, int], rollout: dict[str, int]):
    """The pools' components plus the weight copies asynchronous RL holds beyond the synchronous
    loop's: in drain mode each new version is published (in the rollout dtype, train layout) until
    the rollout side loads it, at most `max_staleness` at once; in-flight (`continue`) the rollout
    side holds the running batch's weights and the new ones while it switches."""
    a = job.cfg.async_rollout
    if a.max_staleness == 0:
        return train, rollout
    if a.in_flight == "drain":
        return {**train, "published_params": a.max_staleness * state["published_params"]}, rollout
    return train, {**rollout, "rollout_params_next": state["rollout_params"]}


def _steps_per_hour(seconds: dict[str, float], mode: str) -> float:
    if mode == "async":
        rollout_side = seconds["rollout"] + seconds["sync"]
        train_side = seconds["logprobs"] + seconds["update"] + seconds["sync"]
        return 3600.0 / max(rollout_side, train_side)
    return 3600.0 / sum(seconds.values())


def _predict(job: PlanJob, hw: Hardware):
    state = state_bytes(job)
    kv = kv_plan(job, hw.chip.hbm_bytes)
    memory, host = _memory(job, state, kv, hw.backend)
    return state, kv, memory, host, phase_times(job, hw.chip, state, kv, sum(host.values()))


def _other_placement(job: PlanJob) -> PlacementConfig:
    """The config's meshes under the other placement: colocated on all devices, or disaggregated
    with the devices split evenly."""
    p = job.cfg.placement
    if job.colocated:
        half = job.num_devices // 2
        return dataclasses.replace(p, mode="disaggregated", train_devices=half, rollout_devices=job.num_devices - half)
    return dataclasses.replace(p, mode="colocated")


def make_plan(job: PlanJob, hw: Hardware) -> Plan:
    """Plan `job` on `hw` (whose device count the job was resolved with)."""
    state, kv, memory, host, times = _predict(job, hw)
    own = "colocated" if job.colocated else "disaggregated"
    sph: dict[str, float | None] = {own: _steps_per_hour(times.seconds, own)}
    notes = {own: "this config"}
    if job.colocated:
        try:
            other = job.with_placement(_other_placement(job))
            other_times = _predict(other, hw)[4]
            sph["disaggregated"] = _steps_per_hour(other_times.seconds, "disaggregated")
            sph["async"] = _steps_per_hour(other_times.seconds, "async")
            notes["disaggregated"] = notes["async"] = (f"{other.n_train} train + {other.n_rollout} rollout devices, "
                                                      "same mesh configs")
        except ValueError as e:
            sph["disaggregated"] = sph["async"] = None
            notes["disaggregated"] = notes["async"] = f"not planned: {e}"
    else:
        sph["async"] = _steps_per_hour(times.seconds, "async")
        notes["async"] = "this config's pools"
        try:
            other = job.with_placement(_other_placement(job))
            sph["colocated"] = _steps_per_hour(_predict(other, hw)[4].seconds, "colocated")
            notes["colocated"] = f"all {other.num_devices} devices, same mesh configs"
        except ValueError as e:
            sph["colocated"] = None
            notes["colocated"] = f"not planned: {e}"
    notes["async"] += "; a prediction of the overlap (max of the two pools' phase sums)"
    return Plan(job=job, hardware=hw, state=state, kv=kv, memory=memory, host=host, times=times,
                steps_per_hour=sph, notes=notes)
