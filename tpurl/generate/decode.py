"""One decode step: every slot of a decode state samples its next token.

Letters: B decode slots (all of them, or the few gathered for a narrow step), V vocab.

The step runs the model on each slot's last token at its position, through the paged pool's
attention (`PagedDecodeAttention`) or the dense cache's (`DenseDecodeAttention`), writes the new
keys and values, samples with each slot's own sampling fields and seeds, and advances the slots'
counters: a slot ends when it samples one of its stop tokens or has no tokens left. Idle slots
compute but change nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tpurl.generate.attention import KernelSharding, PagedDecodeAttention
from tpurl.generate.dense import DenseDecodeAttention
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import sample_tokens
from tpurl.models.moe import token_routes


def decode_step(graphdef, params, state: dict, *, paged: bool, impl: str, interpret: bool,
                sharding: KernelSharding | None, constrain, truncate: bool, top_n: int,
                routes: bool = False) -> tuple[dict, ResultTokens]:
    """The new decode state and the step's tokens (inside jit; the caller donates `state`).
    `paged`: the state's cache is the page pool (else the dense cache); `impl`/`interpret`/`sharding`:
    the paged attention's; `truncate`: the sampling program has top-k/top-p; `top_n`: the most
    likely tokens reported per step; `routes`: report the experts each slot's consumed token went
    to (a router-replay model, `ResultTokens.routes`)."""
    model = nnx.merge(graphdef, params)
    active, lengths = state["active"], state["lengths"]
    if paged:
        attention = PagedDecodeAttention(state["cache"], state["page_table"], lengths, active, impl=impl,
                                         interpret=interpret, sharding=sharding, window=model.config.attention_window)
    else:
        attention = DenseDecodeAttention(state["cache"], lengths, active, window=model.config.attention_window)
    hidden, cache_out, routing = model(state["tokens"][:, None], lengths[:, None], attention=attention,
                                       cache=attention.model_cache(), constrain=constrain, with_routing=True)
    cache = attention.updated_pool(cache_out) if paged else attention.updated_cache(cache_out)
    logits_BV = model.logits(hidden, constrain)[:, 0]
    tokens, logprobs, top = sample_tokens(logits_BV, state["seeds"], state["steps"], state["temperature"],
                                          state["top_k"], state["top_p"], truncate=truncate, top_n=top_n,
                                          bitwise=model.config.bitwise)
    step = active.astype(jnp.int32)
    remaining = state["remaining"] - step
    stopped = jnp.any(tokens[:, None] == state["stop_ids"], axis=1)
    done = active & (stopped | (remaining <= 0))
    new = dict(state, cache=cache, tokens=jnp.where(active, tokens, state["tokens"]),
               lengths=lengths + step, steps=state["steps"] + step, remaining=remaining,
               active=active & ~done)
    return new, ResultTokens(tokens=tokens, logprobs=logprobs, valid=active, lengths=new["steps"], done=done, top=top,
                             routes=token_routes(routing) if routes else None)

