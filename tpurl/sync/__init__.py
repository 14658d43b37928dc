"""Weight sync (train layout -> rollout layout, within a process or across processes), host
offload, colocated memory handover, and the disk baseline."""

from tpurl.sync.handover import ColocatedHandover, HandoverConfig, account_metrics
from tpurl.sync.offload import delete_unshared, to_device_memory, to_host_memory
from tpurl.sync.config import SyncConfig, SyncReport
from tpurl.sync.reshard import made_by_sync, sync_weights

__all__ = ["ColocatedHandover", "HandoverConfig", "account_metrics", "delete_unshared", "to_device_memory",
           "to_host_memory", "SyncConfig", "SyncReport", "made_by_sync", "sync_weights"]
