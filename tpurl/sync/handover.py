"""Colocated memory handover: the two phase transitions of an RL step that shares its devices.

    update phase                     rollout phase
    ------------                     -------------
    fp32 master params   --(opt)-->  host (pinned)            rollout params (bf16, synced)
    optimizer state      -------->   host (pinned)            KV pool (allocated by the engine)
    reference params     --(opt)-->  host (pinned)

`start_rollout` parks the update-only tensors in host memory (freeing their device buffers) and
then calls the caller's KV-pool factory, so the pool can take the memory they left. `start_update`
has the pool's owner release it (`release`), checks from the live-array account that device
memory came back down by the pool's size, and brings the parked tensors back into their original
shardings. Each transition records a `MemoryAccount` (`self.accounts`: the current step's, reset
by `start_rollout`) so a step's timeline can show where device memory went.

The handover owns the host copies between the two calls; that state is why this is a class. The
caller hands over ownership of what it parks: the device arrays it passes to `start_rollout` are
deleted, and the trees `start_update` returns replace them. The KV pool is never the handover's:
whoever allocates it frees it. Deleting an array frees its buffer even when another array shares
it (`jax.device_put` of a single-device array into a replicated sharding aliases the source), so
parked trees must own their buffers; with `verify`, `start_rollout` refuses a tree that shares
buffers with another live multi-device array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from tpurl.config_types import check_types
from tpurl.memory import DEVICE, memory_account, MemoryAccount, PINNED_HOST, resident_bytes, tree_bytes_by_memory_kind
from tpurl.sync.offload import aliased_elsewhere, to_device_memory, to_host_memory

@dataclasses.dataclass(frozen=True, kw_only=True)
class HandoverConfig:
    """Which update-phase tensors leave the device during rollout, and to which memory kind.
    `verify`: check each transition against the live-array account (raises on a leak)."""

    offload_opt_state: bool = True
    offload_master_params: bool = False
    offload_reference_params: bool = False
    host_memory_kind: str = PINNED_HOST
    verify: bool = True

    def __post_init__(self):
        check_types(self)
        if self.host_memory_kind not in ("pinned_host", "unpinned_host"):
            raise ValueError(f"HandoverConfig.host_memory_kind={self.host_memory_kind!r}; use 'pinned_host' "
                             "(or 'unpinned_host' where pinned memory is scarce)")

    def offloads(self, group: str) -> bool:
        return getattr(self, f"offload_{group}")


class ColocatedHandover:
    """Phase transitions of a colocated step. Typical use::

        pool = handover.start_rollout(opt_state=state.opt_state, kv_factory=lambda: KVPool(engine))
        ... rollout with pool ...
        restored = handover.start_update(release=pool.release)   # the pool's owner frees it
        state = state.replace(opt_state=restored["opt_state"])
    """

    def __init__(self, cfg: HandoverConfig = HandoverConfig()):
        self.cfg = cfg
        self.accounts: list[MemoryAccount] = []
        self._parked: dict[str, tuple[Any, Any]] = {}  # group -> (host tree, device shardings)
        self._in_rollout = False
        self._largest_kv_array = 0

    @property
    def in_rollout(self) -> bool:
        return self._in_rollout

    def start_rollout(self, *, opt_state=None, master_params=None, reference_params=None,
                      kv_factory: Callable[[], Any] | None = None, protect: dict[str, Any] | None = None):
        """Park the configured groups in host memory, then allocate the KV pool.

        Groups passed here whose `offload_*` flag is off stay where they are (and are not returned
        by `start_update`). `protect`: named trees the rollout still needs on device (e.g.
        `{"rollout_params": ...}`, which a free sync shares with the master params); parking an
        array one of them holds is refused. Returns `kv_factory()` (None without a factory): a
        pytree of the pool's device arrays or an object with an `arrays()` method listing them
        (`tpurl.generate.KVPool`), accounted as the group `kv_pool`.
        """
        if self.in_rollout:
            raise RuntimeError("start_rollout called twice; call start_update before the next rollout")
        given = {"opt_state": opt_state, "master_params": master_params, "reference_params": reference_params}
        parking = {g: t for g, t in given.items() if t is not None and self.cfg.offloads(g)}
        if self.cfg.verify:
            keep = {**{g: t for g, t in given.items() if t is not None}, **(protect or {})}
            for group, tree in parking.items():
                mine = {id(x) for x in jax.tree.leaves(tree)}
                for other, other_tree in keep.items():
                    if other != group and mine & {id(x) for x in jax.tree.leaves(other_tree)}:
                        raise ValueError(f"start_rollout: {group} and {other} hold the same arrays; parking {group} "
                                         f"deletes them from {other} too. Pass a copy (jax.tree.map(jnp.copy, ...)) "
                                         f"or do not offload {group}")
                shared = aliased_elsewhere(tree)
                if shared:
                    raise ValueError(f"start_rollout: {group} shares device buffers with {len(shared)} other live "
                                     f"arrays (e.g. shape {shared[0].shape}); parking deletes them too. Pass a copy "
                                     "(jax.tree.map(jnp.copy, tree)) or stop offloading this group")
        before = memory_account("offload:start", self._groups(parking))
        for group, tree in parking.items():
            shardings = jax.tree.map(lambda x: x.sharding, tree)
            self._parked[group] = (to_host_memory(tree, memory_kind=self.cfg.host_memory_kind, delete_source=True),
                                   shardings)
        parked = memory_account("offload:parked", self._groups({}))
        if self.cfg.verify:
            expected = sum(before.device_bytes(g) for g in parking)
            freed = before.device_bytes() - parked.device_bytes()
            if freed < expected:
                raise RuntimeError(f"offloading {sorted(parking)} freed {freed} device bytes, expected {expected}: "
                                   "another live array shares their buffers; do not alias them elsewhere")
        self._in_rollout = True  # from here on, start_update brings the parked groups back
        kv = kv_factory() if kv_factory is not None else None
        kv_arrays = kv.arrays() if hasattr(kv, "arrays") else kv
        self._largest_kv_array = max((resident_bytes(x) for x in jax.tree.leaves(kv_arrays)), default=0)
        self.accounts = [before, parked, memory_account("offload", self._groups({}, kv_arrays))]  # this step's only
        # (moments "offload:start", "offload:parked", "offload"; start_update adds "onload:released", "onload")
        return kv

    def start_update(self, *, release: Callable[[], None] | None = None) -> dict[str, Any]:
        """End the rollout: `release()` (the KV pool's owner frees it), then bring the parked groups
        back to device memory. Returns `{group: device tree}` for the parked groups, in their
        original shardings.

        With `verify`, device memory must be back near its level before the pool was allocated:
        if it is still above by as much as the pool's largest array, some of the pool is still
        referenced (a leak) and this raises, before anything is brought back.
        """
        if not self._in_rollout:
            raise RuntimeError("start_update called without start_rollout")
        if release is not None:
            release()
        # The pool's group shows 0 device bytes from here on (it is gone, or the check below raises).
        released = memory_account("onload:released", self._groups({}, []))
        if self.cfg.verify and self._largest_kv_array:
            grown = released.device_bytes() - self.account("offload:parked").device_bytes()
            if grown >= self._largest_kv_array:
                raise RuntimeError(f"the KV pool still holds device memory after its release ({grown} bytes above "
                                   "the level before it was allocated): a decode state is still referenced; "
                                   "have the pool's owner release it first")
        restored = {group: to_device_memory(host, shardings, delete_source=True)
                    for group, (host, shardings) in self._parked.items()}
        self._parked = {}
        self._in_rollout = False
        self.accounts += [released, memory_account("onload", self._groups(restored, []))]
        return restored

    def account(self, phase: str) -> MemoryAccount:
        """This step's account of the moment `phase`: "offload:start" (before parking), "offload:parked",
        "offload" (the end of the offload phase: the KV pool allocated), "onload:released" (the pool
        freed) or "onload" (the end of the onload phase: the parked groups back on device)."""
        for acc in self.accounts:
            if acc.phase == phase:
                return acc
        raise KeyError(f"no memory account for phase {phase!r} in this step; have {[a.phase for a in self.accounts]}")

    def _groups(self, device_groups: dict[str, Any], kv=None) -> dict[str, Any]:
        """Every group of the account: parked (host), `device_groups`, and `kv_pool` when given."""
        groups = {g: host for g, (host, _) in self._parked.items()}
        groups.update(device_groups)
        if kv is not None:
            groups["kv_pool"] = kv
        return groups


def device_bytes(tree) -> int:
    """Device-memory bytes a pytree occupies (resident, replicas counted)."""
    return tree_bytes_by_memory_kind(tree).get(DEVICE, 0)


def account_metrics(accounts: list[MemoryAccount]) -> dict[str, float]:
    """Flat metrics of a handover's accounts: `memory/<phase>/<group>_device_bytes` for every group
    of every account (`:` in moment names becomes `_`, e.g. `memory/onload_released/kv_pool_device_bytes`)."""
    out: dict[str, float] = {}
    for acc in accounts:
        phase = acc.phase.replace(":", "_")
        for group in acc.groups:
            out[f"memory/{phase}/{group}_device_bytes"] = float(acc.device_bytes(group))
    return out
