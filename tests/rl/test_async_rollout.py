"""The rollout producers of asynchronous RL on their own, with a fake rollout side: the version
schedule (never more than `max_staleness` versions old), who blocks on whom, and the thread's
lifecycle (errors raised in the main thread, no thread left behind on errors, interrupts or early
exits); the inline producer (`overlap="dispatch"`) keeps the same schedule on the main thread."""

import contextlib
import threading
import time
import types

import pytest

from tpurl.rl.async_rollout import AsyncConfig, RolloutProducer
from tpurl.rl.collect import Collected
from tpurl.rl.inline_rollout import InlineProducer
from tpurl.rl.timeline import Timeline


class FakeRollout:
    """Records loads and the window; `version` is the loaded weights' version."""

    in_flight = "drain"
    before_step = None  # the hook of `between_steps`, while set

    def __init__(self, version=0):
        self.version, self.loads, self.windows = version, [], []

    @property
    def params(self):
        return f"w{self.version}"

    def load(self, params, *, version):
        assert params == f"w{version}"
        self.loads.append(version)
        self.version = version

    def open(self):
        self.windows.append(("open", threading.current_thread().name))

    def close(self):
        self.windows.append(("close", threading.current_thread().name))

    @contextlib.contextmanager
    def between_steps(self, fn):
        self.before_step = fn
        yield
        self.before_step = None

    def agree(self, flag):
        return flag


def fake_sample(rollout, log, fail_at=None, delay=0.0):
    def sample(step, cursor, tl):
        if step == fail_at:
            raise ValueError(f"grader broke at step {step}")
        time.sleep(delay)
        log.append((step, rollout.version, cursor))
        return Collected(rollouts=None, cursor=cursor + 10, tokens_generated=1, metrics={})
    return sample


def rollout_threads():
    return [t for t in threading.enumerate() if t.name == "tpurl-rollout"]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    assert not rollout_threads()


def train(producer, first, stop, version, update_s=0.0):
    """The main thread's side: take each batch, 'update' (version + 1), publish when wanted."""
    got = []
    for step in range(first, stop):
        batch = producer.get()
        got.append((batch.step, batch.version))
        time.sleep(update_s)
        version += 1
        if producer.wants(version):
            producer.publish(version, f"w{version}")
    return got


@pytest.mark.parametrize("s", [1, 2, 3])
@pytest.mark.parametrize("rollout_s, update_s", [(0.0, 0.01), (0.01, 0.0)])
def test_each_batch_is_sampled_by_the_oldest_version_the_bound_allows(s, rollout_s, update_s):
    rollout, log = FakeRollout(version=5), []
    with RolloutProducer(rollout, fake_sample(rollout, log, delay=rollout_s), first_step=3, stop_step=11, cursor=100,
                         max_staleness=s) as producer:
        got = train(producer, 3, 11, version=5, update_s=update_s)
    want = [(j, 5 + max(0, j - 3 - s)) for j in range(3, 11)]
    assert got == want
    # The batch of step j trains version 5 + (j - 3): at most s versions behind it.
    assert all(0 <= (5 + j - 3) - v <= s for j, v in got)
    assert [(j, v) for j, v, _ in log] == want  # the weights that sampled = the version reported
    assert [c for _, _, c in log] == list(range(100, 180, 10))  # the data cursor carries over
    assert rollout.loads == sorted(set(v for _, v in want) - {5})  # one load per new version, in order
    assert [w for w, _ in rollout.windows] == ["open", "close"]
    assert {name for _, name in rollout.windows} == {"tpurl-rollout"}  # on the producer's thread


