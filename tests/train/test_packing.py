"""Packed sequences (tpurl.train.packing) against the padded computation: the host packer's layout,
attention confined to each packed sequence, the next-token shift at boundaries, and the packed
logprobs, critic values and update equal to the padded ones (fp32, 1e-5), on one device and on
8 fake devices (FSDP x TP with micro-batches) against a single-device padded reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.models import forward_logits, init_model, preset
from tpurl.models.moe import MoeConfig
from tpurl.sharding.layout import Layout, MeshConfig, make_mesh
from tpurl.train.config import OptimizerConfig, algorithm_preset
from tpurl.train.correction import correction_preset
from tpurl.train.critic import make_value_fn
from tpurl.train.logprobs import make_logprob_fn
from tpurl.train.packing import PackingConfig, pack_batch, packed_rows_of
from tpurl.train.state import init_train_state
from tpurl.train.step import make_grad_fn, make_train_step
from train_helpers import max_rel, rel

V, B, T, PROMPT = 64, 16, 16, 4
RULES = (("batch", ("data", "fsdp")), ("embed", ("fsdp",)), ("heads", ("tensor",)), ("kv_heads", ("tensor",)),
         ("mlp", ("tensor",)), ("vocab", ("tensor",)))
LAYOUT = Layout(name="train", rules=RULES)
ALGO = algorithm_preset("grpo", eps_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01,
                        correction=correction_preset("tis"))
PPO = algorithm_preset("ppo")
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1)
PACK = PackingConfig(row_buckets=1 << 20)  # one row granularity: the tightest packing


@pytest.fixture(scope="module")
def model():
    return init_model(preset("tiny", vocab_size=V), seed=0)


def make_batch(rng, b=B):
    """Ragged sequences, mostly short (several fit a row), some left-padded, one empty, some with
    environment tokens inside the completion (multi-turn: valid, not in the loss); groups of 4
    share a prompt (packed once per row, `PackingConfig.share_prefixes`)."""
    valid = np.zeros((b, T), bool)
    lens = rng.integers(0, T - PROMPT + 1, b)
    short = np.arange(b) % 4 < 2  # every (shard, micro-batch) block gets short and long ones
    lens[short] = rng.integers(0, 4, short.sum())
    for i in range(b):
        valid[i, :PROMPT + lens[i]] = True
    valid[1::5, :2] = False  # left padding before the prompt
    valid[3] = False  # a row with no tokens at all
    loss_mask = valid & (np.arange(T)[None, :] >= PROMPT)
    # Multi-turn episodes: an environment's reply inside the completion (real tokens, never trained on).
    turns = np.flatnonzero((lens >= 6) & (np.arange(b) % 2 == 0))
    assert len(turns) >= 2
    loss_mask[turns, PROMPT + 2:PROMPT + 4] = False
    old = -4.0 + 0.3 * rng.normal(size=(b, T))
    tokens = rng.integers(0, V, (b, T)).astype(np.int32)
    tokens[:, :PROMPT] = np.repeat(tokens[::4, :PROMPT], 4, axis=0)  # groups of 4 share a prompt
    tokens[2, :PROMPT + 2] = tokens[0, :PROMPT + 2]  # and some share more
    return {
        "tokens": tokens, "valid": valid,
        "loss_mask": loss_mask.astype(np.float32), "advantages": rng.normal(size=b).astype(np.float32),
        "old_logprobs": old.astype(np.float32),
        "ref_logprobs": (old + 0.2 * rng.normal(size=(b, T))).astype(np.float32),
        "rollout_logprobs": (old + 0.2 * rng.normal(size=(b, T))).astype(np.float32),
    }


@pytest.fixture(scope="module")
def batch():
    return make_batch(np.random.default_rng(0))


@pytest.fixture(scope="module")
def head(model):
    rng = np.random.default_rng(3)
    return {"w": jnp.asarray(rng.normal(size=model.config.hidden_size), jnp.float32),
            "b": jnp.asarray(0.3, jnp.float32)}


def _check_layout(p, tokens, valid, shards, micro, length):
    """Every real token of every sequence maps to a packed column of its own (shard, micro-batch)
    block holding that token at that position, whose predecessor column holds the sequence's
    previous token; the columns seen by a token's query (`k <= q < ends[k]`) are exactly its
    sequence's columns so far. Returns how often each packed column is used."""
    b = len(tokens)
    r = p["packed_tokens"].shape[0]
    rb, bb = r // (shards * micro), b // (shards * micro)
    flat = {k: p[k].reshape(-1) for k in ("packed_tokens", "packed_positions", "packed_parents", "packed_ends")}
    used = np.zeros(r * length, int)
    for i in range(b):
        block = i // bb  # rows (s M + m) Bb + j form block (s, m)
        cols = np.flatnonzero(valid[i])
        local = p["unpack_index"][i, cols]
        rows = block * rb + local // length  # the block's k-th row is global row (s M + m) Rb + k
        assert len(set(rows)) <= 1
        pos = rows * length + local % length
        np.testing.assert_array_equal(flat["packed_tokens"][pos], tokens[i, cols])
        np.testing.assert_array_equal(flat["packed_positions"][pos], np.arange(len(cols)))
        parents = np.concatenate([[-1], local[:-1] % length])[:len(cols)]
        np.testing.assert_array_equal(flat["packed_parents"][pos], parents)
        for q in range(len(pos)):
            row_start = rows[q] * length
            seen = np.flatnonzero((np.arange(length) <= local[q] % length)
                                  & (local[q] % length < flat["packed_ends"][row_start:row_start + length]))
            np.testing.assert_array_equal(seen, np.sort(local[:q + 1] % length))
        used[pos] += 1
    assert (flat["packed_ends"][used == 0] == 0).all()  # everything else is padding
    return used


