"""Named layout and mesh presets (an RL job picks them by name: `RLConfig.train_layout = "fsdp_tp"`).

Every preset uses every device of a (data, fsdp, tensor) mesh; they differ in what each axis does.
Shapes in scaling-book notation (subscript = mesh axes; `dfp` = data*fsdp, etc.):

    dp           every device a replica           x[B_(data,fsdp,tensor), T, D]   W_in[D, F]
    fsdp         ZeRO-3 over all non-data axes    x[B_(data,fsdp,tensor), T, D]   W_in[D_(fsdp,tensor), F]
                 (`data` replicates FSDP groups: hybrid sharding)
    fsdp_tp      the standard TRAIN layout        x[B_(data,fsdp), T, D]          W_in[D_fsdp, F_tensor]
    tp           the standard ROLLOUT layout:     x[B_data, T, D]                 W_in[D, F_(fsdp,tensor)]
                 tensor parallel over every non-data device, weights replicated over `data`
                 (fewest, widest replicas: the most memory left for the KV cache)
    tp_replicas  TP within a replica, replicas    x[B_(data,fsdp), T, D]          W_in[D, F_tensor]
                 over `data` and `fsdp` (narrow TP, many replicas: throughput for small models)

Tensor parallelism covers `heads`, `kv_heads`, `mlp` and `vocab`; a mixture-of-experts model's
`experts` are sharded over the FSDP axes in training (stored sharded, gathered at use, each
expert's MLP tensor-parallel in `fsdp_tp`) and over the tensor-parallel axes in rollout (expert
parallelism: each device holds some experts whole). `kv_heads` and `experts` fall back to
replication where they do not divide (see `layout.py`), every other dim must divide. So `tp` needs
`num_heads` divisible by fsdp*tensor: on the default all-fsdp mesh it is N-way TP over all N
devices (vLLM's single-node setting); for small models or large meshes use `tp_replicas` or give
the rollout its own mesh shape. `layers`, `head_dim` and norms are never
sharded. Each layout also exists as a gin file, `configs/layouts/<name>.gin`, binding a gin scope
of the same name (`@fsdp_tp/tpurl.Layout()`); a test keeps the two identical.
"""

from __future__ import annotations


from tpurl.sharding.layout import Layout
from tpurl.sharding.mesh import MeshConfig

_TP = ("heads", "kv_heads", "mlp", "vocab")


def _tp_rules(axes: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((name, axes) for name in _TP)


LAYOUT_PRESETS: dict[str, Layout] = {
    "dp": Layout(name="dp", rules=(("batch", ("data", "fsdp", "tensor")),), gathered_at_use=()),
    "fsdp": Layout(name="fsdp", rules=(("batch", ("data", "fsdp", "tensor")), ("embed", ("fsdp", "tensor")),
                                       ("experts", ("fsdp", "tensor"))),
                   gathered_at_use=("fsdp", "tensor")),
    "fsdp_tp": Layout(name="fsdp_tp", rules=(("batch", ("data", "fsdp")), ("embed", ("fsdp",))) + _tp_rules(("tensor",))
                      + (("experts", ("fsdp",)), ("expert_mlp", ("tensor",))),
                      gathered_at_use=("fsdp",)),
    "tp": Layout(name="tp", rules=(("batch", ("data",)),) + _tp_rules(("fsdp", "tensor"))
                 + (("experts", ("fsdp", "tensor")),), gathered_at_use=()),
    "tp_replicas": Layout(name="tp_replicas", rules=(("batch", ("data", "fsdp")),) + _tp_rules(("tensor",))
                          + (("experts", ("tensor",)),), gathered_at_use=()),
}

_MESH3 = ("data", "fsdp", "tensor")
MESH_PRESETS: dict[str, MeshConfig] = {
    "fsdp": MeshConfig(axes=_MESH3, shape=(1, -1, 1)),   # every device on fsdp (the default)
    "data": MeshConfig(axes=_MESH3, shape=(-1, 1, 1)),   # every device on data
    "tensor": MeshConfig(axes=_MESH3, shape=(1, 1, -1)),  # every device on tensor
    "fsdp_tp2": MeshConfig(axes=_MESH3, shape=(1, -1, 2)),
    "fsdp_tp4": MeshConfig(axes=_MESH3, shape=(1, -1, 4)),
    "fsdp_tp8": MeshConfig(axes=_MESH3, shape=(1, -1, 8)),
    "data2_fsdp_tp2": MeshConfig(axes=_MESH3, shape=(2, -1, 2)),
}


def layout_preset(name: str) -> Layout:
    """The named layout preset (`dp`, `fsdp`, `fsdp_tp`, `tp`, `tp_replicas`)."""
    if name not in LAYOUT_PRESETS:
        raise ValueError(f"unknown layout preset {name!r}; known: {', '.join(LAYOUT_PRESETS)}")
    return LAYOUT_PRESETS[name]


def mesh_preset(name: str) -> MeshConfig:
    """The named mesh preset (see `MESH_PRESETS`; each also exists as `configs/meshes/<name>.gin`)."""
    if name not in MESH_PRESETS:
        raise ValueError(f"unknown mesh preset {name!r}; known: {', '.join(MESH_PRESETS)}")
    return MESH_PRESETS[name]
