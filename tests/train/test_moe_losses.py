"""The routers' auxiliary losses (tpurl.models.moe.balance_losses, tpurl.train.moe_losses): the
load-balancing loss against `transformers`' `load_balancing_loss_func` (Qwen3-MoE's, with padding
masked), the z-loss against float64 numpy, the metrics named by each sparse layer's model index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.models.moe import MoeConfig, RouterStats, balance_losses, router_stats
from tpurl.train.moe_losses import router_aux

torch = pytest.importorskip("torch")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

E, K, T = 6, 2, 40


def _stats(logits_TE, weights_T):
    own = jax.lax.top_k(jnp.asarray(logits_TE), K)[1]
    return router_stats(jnp.asarray(logits_TE), own, own, jnp.asarray(weights_T))


def test_balance_loss_is_transformers_and_z_loss_is_numpy():
    rng = np.random.default_rng(0)
    logits = (2.0 * rng.normal(size=(T, E))).astype(np.float32)
    logits[:, 0] += 1.5  # an overloaded expert: the loss well above its balanced value K
    mask = rng.random(T) < 0.7
    balance, z = balance_losses(jax.tree.map(lambda x: x[None], _stats(logits, mask)), K)
    want = qwen3_moe.load_balancing_loss_func((torch.tensor(logits),), E, K, torch.tensor(mask[None, :]))
    np.testing.assert_allclose(float(balance[0]), float(want), rtol=1e-5)
    assert float(balance[0]) > K * 1.1
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(z[0]), (lse[mask] ** 2).mean(), rtol=1e-5)
    # Perfectly balanced (every expert takes K / E of the tokens, with mean probability 1 / E): K.
    n = 30.0
    even = RouterStats(counts_E=jnp.full((1, E), n * K / E), probs_E=jnp.full((1, E), n / E), z=jnp.zeros(1),
                       tokens=jnp.full((1,), n), agree=jnp.full((1,), n))
    np.testing.assert_allclose(float(balance_losses(even, K)[0][0]), K, rtol=1e-6)


def test_router_aux_names_each_sparse_layer_by_its_model_index():
    rng = np.random.default_rng(1)
    stats = [_stats(rng.normal(size=(T, E)).astype(np.float32), np.ones(T)) for _ in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *stats)
    moe = MoeConfig(num_experts=E, experts_per_token=K, intermediate_size=8, balance_loss_coef=0.1, z_loss_coef=0.01)
    loss, sums = router_aux(moe, stacked, jnp.asarray(0.5), layers=[1, 3])
    balance, z = balance_losses(stacked, K)
    np.testing.assert_allclose(float(loss), 0.5 * (0.1 * float(balance.mean()) + 0.01 * float(z.mean())), rtol=1e-6)
    assert {k.split("/")[1] for k in sums if k.count("/") == 2} == {"l1", "l3"}
    np.testing.assert_allclose(float(sums["moe/l3/balance"]), 0.5 * float(balance[1]), rtol=1e-6)
    np.testing.assert_allclose(sum(float(sums[f"moe/l1/e{j}"]) for j in range(E)), 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="2 sparse layers' statistics but 1 layer"):
        router_aux(moe, stacked, jnp.asarray(1.0), layers=[0])
