"""Weight sync (train layout -> rollout layout, within a process or across processes), host
offload, colocated memory handover, disaggregated placement, and the disk baseline."""

from tpurl.sync.handover import ColocatedHandover, HandoverConfig, account_metrics
from tpurl.sync.offload import (MemoryAccount, delete_unshared, live_bytes_by_memory_kind, memory_account,
                                to_device, to_host, tree_bytes_by_memory_kind)
from tpurl.sync.placement import Placement, PlacementConfig, make_placement
from tpurl.sync.reshard import SyncConfig, SyncReport, sync_weights

__all__ = ["ColocatedHandover", "HandoverConfig", "account_metrics", "MemoryAccount", "delete_unshared",
           "live_bytes_by_memory_kind", "memory_account",
           "to_device", "to_host", "tree_bytes_by_memory_kind", "Placement", "PlacementConfig", "make_placement",
           "SyncConfig", "SyncReport", "sync_weights"]
