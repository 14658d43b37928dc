"""Logical axis names: the vocabulary shared by the model, the layouts and the engine.

Glossary (shapes in scaling-book notation; a subscript names the mesh axis a layout shards over):

    vocab     V   embedding rows / logits columns     embed_tokens[V, D], lm_head[D, V]
    embed     D   model width                         W_q[D_fsdp, N_tp, H] in the train layout
    heads     N   query heads                         W_o[N_tp, H, D_fsdp]
    kv_heads  K   key/value heads (GQA: N = g * K)     W_k[D, K_tp, H], KV pages [K_tp, P, S, H]
    head_dim  H   per-head width
    mlp       F   SwiGLU hidden width                 W_gate[D_fsdp, F_tp], W_down[F_tp, D_fsdp]
    layers    L   stacked (scanned) layer axis         never sharded by the presets
    norm          RMSNorm scales                      always replicated
    experts   E   a sparse layer's experts             W_gate[E_fsdp, D, F_e] (expert parallel)
    expert_mlp  F_e  one expert's MLP width            W_down[E, F_e, D]
    lora_rank R   a LoRA adapter's rank               A[D_fsdp, R], B[R, N_tp, H]; never sharded
    batch     B   sequences (activations only)        x[B_(data,fsdp), T, D]
    seq       T   sequence positions (activations)
    pages     P   KV pool pages                       (engine)

Mesh axes: `data` (replicas of the whole computation), `fsdp` (parameter sharding, gathered at
use), `tensor` (tensor parallelism over heads / mlp / vocab), room for `expert`.
"""

from __future__ import annotations

import jax
from flax import nnx

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm", "batch", "seq",
                "pages", "experts", "expert_mlp", "lora_rank")
MESH_AXES = ("data", "fsdp", "tensor", "expert")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(state) -> object:
    """The pytree of logical-axis tuples of an `nnx.State` (or a module), read from the
    `logical_axes` metadata each `nnx.Param` carries."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)

    def axes_of(v):
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter of shape {v.get_value().shape} has no logical_axes metadata; "
                             "create it with nnx.Param(value, logical_axes=(...))")
        return tuple(axes)

    return jax.tree.map(axes_of, state, is_leaf=_is_var)
