"""Meshes, named layouts (train / rollout), their presets, and what they cost in bytes and traffic.

    mesh.py     MeshConfig, make_mesh: axis names and sizes, topology-aware, multi-process aware
    axes.py     the logical axis vocabulary shared by the model, the layouts and the engine
    layout.py   Layout: logical -> mesh axes; parameter, compute and batch shardings; divisibility
    presets.py  dp, fsdp, fsdp_tp (train), tp, tp_replicas (rollout); mesh presets
    distributed.py  DistributedConfig, initialize: joining a multi-process run (`jax.distributed`)
    host.py     to_host / to_mesh / is_writer: host reads, host batches and file writing across processes
    cost.py     bytes per device and train -> rollout sync traffic, on abstract meshes
    placement.py  colocated or disaggregated: the train and rollout meshes over the devices
"""

from tpurl.sharding.layout import Layout, ParamPlacement
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import LAYOUT_PRESETS, MESH_PRESETS, layout_preset, mesh_preset

__all__ = ["Layout", "ParamPlacement", "MeshConfig", "make_mesh", "LAYOUT_PRESETS", "MESH_PRESETS",
           "layout_preset", "mesh_preset"]
