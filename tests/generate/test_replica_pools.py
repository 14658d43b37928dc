"""The engine with its decode slots split over R data replicas, each with its own page pool
(rollout layouts (2,1,4) and (4,1,2) on 8 devices): the same tokens as one device, with the
reference attention and the Pallas GPU kernel (interpret mode); no replica reads, writes or moves
another's pages."""

import re

import jax
import numpy as np
import pytest

from engine_setup import CFG, ENGINE, GREEDY, MAX_NEW, PROMPTS, SAMPLED, tokens
from tpurl.generate import Engine, EngineConfig, PoolExhausted, generate
from tpurl.sharding.mesh import MeshConfig, make_mesh
from tpurl.sharding.presets import layout_preset

# Rollout layouts with the slots split over R data replicas, each with its own small page pool
# (per replica: the longest request takes 11 pages, so two sequences of a replica cannot both be
# long: admission waits per replica). (2,1,4): 2 replicas, the 2 KV heads replicated over tensor=4;
# (4,1,2): 4 replicas, KV heads split over tensor=2.
REPLICA_MESHES = {"2x1x4": ((2, 1, 4), dict(num_pages=16)), "4x1x2": ((4, 1, 2), dict(max_slots=8, num_pages=12))}
KV_SHARDS = {"2x1x4": 1, "4x1x2": 2}


@pytest.fixture(scope="module")
def replica_engines(model_and_params):
    """`get(mesh_key, impl)` -> (engine, params on its mesh), built once per module."""
    graphdef, params = model_and_params
    built = {}

    def get(key, impl="reference"):
        if (key, impl) not in built:
            shape, extra = REPLICA_MESHES[key]
            mesh = make_mesh(MeshConfig(axes=("data", "fsdp", "tensor"), shape=shape))
            layout = layout_preset("tp")
            # Poisoned pool: a page read by the wrong sequence (or replica) would show as NaN.
            cfg = EngineConfig(**{**ENGINE, **extra}, attention_impl=impl, kernel_interpret=impl != "reference",
                               poison_free_pages=True)
            built[key, impl] = (Engine(CFG, cfg, mesh=mesh, layout=layout, graphdef=graphdef),
                                jax.device_put(params, layout.param_shardings(params, mesh)))
        return built[key, impl]

    return get


def _all_free(engine):
    return all(a.num_free == a.num_pages for a in engine.page_book.allocators)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(REPLICA_MESHES))
def test_replica_pools_match_single_device(key, replica_engines, greedy_reference, paged_sampled):
    engine, params = replica_engines(key)
    r = REPLICA_MESHES[key][0][0]
    assert engine.replicas == r and engine.num_pages == REPLICA_MESHES[key][1]["num_pages"]
    state = engine.init_decode_state()
    k = state["cache"]["k"]
    # Per device: 1/R of the pages of a pool replicated over the replicas (with as many pages in all),
    # times its share of the KV heads.
    assert k.shape == (CFG.num_layers, CFG.num_kv_heads, r * engine.num_pages, 4, CFG.head_dim)
    assert all(s.data.nbytes * r * KV_SHARDS[key] == k.nbytes for s in k.addressable_shards)
    del state, k
    greedy = generate(engine, params, PROMPTS, n_samples=1, sampling=GREEDY, seed=0)
    assert [row[0].token_ids.tolist() for row in greedy] == greedy_reference
    assert engine.stats["admission_waits"] > 0 and _all_free(engine)
    before = engine.stats["prefill_prompts"]
    sampled = generate(engine, params, PROMPTS[:16], n_samples=2, sampling=SAMPLED, seed=5)
    assert engine.stats["prefill_prompts"] - before == 16  # one prefill per group
    assert tokens(sampled) == tokens(paged_sampled[:16])
    for a, b in zip(sampled, paged_sampled):
        for ca, cb in zip(a, b):
            assert np.isfinite(ca.logprobs).all()
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-5)
    assert dict(engine.trace_counts)["generate"] == 2 and _all_free(engine)  # one per sampling mode


@pytest.mark.slow
@pytest.mark.parametrize("key", list(REPLICA_MESHES))
def test_pallas_kernel_engine_on_replica_pools_matches_reference(key, replica_engines, greedy_reference,
                                                                  paged_sampled, devices):
    # The GPU paged-attention kernel (Pallas interpret mode on CPU) inside the engine: slots split
    # over `data` with one pool per replica (local page ids), KV heads over `tensor` where they
    # divide, the kernel under shard_map per device, a NaN-poisoned pool (the engine must scrub
    # reused pages for the kernel, see test_attention), admission waits per replica.
    engine, params = replica_engines(key, "pallas_gpu")
    picked = [3, 17, 31, 30, 29, 28]
    out = generate(engine, params, [PROMPTS[i] for i in picked], n_samples=1, sampling=GREEDY, seed=0)
    assert [row[0].token_ids.tolist() for row in out] == [greedy_reference[i] for i in picked]
    assert engine.stats["admission_waits"] > 0 and _all_free(engine)
    # Sampled groups: the same tokens as on one device (seeds follow the prompt's index, not slots).
    out = generate(engine, params, PROMPTS[:4], n_samples=2, sampling=SAMPLED, seed=5)
    assert tokens(out) == tokens(paged_sampled[:4]) and _all_free(engine)