def test_pack_batch_layout(batch):
    """Plain packing: every real token lands once, in order and contiguous, in a row of its own
    (shard, micro-batch) block, with its position among the sequence's real tokens, its
    predecessor and the attention of its sequence alone."""
    tokens, valid = batch["tokens"], batch["valid"]
    shards, micro = 2, 2
    plain = PackingConfig(row_buckets=1 << 20, share_prefixes=False, min_row_length=0)
    p = pack_batch(tokens, valid, plain, shards=shards, micro_batches=micro)
    r = p["packed_tokens"].shape[0]
    assert r < B and r % (shards * micro) == 0 and p["packed_tokens"].shape[1] == T
    used = _check_layout(p, tokens, valid, shards, micro, T)
    assert used.sum() == valid.sum() and used.max() <= 1
    with pytest.raises(ValueError, match="multiple of 12"):
        pack_batch(tokens, valid, shards=3, micro_batches=4)
    with pytest.raises(ValueError, match="row_buckets"):
        PackingConfig(row_buckets=0)
    with pytest.raises(ValueError, match="min_row_length"):
        PackingConfig(min_row_length=-1)
    # Rows round up to a multiple of ceil(most / row_buckets): at most row_buckets sizes; one
    # bucket is the most rows a block can take (one sequence per row when rows are T long, one
    # per T tokens of a row when longer).
    tight = dict(share_prefixes=False, min_row_length=0)
    assert pack_batch(tokens, valid, PackingConfig(row_buckets=4, **tight))["packed_tokens"].shape[0] % -(-B // 4) == 0
    assert pack_batch(tokens, valid, PackingConfig(row_buckets=1, **tight))["packed_tokens"].shape[0] == B
    long_rows = pack_batch(tokens, valid, PackingConfig(row_buckets=1, min_row_length=4 * T))["packed_tokens"]
    assert long_rows.shape == (B // 4, 4 * T)


def group_batch(rng, groups=4, group=4, prompt=5, t=T):
    """GRPO-shaped rows: each group's samples share a (left-padded) prompt, some share more (equal
    first completion tokens), one repeats a sibling exactly, one is a prefix of a sibling, one is
    empty; completions of random lengths."""
    tokens = rng.integers(0, V, (groups * group, t)).astype(np.int32)
    tokens[:, :prompt] = np.repeat(tokens[::group, :prompt], group, axis=0)
    tokens[1, :prompt + 3] = tokens[0, :prompt + 3]
    valid = np.zeros(tokens.shape, bool)
    lens = rng.integers(1, t - prompt + 1, len(tokens))
    for i, n in enumerate(lens):
        valid[i, :prompt + n] = True
    valid[group:2 * group, :1] = False  # the second group's prompt is left-padded
    tokens[5], valid[5] = tokens[4], valid[4]  # an exact repeat
    tokens[6], valid[6] = tokens[7], valid[7] & (np.arange(t) < prompt + 1)  # a prefix of a sibling
    valid[9] = False  # no tokens at all
    return tokens, valid


@pytest.mark.parametrize("shards,micro", [(1, 1), (2, 2)])
def test_pack_batch_shares_prefixes(shards, micro):
    """Shared-prefix packing: each sequence still reads exactly its own tokens in order (one
    column per token, predecessors and attention as in its padded row), while a group's prompt is
    held once per row: fewer packed tokens than real tokens."""
    tokens, valid = group_batch(np.random.default_rng(5))
    cfg = PackingConfig(row_buckets=1 << 20)
    p = pack_batch(tokens, valid, cfg, shards=shards, micro_batches=micro)
    length = cfg.row_length(T, len(tokens) // (shards * micro))
    # Rows are 8 x T (128 tokens), but no longer than a block's padded rows: never more tokens
    # than padded.
    assert p["packed_tokens"].shape[1] == length == T * min(len(tokens) // (shards * micro), 8)
    assert p["packed_tokens"].size <= tokens.size
    used = _check_layout(p, tokens, valid, shards, micro, length)
    assert (used > 1).any()
    assert (p["packed_ends"] > 0).sum() < valid.sum()
    plain = pack_batch(tokens, valid, PackingConfig(row_buckets=1 << 20, share_prefixes=False), shards=shards,
                       micro_batches=micro)
    assert (plain["packed_ends"] > 0).sum() == valid.sum()


def test_attention_stays_within_segment_and_shift_at_boundary(model):
    """Two sequences share a packed row: changing the first one's tokens leaves the second's
    logprobs unchanged, and the second's logprobs are those of the sequence alone (its first
    token scores nothing; its second is predicted from its first, not from the neighbour)."""
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (2, T)).astype(np.int32)
    valid = np.zeros((2, T), bool)
    valid[0, :9], valid[1, :6] = True, True
    packed = pack_batch(tokens, valid, PACK)
    assert packed["packed_tokens"].shape[0] == 1  # both in one row
    fn = make_logprob_fn(graphdef, packing=PACK)
    lp = np.asarray(fn(params, tokens, valid)[0])
    other = tokens.copy()
    other[0] = rng.integers(0, V, T)
    lp_other = np.asarray(fn(params, other, valid)[0])
    np.testing.assert_array_equal(lp_other[1], lp[1])
    assert np.abs(lp_other[0] - lp[0]).max() > 1e-3
    # The second sequence alone, from full logits in float64.
    logits = np.asarray(forward_logits(model, jnp.asarray(tokens[1:2, :6])), np.float64)[0]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.zeros(T)
    want[1:6] = logits[np.arange(5), tokens[1, 1:6]] - logz[:5]
    np.testing.assert_allclose(lp[1], want, atol=1e-5)


@pytest.mark.slow
def test_packed_logprobs_and_values_equal_padded(model, batch, head):
    """Old/reference logprobs (one device, and 8 devices with 4 batch shards) and the critic's
    values (8 devices), packed, against the single-device padded computation."""
    graphdef, params = nnx.split(model)
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    sharded = jax.device_put(params, LAYOUT.param_shardings(params, mesh))
    packed = pack_batch(batch["tokens"], batch["valid"], PACK)
    assert (packed["packed_ends"] > 0).sum() < batch["valid"].sum()  # prompts really are shared
    want = make_logprob_fn(graphdef, temperature=0.7)(params, batch["tokens"], batch["valid"])
    assert np.abs(np.asarray(want[0])).max() > 0.5
    for kwargs, p in (({}, params), ({"mesh": mesh, "layout": LAYOUT}, sharded)):
        got = make_logprob_fn(graphdef, temperature=0.7, packing=PACK, **kwargs)(p, batch["tokens"], batch["valid"])
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    want_v = np.asarray(make_value_fn(graphdef)(params, head, batch["tokens"], batch["valid"]))
    got_v = make_value_fn(graphdef, mesh=mesh, layout=LAYOUT, packing=PACK)(sharded, head, batch["tokens"],
                                                                          batch["valid"])
    np.testing.assert_allclose(np.asarray(got_v), want_v, atol=1e-5)
    assert np.abs(want_v).max() > 0.1
    # Scored in 2 micro-batches (a pass holds one chunk's activations): the same outputs.
    chunked = make_logprob_fn(graphdef, temperature=0.7, packing=PACK, mesh=mesh, layout=LAYOUT, micro_batches=2)
    for g, w in zip(chunked(sharded, batch["tokens"], batch["valid"]), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    chunked_v = make_value_fn(graphdef, mesh=mesh, layout=LAYOUT, packing=PACK, micro_batches=2)
    np.testing.assert_allclose(np.asarray(chunked_v(sharded, head, batch["tokens"], batch["valid"])), want_v, atol=1e-5)
    with pytest.raises(ValueError, match="micro_batches"):
        make_logprob_fn(graphdef, micro_batches=3)(params, batch["tokens"], batch["valid"])


GRAD_METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max",
                "ratio_min", "correction/weight_mean", "mismatch/kl_k3", "mismatch/ratio_p99", "grad_norm", "tokens")


@pytest.mark.slow
def test_packed_critic_gradients_equal_padded(model, batch, head):
    """PPO's value loss through the packed forward: policy and value-head gradients."""
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(4)
    mask = batch["loss_mask"]
    ppo = {k: batch[k] for k in ("tokens", "valid", "loss_mask", "old_logprobs")}
    ppo.update(advantages=(rng.normal(size=(B, T)) * mask).astype(np.float32),
               returns=(rng.normal(size=(B, T)) * mask).astype(np.float32),
               old_values=(0.1 * rng.normal(size=(B, T)) * mask).astype(np.float32))
    want_g, want_m = make_grad_fn(graphdef, PPO)(params, ppo, head)
    got_g, got_m = make_grad_fn(graphdef, PPO, micro_batches=2, packing=PACK)(params, ppo, head)
    assert max_rel(got_g, want_g) <= 1e-5
    assert rel(got_m["value_loss"], want_m["value_loss"]) <= 1e-5 and float(want_m["value_loss"]) > 0


@pytest.mark.slow
def test_packed_update_equals_padded(model, batch):
    """Two optimizer steps, packed on 8 devices with 2 micro-batches, against the padded single-
    device step: updated parameters and metrics."""
    graphdef = nnx.graphdef(model)
    ref_step = make_train_step(graphdef, ALGO, OPT)
    ref1, ref_m = ref_step(init_train_state(model, OPT), batch)
    ref2, ref_m2 = ref_step(ref1, batch)
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    step = make_train_step(graphdef, ALGO.replace(micro_batches=2), OPT, mesh=mesh, layout=LAYOUT,
                           packing=PackingConfig(row_buckets=4))
    st1, m1 = step(init_train_state(model, OPT, mesh=mesh, layout=LAYOUT), batch)
    st2, m2 = step(st1, batch)
    assert max_rel(st2.params, ref2.params) <= 1e-5
    for key in GRAD_METRICS:
        np.testing.assert_allclose(float(m2[key]), float(ref_m2[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(float(m1["loss"]), float(ref_m["loss"]), rtol=1e-5)


def test_a_batch_packed_for_other_blocks_is_refused(model, batch):
    """A batch prepared (packed and placed) for 2 micro-batches, read by a scoring pass or an update
    that splits it into 1 or 4, or into other batch shards, is a one-line error naming both
    formats: its blocks would otherwise be read as other sequences. Its own readers take it."""
    graphdef, params = nnx.split(model)
    mesh = make_mesh(MeshConfig(shape=(2, 2, 2)))
    sharded = jax.device_put(params, LAYOUT.param_shardings(params, mesh))
    step = make_train_step(graphdef, ALGO.replace(micro_batches=2), OPT, mesh=mesh, layout=LAYOUT, packing=PACK)
    prepared = step.prepare(batch)
    assert np.shape(prepared["packed_format"]) == (4, 2)  # 4 batch shards (data x fsdp), 2 micro-batches
    own = make_logprob_fn(graphdef, mesh=mesh, layout=LAYOUT, packing=PACK, micro_batches=2)
    own.on_batch(sharded, prepared)
    for micro in (1, 4):
        other = make_logprob_fn(graphdef, mesh=mesh, layout=LAYOUT, packing=PACK, micro_batches=micro)
        with pytest.raises(ValueError, match=rf"packed for .* = \(4, 2\) is read as \(4, {micro}\)") as err:
            other.on_batch(sharded, prepared)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"= \(4, 2\) is read as \(1, 2\)"):
        make_train_step(graphdef, ALGO.replace(micro_batches=2), OPT, packing=PACK)(init_train_state(model, OPT),
                                                                                    prepared)


def test_packed_rows_of_keeps_a_known_value_in_a_shared_column():
    """Two sequences share a prompt column; one of them never recorded a value there (-1): the
    packed column takes the other's whatever their order. `packed_counts` counts both."""
    tokens = np.array([[5, 6, 7, 0], [5, 6, 8, 0]], np.int32)
    valid = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], bool)
    p = pack_batch(tokens, valid, PACK)
    assert (p["packed_ends"] > 0).sum() == 4  # the two prompt tokens are held once
    for values in (np.array([[3, -1, 4, -1], [-1, 2, 5, -1]]), np.array([[-1, 2, 4, -1], [3, -1, 5, -1]])):
        got = packed_rows_of(values, p["unpack_index"], valid, p["packed_tokens"].shape, 1, -1)
        at = p["unpack_index"]
        assert got[0, at[0, 0]] == 3 and got[0, at[0, 1]] == 2 and got[0, at[0, 2]] == 4 and got[0, at[1, 2]] == 5
    counts = np.zeros(p["packed_tokens"].shape, np.int32)  # one per sequence through a column
    for b, t in zip(*np.nonzero(valid)):
        counts[0, p["unpack_index"][b, t]] += 1
    np.testing.assert_array_equal(counts, p["packed_counts"])
    assert sorted(counts[counts > 0].tolist()) == [1, 1, 2, 2]


@pytest.mark.slow
def test_packed_router_losses_and_replay_equal_padded(batch):
    """A mixture-of-experts model's update with router replay and the routers' losses, its groups'
    prompts packed once: gradients and the routers' metrics equal the padded computation's (each
    shared column counts once per sequence through it)."""
    moe = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,),
                    balance_loss_coef=0.1, z_loss_coef=0.01, router_replay=True)
    graphdef, params = nnx.split(init_model(preset("tiny-moe", vocab_size=V, num_layers=3, moe=moe), seed=0))
    # Replayed routes: a function of the sequence's real tokens so far (shared prefixes share
    # routes), -1 (the token's own) on padding.
    prefix_hash = np.cumsum((batch["tokens"].astype(np.int64) * 7 + 3) * batch["valid"], axis=1)
    first = prefix_hash[..., None] + np.arange(2)[None, None, :] * 5  # [B, T, sparse layers]
    routes = np.stack([first % 4, (first + 1 + first // 4 % 3) % 4], axis=-1).astype(np.int16)
    routes[~batch["valid"]] = -1
    moe_batch = {**batch, "routes": routes}
    want_g, want_m = make_grad_fn(graphdef, ALGO)(params, moe_batch)
    got_g, got_m = make_grad_fn(graphdef, ALGO, packing=PACK)(params, moe_batch)
    assert max_rel(got_g, want_g) <= 1e-5
    keys = [k for k in want_m if k.startswith("moe/")]
    assert {"moe/l0/balance", "moe/l2/balance", "moe/route_agreement"} <= set(keys)
    assert float(want_m["moe/route_agreement"]) < 0.9  # the replay really overrode the routers
    for key in keys:
        np.testing.assert_allclose(float(got_m[key]), float(want_m[key]), rtol=1e-5, atol=1e-7, err_msg=key)
