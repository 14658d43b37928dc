"""A value head for PPO: a linear critic on the policy's final hidden states (shared trunk).

Alignment follows the logprobs convention: `values[b, t]` is the value of the state *before*
token t (the prefix `tokens[b, :t]`), read from the hidden state at t - 1, so that GAE pairs
`values[b, t]` with the reward for emitting token t. Zero at t = 0 and wherever token t or its
predecessor is padding.

The head is zero-initialized (every state starts at value 0, the gradient still flows through
the hidden states) and kept replicated: it is D + 1 numbers.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tpurl.train.logprobs import as_model, batch_prev_hidden, scoring_fn
from tpurl.train.packing import PackingConfig, batch_shards, to_padded

ValueHead = dict[str, jax.Array]


def init_value_head(hidden_size: int) -> ValueHead:
    """`{"w": [D], "b": []}`, zeros, float32."""
    if hidden_size <= 0:
        raise ValueError(f"init_value_head: hidden_size must be positive, got {hidden_size}")
    return {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def values_from_prev(prev_BTD: jax.Array, head: ValueHead, scored_BT: jax.Array) -> jax.Array:
    """Float32 values `[B, T]` from each token's predecessor's hidden state (see the module
    docstring; `tpurl.train.logprobs.batch_prev_hidden`), 0 where `scored_BT` is False."""
    v_BT = jnp.einsum("BTD,D->BT", prev_BTD, head["w"].astype(prev_BTD.dtype),
                      preferred_element_type=jnp.float32) + head["b"]
    return jnp.where(jnp.asarray(scored_BT, bool), v_BT, 0.0)


def make_value_fn(graphdef, *, mesh: Mesh | None = None, layout=None, packing: PackingConfig | None = None,
                  micro_batches: int = 1) -> Callable[[object, ValueHead, jax.Array, jax.Array], jax.Array]:
    """A jitted `fn(params, value_head, tokens_BT, valid_BT) -> values_BT` (the old values GAE
    needs); with `packing` enabled the forward runs on packed rows (`tpurl.train.packing`), in
    the update's `micro_batches`; `fn.on_batch(params, value_head, batch)` takes a batch the train
    step prepared (`tpurl.train.logprobs.make_logprob_fn` says more)."""
    sharded = mesh is not None and layout is not None
    constrain = layout.compute_constrain(mesh) if sharded else None
    shards = batch_shards(layout, mesh)

    def _values(params, head, batch):
        prev, _, scored, _ = batch_prev_hidden(as_model((graphdef, params)), batch, constrain)
        return to_padded(values_from_prev(prev, head, scored), batch, shards)

    out_shardings = layout.batch_sharding(mesh, 2) if sharded else None
    return scoring_fn(_values, out_shardings, packing, shards, micro_batches, mesh, layout)
