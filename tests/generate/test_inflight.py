"""In-flight weight updates: new weights published into a `WeightSlot` (from another thread) reach a
running `generate` call between two decode steps. The publish is made deterministic by a pool whose
decode step `at` hands control to the publishing thread and waits for it.

What "the new policy's teacher-forced logprobs" means with the KV kept: a token sampled after the
switch is predicted by the new weights from the old weights' keys and values at the positions the
old weights wrote. The exact reference is therefore a dense forward of the new weights in which
every layer attends to the old weights' K/V at those positions (`_mixed_logprobs`); the positions
the old weights wrote are the prompt and every token fed to a decode step before the switch. A
plain forward of the new weights differs from it (checked, so the reference is not vacuous)."""

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, KVPool, SamplingConfig, Weights, WeightSlot, generate
from tpurl.models import init_model, preset
from tpurl.models.attention import DenseAttention
from tpurl.threads import WrongThread

CFG = preset("tiny")
OLD, NEW = 3, 4  # policy versions
AT = 5  # decode steps before the publish
MAX_NEW = 20
ENGINE = dict(max_slots=4, max_seq_len=48, page_size=4, prefill_buckets=(16,), max_stop_tokens=8)
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=MAX_NEW, stop_token_ids=tuple(range(120, 128)))
PROMPTS = [np.random.default_rng(11 + n).integers(3, 90, n).tolist() for n in (3, 9, 14, 5, 11, 7)]


@pytest.fixture(scope="module")
def models():
    graphdef, old = nnx.split(init_model(CFG, seed=3))
    _, new = nnx.split(init_model(CFG, seed=4))
    return graphdef, old, new


def _copy(params):
    """A copy of `params` for the slot to own (freeing it leaves the fixture's arrays alone)."""
    return jax.tree.map(jnp.copy, params)


def _owned(params, version: int) -> Weights:
    return Weights(params, version, tuple(jax.tree.leaves(params)))


class _HookedPool(KVPool):
    """A KV pool that calls `hooks[n]()` right after its n-th decode step (1-based)."""

    def __init__(self, engine, hooks):
        super().__init__(engine)
        self.hooks, self.steps = hooks, 0

    def step(self, params, **kw):
        result = super().step(params, **kw)
        self.steps += 1
        if self.steps in self.hooks:
            self.hooks[self.steps]()
        return result


class _Publisher:
    """A thread that publishes `weights` into `slot` once `go` is set."""

    def __init__(self, slot: WeightSlot, weights: Weights, *, drain: bool):
        self.go, self.done = threading.Event(), threading.Event()
        self.slot, self.weights, self.drain = slot, weights, drain
        self.thread = threading.Thread(target=self._run, daemon=True)  # never keeps a failed run alive
        self.thread.start()

    def _run(self):
        if not self.go.wait(120):
            return
        with self.slot.loading(drain=self.drain) as publish:
            publish(self.weights)
        self.done.set()


class _OldKVAttention(DenseAttention):
    """Dense causal attention whose keys and values at the positions `old_T` marks are replaced by
    given ones (the layer's slice of `cache`, from a forward of the old weights); returns the K/V
    it used."""

    def __init__(self, valid_BT, old_T: np.ndarray):
        super().__init__(valid_BT, "xla")
        self.old_T = old_T

    def __call__(self, q, k, v, cache):
        if cache is not None:
            old_1T11 = jnp.asarray(self.old_T)[None, :, None, None]
            k, v = jnp.where(old_1T11, cache[0], k), jnp.where(old_1T11, cache[1], v)
        out, _ = super().__call__(q, k, v, None)
        return out, (k, v)


