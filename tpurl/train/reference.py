"""The reference policy: a frozen copy of the initial weights that scores batches for the KL term.

It is a resource (a second full copy of the weights), hence a class. Two memory choices:

- on device (default): the copy lives next to the train state, in the same shardings;
- offloaded (`offload=True`): the copy lives in host memory (`memory_kind="pinned_host"`) and is
  brought to the devices only for the duration of `logprobs(...)`, so between uses it costs no
  accelerator memory; the transfer is the price, paid once per step.

When the algorithm's KL coefficient is 0 there is no reference policy at all: `make_reference`
returns None and no copy is made (the loop then does not compute reference logprobs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tpurl.train.config import AlgorithmConfig
from tpurl.train.logprobs import DEFAULT_CHUNK, make_logprob_fn


def _with_memory_kind(tree, kind: str):
    return jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree)


class ReferencePolicy:
    """Frozen weights + a jitted scorer in the given layout. `logprobs(tokens, valid) -> [B, T]`."""

    def __init__(self, graphdef, params, *, mesh: Mesh | None = None, layout=None, offload: bool = False,
                 temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK, vocab_chunk_size: int | None = None,
                 compute_dtype=None):
        self.offload = offload
        self._device_shardings = _with_memory_kind(params, "device")
        if offload:
            # device_put to another memory kind copies, so the train state may be donated freely.
            self._params = jax.device_put(params, _with_memory_kind(params, "pinned_host"))
        else:
            self._params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params)
        self._score = make_logprob_fn(graphdef, mesh=mesh, layout=layout, temperature=temperature,
                                      chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                                      compute_dtype=compute_dtype)

    @property
    def params(self):
        """The frozen weights where they are kept (host memory when offloaded)."""
        return self._params

    def logprobs(self, tokens_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
        """Reference logprobs `[B, T]` (same alignment and temperature as the policy's)."""
        params = jax.device_put(self._params, self._device_shardings) if self.offload else self._params
        logprobs, _ = self._score(params, tokens_BT, valid_BT)
        return logprobs  # the on-device copy of offloaded weights dies here


def make_reference(graphdef, params, algo_cfg: AlgorithmConfig, *, mesh: Mesh | None = None, layout=None,
                   offload: bool = False, chunk_size: int = DEFAULT_CHUNK, vocab_chunk_size: int | None = None,
                   compute_dtype=None) -> ReferencePolicy | None:
    """A `ReferencePolicy` at the algorithm's temperature, or None when `algo_cfg.kl_coef == 0`."""
    if not algo_cfg.uses_reference:
        return None
    return ReferencePolicy(graphdef, params, mesh=mesh, layout=layout, offload=offload,
                           temperature=algo_cfg.temperature, chunk_size=chunk_size,
                           vocab_chunk_size=vocab_chunk_size, compute_dtype=compute_dtype)
