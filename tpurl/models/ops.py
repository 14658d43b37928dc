"""The transformer's tensor operations: rank-2 matmuls over named axes, SwiGLU, RMSNorm.

Letters: B batch, T positions, D embed, F mlp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tpurl.models.invariant import matmul_rows, rowwise


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, *, bitwise: bool = False) -> jax.Array:
    """Contract the last `n_in` axes of `x` with the first `n_in` axes of `w`, as one rank-2 matmul.

    `dense(x_BTD, w_DNH)` is `einsum("BTD,DNH->BTNH")` computed as `[B*T, D] @ [D, N*H]`. The
    reshapes are free (row-major merges), and on XLA:CPU the backward pass of the rank-3 einsum
    lays the activation gradients out transposed (copies; docs/performance.md); the rank-2 form
    has none. `bitwise`: each row's result independent of the others (`invariant.matmul_rows`).
    """
    lead, ins, outs = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if x.shape[x.ndim - n_in:] != ins:
        raise ValueError(f"dense: input axes {x.shape[x.ndim - n_in:]} do not match the weight's {ins}")
    k = math.prod(ins)
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    return (matmul_rows(x2, w2) if bitwise else x2 @ w2).reshape(*lead, *outs)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, the MLP's activation, with a one-pass backward.

    Autodiff of `silu(g) * u` spreads the backward over several elementwise kernels (the product
    rule inside silu gives two terms that are added afterwards); written out, both cotangents come
    from one read of (g, u, dh): du = dh * g * s, dg = dh * u * s * (1 + g * (1 - s)), s = sigmoid(g).
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
    gate, up = res
    s = jax.nn.sigmoid(gate)
    dh_s = dh * s
    return dh_s * up * (1 + gate * (1 - s)), dh_s * gate


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, bitwise: bool = False) -> jax.Array:
    """RMSNorm computed in float32 (as Hugging Face does), returned in x's dtype. `bitwise`: over
    rows padded to `invariant.ROW_TILE` (`invariant.rowwise`), each row's result independent of
    the others."""
    def norm(x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        return (lead(weight.astype(jnp.float32), y.ndim) * y).astype(x.dtype)
    return rowwise(norm, x) if bitwise else norm(x)


def lead(w: jax.Array, ndim: int) -> jax.Array:
    """`w` with leading unit dims up to rank `ndim` (explicit broadcasting; tests raise on rank promotion)."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)
