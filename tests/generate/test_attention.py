"""Paged attention against a float64 numpy recompute over each sequence's gathered keys, and the
Pallas kernels (interpret mode on CPU) against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurl.generate import attention
from tpurl.generate.attention import PagedDecodeAttention, paged_attention, resolve_impl

B, N, K, H, P, S, M = 3, 4, 2, 16, 24, 4, 4


def _case(seed=0, poison=False):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, N, H)).astype(np.float32)
    k_pages = rng.normal(size=(K, P, S, H)).astype(np.float32)
    v_pages = rng.normal(size=(K, P, S, H)).astype(np.float32)
    lengths = np.array([1, 7, 14], np.int32)
    table = np.full((B, M), P, np.int32)  # sentinel past each sequence's pages
    perm = rng.permutation(P)
    used = 0
    for b, n in enumerate(lengths):
        npg = -(-n // S)
        table[b, :npg] = perm[used:used + npg]
        used += npg
    if poison:  # every position a sequence must not read becomes NaN
        live = np.zeros((P, S), bool)
        for b, n in enumerate(lengths):
            for t in range(n):
                live[table[b, t // S], t % S] = True
        k_pages[:, ~live] = np.nan
        v_pages[:, ~live] = np.nan
    return q, k_pages, v_pages, lengths, table


def _numpy_attention(q, k_pages, v_pages, lengths, table):
    out = np.zeros(q.shape, np.float64)
    g = N // K
    for b, n in enumerate(lengths):
        pos = np.arange(n)
        keys = k_pages[:, table[b, pos // S], pos % S].astype(np.float64)  # [K, n, H]
        vals = v_pages[:, table[b, pos // S], pos % S].astype(np.float64)
        for h in range(N):
            s = keys[h // g] @ q[b, h].astype(np.float64) / np.sqrt(H)
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ vals[h // g]
    return out


@pytest.mark.parametrize("poison", [False, True])
def test_reference_matches_numpy(poison):
    args = _case(poison=poison)
    out = np.asarray(jax.jit(lambda *a: paged_attention(*a, impl="reference"))(*args))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _numpy_attention(*_case(poison=False)), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl,chunk_tokens", [("reference", 64), ("reference", 1), ("pallas_gpu", 64)])
def test_decode_attention_attends_to_new_token_and_writes_it(impl, chunk_tokens, monkeypatch):
    # chunk_tokens=1: the reference's online softmax runs one page per loop step, so its running
    # maximum and sum are rescaled across chunks.
    monkeypatch.setattr(attention, "CHUNK_TOKENS", chunk_tokens)
    # Unused rows are NaN for the reference; the kernels compute masked rows (NaN * 0 = NaN), which
    # is why the engine scrubs reused pages when it runs a kernel.
    q, k_pages, v_pages, lengths, table = _case(1, poison=impl == "reference")
    rng = np.random.default_rng(2)
    k_new, v_new = rng.normal(size=(2, B, 1, K, H)).astype(np.float32)
    active = np.array([True, False, True])
    pool = {"k": jnp.asarray(k_pages)[None], "v": jnp.asarray(v_pages)[None]}  # one layer
    attn = PagedDecodeAttention(pool, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(active), impl=impl,
                                interpret=True)
    cache = attn.model_cache()
    layer_cache = cache[0] if impl == "reference" else jax.tree.map(lambda x: x[0], cache)
    out, new = attn(jnp.asarray(q)[:, None], k_new, v_new, layer_cache)
    pool2 = attn.updated_pool(jax.tree.map(lambda x: x[None], new))
    exp_k, exp_v = k_pages.copy(), v_pages.copy()
    for b in np.nonzero(active)[0]:
        n = lengths[b]
        exp_k[:, table[b, n // S], n % S] = k_new[b, 0]
        exp_v[:, table[b, n // S], n % S] = v_new[b, 0]
    # Exactly the active slots' new positions were written (NaN-poisoned rows elsewhere untouched).
    np.testing.assert_array_equal(np.asarray(pool2["k"][0]), exp_k)
    np.testing.assert_array_equal(np.asarray(pool2["v"][0]), exp_v)
    ref = _numpy_attention(q, exp_k, exp_v, lengths + 1, table)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[active, 0], ref[active], atol=2e-5)


def test_auto_picks_reference_on_cpu():
    assert resolve_impl("auto", "cpu") == "reference"
    assert resolve_impl("auto", "tpu") == "pallas_tpu" and resolve_impl("auto", "gpu") == "pallas_gpu"
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_impl("flash")


def test_pallas_gpu_kernel_interpret_matches_reference():
    args = _case(3)
    out = paged_attention(*args, impl="pallas_gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(*args), atol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas GPU kernel needs a GPU")
def test_pallas_gpu_kernel_compiled_matches_reference_on_gpu():
    # Compiled for the GPU (not interpreted); its fp32 dots may run as TF32 (10-bit mantissa inputs).
    args = _case(3)
    out = jax.jit(lambda *a: paged_attention(*a, impl="pallas_gpu"))(*args)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(*args), atol=5e-3)


@pytest.mark.slow
def test_pallas_tpu_kernel_interpret_matches_reference_to_bf16():
    # The TPU kernel casts K/V to bfloat16 after loading them (no quantization scales given), so it
    # agrees with the fp32 reference to bf16 precision only (relative ~2^-8 per element).
    args = _case(4)
    out = paged_attention(*args, impl="pallas_tpu", interpret=True)
    q, k_pages, v_pages, lengths, table = args
    bf = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, bf(k_pages), bf(v_pages), lengths, table),
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(*args), atol=5e-2)


def test_kernel_under_shard_map_matches_numpy(devices):
    # 4 sequences over `data`, 2 KV heads (and their query heads) over `tensor`: each device runs
    # the kernel on its own block, as on a TPU/GPU mesh.
    from jax.sharding import Mesh
    from tpurl.generate.attention import KernelSharding

    rng = np.random.default_rng(5)
    b = 4
    q = rng.normal(size=(b, N, H)).astype(np.float32)
    k_pages, v_pages = rng.normal(size=(2, K, P, S, H)).astype(np.float32)
    lengths = np.array([3, 16, 9, 1], np.int32)
    table = rng.permutation(P)[: b * M].reshape(b, M).astype(np.int32)
    mesh = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("data", "tensor"))
    sharding = KernelSharding(mesh, batch_axes=("data",), kv_axes=("tensor",))
    fn = jax.jit(lambda *a: paged_attention(*a, impl="pallas_gpu", interpret=True, sharding=sharding))
    out = fn(q, k_pages, v_pages, lengths, table)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k_pages, v_pages, lengths, table), atol=2e-5)


def test_kernel_that_does_not_import_is_resolved_before_tracing(monkeypatch):
    import tpurl.generate.attention as attention

    def broken(impl):
        raise ImportError(f"no module for {impl}")

    monkeypatch.setattr(attention, "_import_kernel", broken)
    with pytest.warns(UserWarning, match="pallas_tpu kernel does not import"):
        assert resolve_impl("auto", "tpu") == "reference"  # auto falls back
    with pytest.raises(ValueError, match="'pallas_gpu': its kernel does not import.*use 'auto' or 'reference'") as e:
        resolve_impl("pallas_gpu")  # an explicit choice fails up front, not inside a trace
    assert "\n" not in str(e.value)
    assert resolve_impl("reference") == "reference" and resolve_impl("auto", "cpu") == "reference"


def test_kernel_on_per_replica_pools_matches_numpy(devices):
    # Two data replicas, each with its own pool of P/2 pages (the pool's pages axis split over
    # `data`) and page ids local to it: replica r's sequences see only pool block r.
    from jax.sharding import Mesh
    from tpurl.generate.attention import KernelSharding

    rng = np.random.default_rng(6)
    b, local = 4, P // 2
    q = rng.normal(size=(b, N, H)).astype(np.float32)
    k_pages, v_pages = rng.normal(size=(2, K, P, S, H)).astype(np.float32)
    lengths = np.array([3, 16, 9, 1], np.int32)
    table = np.concatenate([rng.permutation(local)[: 2 * M].reshape(2, M) for _ in range(2)]).astype(np.int32)
    global_table = table + np.array([0, 0, local, local], np.int32)[:, None]
    mesh = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("data", "tensor"))
    sharding = KernelSharding(mesh, batch_axes=("data",), kv_axes=("tensor",), page_axes=("data",))
    assert sharding.replicas == 2
    fn = jax.jit(lambda *a: paged_attention(*a, impl="pallas_gpu", interpret=True, sharding=sharding))
    out = fn(q, k_pages, v_pages, lengths, table)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k_pages, v_pages, lengths, global_table),
                               atol=2e-5)
    with pytest.raises(ValueError, match="page_axes=.*must be \\(\\) or batch_axes"):
        KernelSharding(mesh, batch_axes=("data",), page_axes=("tensor",))