def _log_softmax(logits, temperature):
    x = np.asarray(logits, np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@functools.cache
def _reference_logits(graphdef):
    """A jitted dense forward: the logits of `new` over `seq_1L` with the K/V of the positions
    `old_L` marks taken from a forward of `old` (one program for every sequence: they are padded to
    the engine's length at the end, which causal attention keeps from the earlier positions)."""

    @jax.jit
    def logits(old, new, seq_1L, old_L):
        valid, pos = jnp.ones(seq_1L.shape, bool), jnp.arange(seq_1L.shape[1])[None]
        _, kv_old = nnx.merge(graphdef, old)(seq_1L, pos, attention=_OldKVAttention(valid, old_L))
        model = nnx.merge(graphdef, new)
        hidden, _ = model(seq_1L, pos, attention=_OldKVAttention(valid, old_L), cache=kv_old)
        return model.logits(hidden)[0]

    return logits


def _mixed_logprobs(graphdef, old, new, prompt, tokens, old_T, temperature: float) -> np.ndarray:
    """Teacher-forced logprobs of `tokens` under `new` with the K/V of the positions `old_T` marks
    (over prompt + tokens; None: none) from `old`."""
    ids = list(prompt) + list(tokens)
    seq = np.zeros((1, ENGINE["max_seq_len"]), np.int32)
    seq[0, :len(ids)] = ids
    old_L = np.zeros(seq.shape[1], bool)
    if old_T is not None:
        old_L[:len(ids)] = old_T
    logits = np.asarray(_reference_logits(graphdef)(old, new, seq, old_L))[:len(ids)]
    logp = _log_softmax(logits, temperature)
    n = len(prompt)
    return logp[np.arange(n - 1, n - 1 + len(tokens)), tokens]


def _old_kv(c, prompt_len: int) -> np.ndarray:
    """Which positions of prompt + tokens hold KV the old weights wrote. The prompt's is written by
    the prefill, which samples token 0; a token's (sampled or the environment's) by the call that
    is fed it, i.e. the one that samples the next model token after it (a decode step or an extend)."""
    n = len(c.token_ids)
    writer = np.full(n, -1)
    nxt = -1
    for t in range(n - 1, -1, -1):
        writer[t] = nxt  # the version of the first model token after t (-1: never fed)
        if c.model_mask[t]:
            nxt = c.versions[t]
    return np.concatenate([np.full(prompt_len, c.versions[0] == OLD), writer == OLD])


def _check_against_dense(graphdef, old, new, c, prompt) -> bool:
    """Every model token's logprob equals the reference forward (old weights before the switch,
    new weights on the old weights' KV after it); True when the switch came mid-sequence."""
    t = _first_new(c)
    mask = c.model_mask
    want_old = _mixed_logprobs(graphdef, old, old, prompt, c.token_ids, None, SAMPLING.temperature)
    want_new = _mixed_logprobs(graphdef, old, new, prompt, c.token_ids, _old_kv(c, len(prompt)),
                               SAMPLING.temperature)
    np.testing.assert_allclose(c.logprobs[:t][mask[:t]], want_old[:t][mask[:t]], atol=1e-5)
    np.testing.assert_allclose(c.logprobs[t:][mask[t:]], want_new[t:][mask[t:]], atol=1e-5)
    if not 0 < t < len(c.token_ids):
        return False
    plain_new = _mixed_logprobs(graphdef, old, new, prompt, c.token_ids, None, SAMPLING.temperature)
    assert np.abs(plain_new[t:] - c.logprobs[t:])[mask[t:]].max() > 1e-3  # the kept KV matters
    return True


def _first_new(c) -> int:
    """Index of the first token sampled by the new weights (len when none)."""
    return int(np.argmax(c.versions == NEW)) if (c.versions == NEW).any() else len(c.versions)


def _run(models, hooks_for, *, drain=False, on_turn_end=None):
    """generate with OLD weights in a slot, NEW published after decode step AT by another thread."""
    graphdef, old, new = models
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=graphdef)
    slot = WeightSlot(_owned(_copy(old), OLD))
    old_weights = slot.current
    pub = _Publisher(slot, _owned(_copy(new), NEW), drain=drain)
    with _HookedPool(engine, hooks_for(slot, pub, old_weights)) as pool:
        out = generate(engine, slot, PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, pool=pool,
                       on_turn_end=on_turn_end)
    pub.thread.join(timeout=60)
    return out, slot, old_weights, engine


def _continue_hooks(slot, pub, old_weights):
    def publish():
        pub.go.set()
        assert pub.done.wait(timeout=60)
        # Published, but the scheduler has not polled yet: it still holds (and may use) the old weights.
        assert slot.held() == [OLD] and not any(x.is_deleted() for x in old_weights.owned)

    def after_switch():
        assert slot.held() == [NEW] and all(x.is_deleted() for x in old_weights.owned)

    return {AT: publish, AT + 1: after_switch}


@pytest.mark.slow
def test_a_sync_mid_decode_switches_later_tokens_to_the_new_weights(models):
    graphdef, old, new = models
    out, slot, old_weights, engine = _run(models, _continue_hooks)
    assert engine.stats["weight_switches"] == 1
    completions = [c for row in out for c in row]
    mid = 0
    for c in completions:
        t = _first_new(c)
        # Every token before the switch carries the old version, every token after it the new one.
        np.testing.assert_array_equal(c.versions, np.where(np.arange(len(c.versions)) < t, OLD, NEW))
        mid += _check_against_dense(graphdef, old, new, c, PROMPTS[c.prompt_index])
    assert mid >= 3  # sequences running at the switch went on with the new weights
    assert any(_first_new(c) == 0 for c in completions)  # prompts prefilled after it are new throughout
    assert slot.held() == [] and slot.current.version == NEW
    assert not any(x.is_deleted() for x in slot.current.owned)  # the current weights stay


def _tool(i, j, token_ids):
    """Two more turns per episode, each after an observation of 1-4 tokens."""
    turns = int(np.isin(token_ids, SAMPLING.stop_token_ids).sum())
    return None if turns > 2 else np.random.default_rng([i, j, turns]).integers(3, 90, 1 + (i + j) % 4).tolist()