def _until(condition, timeout: float = 60.0) -> None:
    """Wait until `condition()` holds (a loaded machine may take long), failing after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_at_most_max_staleness_batches_wait():
    rollout, log = FakeRollout(), []
    producer = RolloutProducer(rollout, fake_sample(rollout, log), first_step=0, stop_step=6, cursor=0,
                               max_staleness=2)
    with producer:
        _until(lambda: len(log) >= 3)  # nobody takes batches: the producer fills the queue, then blocks
        time.sleep(0.3)
        assert [j for j, _, _ in log] == [0, 1, 2]  # two waiting, the third blocked on its delivery
        assert producer.get().step == 0
        time.sleep(0.2)
        assert len(log) == 3  # batch 3 needs version 1, which no update has published
        producer.publish(1, "w1")
        _until(lambda: len(log) >= 4)
        assert [j for j, _, _ in log] == [0, 1, 2, 3]


def test_the_producers_error_is_raised_in_the_main_thread():
    rollout = FakeRollout()
    with pytest.raises(ValueError, match="grader broke at step 2"):
        with RolloutProducer(rollout, fake_sample(rollout, [], fail_at=2), first_step=0, stop_step=5, cursor=0,
                             max_staleness=1) as producer:
            train(producer, 0, 5, version=0)
    assert rollout.windows[-1][0] == "close"  # the window closed on the failing thread


@pytest.mark.parametrize("blocked_on", ["version", "delivery"])
def test_close_stops_a_blocked_producer(blocked_on):
    rollout = FakeRollout()
    producer = RolloutProducer(rollout, fake_sample(rollout, []), first_step=0, stop_step=10, cursor=0,
                               max_staleness=1).start()
    if blocked_on == "version":
        producer.get(), producer.get()  # batch 2 needs version 1: never published
    time.sleep(0.2)
    t0 = time.perf_counter()
    producer.close()
    assert time.perf_counter() - t0 < 2.0 and not rollout_threads()
    assert rollout.windows[-1][0] == "close"


def test_an_interrupt_in_the_main_thread_leaves_no_thread():
    rollout = FakeRollout()
    with pytest.raises(KeyboardInterrupt):
        with RolloutProducer(rollout, fake_sample(rollout, [], delay=0.05), first_step=0, stop_step=10, cursor=0,
                             max_staleness=1) as producer:
            producer.get()
            raise KeyboardInterrupt


def test_misuse_is_a_clear_error():
    rollout = FakeRollout()
    producer = RolloutProducer(rollout, fake_sample(rollout, []), first_step=0, stop_step=4, cursor=0, max_staleness=1)
    with pytest.raises(RuntimeError, match="not running"):
        producer.get()
    with pytest.raises(ValueError, match="sampled with version 4"):
        producer.publish(4, "w4")  # the last batch (step 3) uses version 2
    with pytest.raises(ValueError, match="max_staleness=0 must be >= 1"):
        RolloutProducer(rollout, fake_sample(rollout, []), first_step=0, stop_step=4, cursor=0, max_staleness=0)
    with producer:
        train(producer, 0, 4, version=0)
        with pytest.raises(RuntimeError, match="every batch of steps"):
            producer.get()


@pytest.mark.parametrize("change, match", [
    (dict(max_staleness=-1), "max_staleness=-1 must be >= 0"),
    (dict(in_flight="sometimes"), "in_flight='sometimes' is unknown; use 'continue'"),
    (dict(max_staleness=1.0), "max_staleness=1.0 must be an int"),
    (dict(overlap="fibers"), r"AsyncConfig.overlap='fibers'; use one of \('thread', 'dispatch'\)"),
    (dict(overlap="dispatch", max_staleness=2), "overlap='dispatch' samples one batch ahead.*use max_staleness=1"),
])
def test_async_config_errors(change, match):
    with pytest.raises(ValueError, match=match) as e:
        AsyncConfig(**change)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("s", [1, 2, 3])
def test_the_inline_producer_keeps_the_threads_schedule_on_the_main_thread(s):
    """`overlap="dispatch"`: the batch of step j + 1 is sampled during step j (`sample_ahead`, after
    the update is dispatched; its weights loaded before, `load_next`), with the versions, loads
    and cursors of the thread's schedule. (The config allows only s = 1; the producer keeps the
    schedule for any s.)"""
    rollout, log = FakeRollout(version=5), []
    got, version = [], 5
    with InlineProducer(rollout, fake_sample(rollout, log), first_step=3, stop_step=11, cursor=100,
                        max_staleness=s) as producer:
        for step in range(3, 11):
            batch = producer.get()
            got.append((batch.step, batch.version))
            producer.load_next()
            assert rollout.version == producer.version_for(min(step + 1, 10))
            producer.sample_ahead()
            assert len(log) == min(step + 2, 11) - 3  # the next batch is already sampled
            version += 1
            if producer.wants(version):
                producer.publish(version, f"w{version}")
    want = [(j, 5 + max(0, j - 3 - s)) for j in range(3, 11)]
    assert got == want and [(j, v) for j, v, _ in log] == want
    assert [c for _, _, c in log] == list(range(100, 180, 10))
    assert rollout.loads == sorted(set(v for _, v in want) - {5})
    assert rollout.windows == [("open", "MainThread"), ("close", "MainThread")]


def test_the_inline_producer_notes_when_the_update_ended():
    """The train pool is idle from the end of its update to the end of the batch sampled beside it."""
    import jax.numpy as jnp

    rollout = FakeRollout()
    holder = {}
    sample = fake_sample(rollout, [])

    def after_the_update(step, cursor, tl):  # the batch ends well after the watcher noted the update's end
        if step == 1:
            _, done = holder["producer"]._watch
            deadline = time.perf_counter() + 30
            while not done and time.perf_counter() < deadline:
                time.sleep(0.01)
            time.sleep(0.15)
        return sample(step, cursor, tl)
    producer = holder["producer"] = InlineProducer(rollout, after_the_update, first_step=0, stop_step=3, cursor=0,
                                                   max_staleness=1)
    producer.get()
    start = time.perf_counter()
    producer.sample_ahead(jnp.ones(4) * 2)  # an update that is done long before the batch
    end = time.perf_counter() + 0.01
    (a, done), (ahead_end, b) = producer.train_busy(start, end)
    assert (a, b) == (start, end) and start <= done < ahead_end <= end and ahead_end - done > 0.1
    assert producer.train_busy(start, end) == [(start, end)]  # nothing dispatched beside since
    producer.close()
    # A batch whose weights were not loaded first is a clear error, not a silent load.
    late = InlineProducer(rollout, fake_sample(rollout, []), first_step=0, stop_step=4, cursor=0, max_staleness=1)
    late.get(), late.get()
    late._pending[1] = "w1"  # published, never loaded
    with pytest.raises(RuntimeError, match="needs version 1, the rollout holds 0; call load_next"):
        late.sample_ahead()
    late.close()


def test_the_inline_producer_lands_a_finished_update_before_a_decode_step_in_flight(monkeypatch):
    """in_flight="continue": the update's weights load before the first decode round after the
    update has finished (here: the second), so the batch's later rounds sample with them; an
    update that outlasts its batch is loaded by `load_next` before the next one; none is
    published, and the last step's is dropped (no batch is left)."""
    import jax.numpy as jnp

    rollout, rounds = FakeRollout(), []
    rollout.in_flight = "continue"
    rollout.load = lambda params, *, version: (rollout.loads.append(version), setattr(rollout, "version", version))

    def sample(step, cursor, tl):
        for _ in range(3):  # three decode rounds
            if rollout.before_step is not None:
                rollout.before_step()
            rounds.append((step, rollout.version))
        return Collected(rollouts=None, cursor=cursor + 10, tokens_generated=3, metrics={})

    # Update k counts as finished from the second poll of the batch beside it, except update 1 (never).
    polls = {}

    def update_done(self, params):
        polls[self._next] = polls.get(self._next, 0) + 1
        return self._next != 2 and polls[self._next] >= 2 and params.is_ready()
    monkeypatch.setattr(InlineProducer, "_update_done", update_done)
    with InlineProducer(rollout, sample, first_step=0, stop_step=4, cursor=0, max_staleness=1) as producer:
        for step in range(4):
            producer.get()
            producer.load_next()
            assert not producer.wants(step + 1)
            producer.sample_ahead(land=(jnp.ones(2) * step, step + 1))
    assert rounds == [(0, 0), (0, 0), (0, 0),  # sampled before any update
                      (1, 0), (1, 1), (1, 1),  # update 0 lands before the second round
                      (2, 1), (2, 1), (2, 1),  # update 1 never during batch 2 ...
                      (3, 2), (3, 3), (3, 3)]  # ... so load_next loads it before batch 3
    assert rollout.loads == [1, 2, 3]  # update 3's weights: no batch left to sample with them
    with pytest.raises(ValueError, match="max_staleness must be 1, not 2"):
        InlineProducer(rollout, sample, first_step=0, stop_step=4, cursor=0, max_staleness=2)