def _largest_collective_bytes(hlo_text: str) -> int:
    """Bytes of the largest result of a cross-device collective in compiled HLO text."""
    sizes = [0]
    for m in re.finditer(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|all-reduce|all-to-all|collective-permute)"
                         r"(-start)?\(", hlo_text):
        dtype, dims = m.group(1), [int(d) for d in m.group(2).split(",") if d]
        bits = int(re.sub(r"\D", "", dtype) or 8)  # f32, s32, bf16, pred (one byte)
        sizes.append(int(np.prod(dims, dtype=np.int64)) * max(bits // 8, 1))
    return max(sizes)


@pytest.mark.slow
def test_replica_pools_move_no_pages_between_devices(replica_engines, model_and_params, monkeypatch):
    # The compiled decode step (reference and kernel path) and insert read and write each
    # replica's pool where it lives: no collective moves anything near a device's share of the
    # pool (decode: only activations, ~1 KiB here; insert: none). The same gather written for
    # GSPMD over the split pool (global page ids) does, which the check sees.
    from jax.sharding import NamedSharding, PartitionSpec as P

    for impl in ("reference", "pallas_gpu"):
        engine, params = replica_engines("2x1x4", impl)
        assert engine._narrowing.widths == (engine.config.max_slots,)  # slots split over replicas: never narrowed
        state = engine.init_decode_state()
        local = state["cache"]["k"].addressable_shards[0].data.nbytes
        lowered = engine._decode_jit.lower(params, state, np.zeros(4, bool), None, truncate=True, top_n=0)
        text = lowered.compile().as_text()
        assert 0 < _largest_collective_bytes(text) < local // 8, impl
    inserts, real = [], engine._insert_jit

    def spy(*args):
        inserts.append(real.lower(*args).compile().as_text())
        return real(*args)

    monkeypatch.setattr(engine, "_insert_jit", spy)
    pair, _ = engine.prefill(params=params, padded_tokens=PROMPTS[9], true_length=10, sampling=GREEDY, seeds=(0, 1))
    state = engine.insert_batch(state, [(pair, 0, 0), (pair, 2, 1)])  # a prompt copy on each replica
    assert _largest_collective_bytes(inserts[0]) < local // 8
    for slot in (0, 2):
        engine.free_resource(slot)
    assert _all_free(engine)
    pool = jax.device_put(np.zeros(engine.shape.pool_shape, np.float32), state["cache"]["k"].sharding)
    table = jax.device_put(np.zeros((4, engine.shape.max_pages_per_seq), np.int32),
                           NamedSharding(pool.sharding.mesh, P("data")))
    gspmd = jax.jit(lambda x, t: x.at[0, :, t].get(mode="clip")).lower(pool, table).compile().as_text()
    assert _largest_collective_bytes(gspmd) >= local // 8
    del state


@pytest.mark.slow
def test_replica_pools_hold_their_own_pages(replica_engines, greedy_reference):
    # Two samples of one prompt on two replicas: each replica writes (and shares) its own copy of
    # the prompt's pages. Filling one replica's pool blocks inserts there only.
    engine, params = replica_engines("2x1x4")
    state = engine.init_decode_state()
    pair, _ = engine.prefill(params=params, padded_tokens=PROMPTS[31], true_length=32, sampling=GREEDY,
                             seeds=(0, 1, 2))
    state = engine.insert(pair, state, 0, sample_index=0)  # replica 0: 11 fresh pages, 8 shared
    state = engine.insert(pair, state, 2, sample_index=1)  # replica 1: its own 11 (a prompt copy)
    assert [engine.replica_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert [engine.free_pages(r) for r in (0, 1)] == [5, 5] and sorted(pair.shared_pages) == [0, 1]
    assert engine.pages_needed(pair, replica=0) == engine.pages_needed(pair, replica=1) == 3
    other, _ = engine.prefill(params=params, padded_tokens=PROMPTS[19], true_length=20, sampling=GREEDY)
    assert engine.pages_needed(other, replica=1) == 8 and not engine.can_insert(other)
    with pytest.raises(PoolExhausted, match="need 8 KV pages but only 5 of 16"):
        engine.insert(other, state, 3)
    engine.release_prefix(pair)
    small, _ = engine.prefill(params=params, padded_tokens=PROMPTS[5], true_length=6, sampling=GREEDY)
    assert engine.can_insert(small, replica=1) and engine.pages_needed(small) == 5
    state = engine.insert(small, state, 3)
    tokens = {0: [], 2: [], 3: []}
    for _ in range(MAX_NEW - 1):
        state, result = engine.generate(params, state)
        for slot in tokens:
            if result.valid[slot]:
                tokens[slot].append(int(result.tokens[slot]))
    assert tokens[0] == tokens[2] == greedy_reference[31][1:]
    assert tokens[3] == greedy_reference[5][1:]
    for slot in tokens:
        engine.free_resource(slot)
    engine.release_prefix(other)
    assert _all_free(engine)
    with pytest.raises(ValueError, match="split into 2 replica pools"):
        engine.allocator
    del state