@pytest.mark.slow
def test_a_switch_between_turns_writes_the_observation_with_the_new_weights(models):
    graphdef, old, new = models
    out, slot, _, engine = _run(models, _continue_hooks, on_turn_end=_tool)
    mid = resumed_on_new = 0
    for c in (c for row in out for c in row):
        t = _first_new(c)
        model_t = np.arange(len(c.versions))[c.model_mask]
        np.testing.assert_array_equal(c.versions[c.model_mask], np.where(model_t < t, OLD, NEW))
        assert (c.versions[~c.model_mask] == -1).all()
        mid += _check_against_dense(graphdef, old, new, c, PROMPTS[c.prompt_index])
        old_kv = _old_kv(c, len(PROMPTS[c.prompt_index]))[len(PROMPTS[c.prompt_index]):]
        resumed_on_new += c.versions[0] == OLD and (~old_kv & ~c.model_mask).any()
    assert mid >= 3 and engine.stats["extends"] > 0
    assert resumed_on_new  # an episode started on the old weights had an observation written by the new


@pytest.mark.slow
def test_tokens_before_the_switch_equal_a_run_without_one(models):
    graphdef, old, _ = models
    out, *_ = _run(models, _continue_hooks)
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=graphdef)
    ref = generate(engine, old, PROMPTS, n_samples=2, sampling=SAMPLING, seed=1, version=OLD)
    for row, ref_row in zip(out, ref):
        for c, r in zip(row, ref_row):
            t = _first_new(c)
            assert c.token_ids[:t].tolist() == r.token_ids[:t].tolist()
            np.testing.assert_allclose(c.logprobs[:t], r.logprobs[:t], atol=1e-6)
            assert (r.versions == OLD).all()


def _drain_hooks(slot, pub, old_weights):
    def start_sync():
        pub.go.set()
        deadline = time.monotonic() + 60
        while not slot.pending and time.monotonic() < deadline:  # the publisher reached its drain wait
            time.sleep(0.001)
        assert slot.pending

    def still_draining():
        assert not pub.done.is_set() and slot.held() == [OLD]
        assert not any(x.is_deleted() for x in old_weights.owned)

    return {AT: start_sync, AT + 2: still_draining}


@pytest.mark.slow  # two generate calls with a sync between, over 5 s
def test_drain_keeps_one_version_per_call_and_syncs_after_it(models):
    out, slot, old_weights, engine = _run(models, _drain_hooks, drain=True)
    assert engine.stats["weight_switches"] == 0
    assert all((c.versions == OLD).all() for row in out for c in row)
    assert slot.current.version == NEW
    assert all(x.is_deleted() for x in old_weights.owned)  # freed before the new weights were published


def test_a_sync_with_no_reader_frees_the_old_weights_first():
    old = _owned(jnp.arange(4.0) + 0, 0)
    slot = WeightSlot(old)
    with slot.loading(drain=False) as publish:
        assert old.owned[0].is_deleted()  # the sync never holds two copies when no one decodes
        with pytest.raises(RuntimeError, match="no weights"):
            _ = slot.current
        publish(_owned(jnp.ones(4), 1))
    held = slot.hold()
    assert held.version == 1 and slot.held() == [1]
    with pytest.raises(RuntimeError, match="readers still hold"):
        slot.close()
    slot.release(held)
    slot.close()
    assert held.owned[0].is_deleted()


def test_generate_takes_the_version_from_the_slot(models):
    graphdef, old, _ = models
    engine = Engine(CFG, EngineConfig(**ENGINE), graphdef=graphdef)
    with pytest.raises(ValueError, match="drop version="):
        generate(engine, WeightSlot(Weights(old, 1)), PROMPTS, n_samples=1, sampling=SAMPLING, seed=1, version=2)


def test_a_drain_from_a_reading_thread_raises_instead_of_waiting_for_itself():
    """`loading(drain=True)` waits for the readers to let go: from a reader's own thread it would
    wait forever, so it raises; from another thread it still waits for the readers."""
    slot = WeightSlot(Weights(None, 0))
    outcome = []

    def reader(drain: bool):
        held = slot.hold()
        try:
            with slot.loading(drain=drain) as publish:
                publish(Weights(None, 1 + len(outcome)))
            outcome.append("loaded")
        except WrongThread as e:
            outcome.append(str(e))
        finally:
            slot.release(held)
    for drain in (True, False):
        thread = threading.Thread(target=reader, args=(drain,), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the load waits for its own thread's hold"
    assert outcome[0].startswith("WeightSlot.loading(drain=True): called from a thread that holds the weights")
    assert outcome[1] == "loaded" and slot.current.version == 2  # without draining, it lands at once
    held = slot.hold()
    drainer = threading.Thread(target=_load, args=(slot, Weights(None, 3)), daemon=True)
    drainer.start()
    time.sleep(0.1)
    assert drainer.is_alive() and slot.pending  # another thread's drain waits for the reader
    slot.release(held)
    drainer.join(10)
    assert not drainer.is_alive() and slot.current.version == 3


def _load(slot: WeightSlot, weights: Weights) -> None:
    with slot.loading(drain=True) as publish:
        publish(weights)