@pytest.mark.parametrize("kind", [RolloutProducer, InlineProducer])
def test_both_producers_follow_one_protocol(kind):
    """The step's calls (`tpurl.rl.async_step.AsyncSteps`), the same for both producers: the same
    batches and loads; after the segment's last update the producer has stopped and the rollout
    side holds the trainer's weights (phase `sync`), and the earlier steps `publish` when wanted."""
    rollout, log = FakeRollout(version=2), []
    producer = kind(rollout, fake_sample(rollout, log), first_step=0, stop_step=5, cursor=0, max_staleness=1,
                    snapshot=lambda params: params).start()
    got, phases, version = [], [], 2
    try:
        while not producer.done:
            tl = Timeline()
            batch = producer.get()
            producer.before_update(tl)
            beside = producer.beside_update(version + 1)
            if beside is not None:
                beside((types.SimpleNamespace(params=f"w{version + 1}"), {}))
            version += 1
            after = Timeline()
            producer.after_update(f"w{version}", version, after)
            got.append((batch.step, batch.version))
            phases.append(list(after.seconds))
    finally:
        producer.close()
    assert got == [(0, 2), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert rollout.loads == [3, 4, 5, 7] and rollout.version == 7  # 7: the closing sync
    assert phases == [["publish"]] * 3 + [[], ["sync"]]  # versions 3-5 sample a later batch, 6 none
    assert [w for w, _ in rollout.windows] == ["open", "close"] and not rollout_threads()


def test_close_stops_a_batch_at_its_next_decode_step():
    """An interrupt while a long batch samples: `close` stops it before its next decode step,
    without waiting for the batch."""
    rollout, rounds = FakeRollout(), []

    def sample(step, cursor, tl):
        for _ in range(200):  # 200 decode rounds of 20 ms: 4 s
            rollout.before_step()
            rounds.append(step)
            time.sleep(0.02)
        return Collected(rollouts=None, cursor=cursor + 10, tokens_generated=1, metrics={})

    with pytest.raises(KeyboardInterrupt):
        with RolloutProducer(rollout, sample, first_step=0, stop_step=3, cursor=0, max_staleness=1):
            _until(lambda: len(rounds) >= 3)
            t0 = time.perf_counter()
            raise KeyboardInterrupt
    assert time.perf_counter() - t0 < 1.0 and len(rounds) < 100
    assert rollout.windows[-1][0] == "close"


def test_close_waits_a_bounded_time_for_a_hung_batch():
    """A grader that hangs (no decode step to stop at): `close` gives up after its timeout and
    says so; the thread ends by itself once the grader returns."""
    rollout, release, entered = FakeRollout(), threading.Event(), threading.Event()

    def sample(step, cursor, tl):
        entered.set()
        release.wait(30)
        return Collected(rollouts=None, cursor=cursor + 10, tokens_generated=1, metrics={})

    producer = RolloutProducer(rollout, sample, first_step=0, stop_step=3, cursor=0, max_staleness=1).start()
    threading.Timer(3.0, release.set).start()  # without the timeout, close would wait for this
    assert entered.wait(30)
    t0 = time.perf_counter()
    assert producer.close(timeout=0.2) is False
    assert time.perf_counter() - t0 < 2.0
    release.set()
    _until(lambda: not rollout_threads())
    assert rollout.windows[-1][0] == "close"
