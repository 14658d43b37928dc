"""`WeightSlot`: the rollout weights and their policy version, replaceable while `generate` runs.

A weight sync that lands while sequences are still decoding (in-flight weight updates) must hand
the new weights to a running `driver.generate` call, and free the old ones only once nothing uses
them any more. The slot holds one `Weights` (params, version, and the arrays that freeing them
deletes) and does both:

    slot = WeightSlot()
    with slot.loading(drain=False) as publish:   # the weight sync (any thread)
        publish(Weights(params, version=v, owned=...))
    generate(engine, slot, prompts, ...)         # the scheduler reads the slot between steps

Readers. A `generate` call `hold`s the current weights for its whole run and `poll`s the slot
before each round of extends, prefills and a decode step: when newer weights were published, it
switches to them (and drops its hold on the old ones) for every later prefill, decode step and
extend. A decode step dispatched before the poll may still be running on the old weights when the
poll lets them go (the driver's pipelined decode): PjRt frees a deleted buffer's memory only once
the programs that use it have finished, so the step completes on them.

Ownership. The slot owns the weights published into it: `Weights.owned` lists the arrays that
freeing them deletes (not arrays shared with someone else, e.g. the trainer's weights that a free
sync passes through). Replaced weights are freed as soon as no reader holds them: at once when no
`generate` call runs (a sync then never holds two copies), else at the running call's next poll
(two copies live from the start of the sync to the first poll after it, and until a decode step
dispatched before that poll ends) or at its end.

`loading(drain=...)`: a sync. With `drain=True` it first waits until no `generate` call holds the
weights (the running call finishes on the weights it started with); with `drain=False` running
calls go on decoding during the sync and switch at their next poll. Either way a `generate` call
that starts during a sync waits for its weights. A drain from a thread that holds weights itself
(a sync from the sampling thread's own decode loop) would wait for itself: it raises
`tpurl.threads.WrongThread` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Literal

import jax

from tpurl.threads import WrongThread

InFlight = Literal["continue", "drain"]
IN_FLIGHT_MODES: tuple[str, ...] = ("continue", "drain")


def check_in_flight(mode: str, where: str) -> None:
    """One-line error unless `mode` is one of `IN_FLIGHT_MODES`."""
    if mode not in IN_FLIGHT_MODES:
        raise ValueError(f"{where}: in_flight={mode!r} is unknown; use 'continue' (running sequences switch "
                         f"to the new weights) or 'drain' (a sync waits for the running sample call)")


@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
    """One set of rollout weights: `params` (a pytree), their policy `version` (stamped on every
    token they sample) and `owned`, the arrays that freeing them deletes."""

    params: Any
    version: int
    owned: tuple[jax.Array, ...] = ()

    def free(self) -> None:
        for x in self.owned:
            if not x.is_deleted():
                x.delete()


class WeightSlot:
    """The current `Weights` of a rollout and the readers holding older ones (module docstring)."""

    def __init__(self, weights: Weights | None = None):
        self._cond = threading.Condition()
        self._current = weights
        self._holds: dict[int, list] = {}  # id(weights) -> [weights, readers]
        self._readers: dict[int, int] = {}  # thread ident -> the holds it took (`hold`, until `release`)
        self._pending = False  # a sync waits to start or runs

    @property
    def current(self) -> Weights:
        """The weights the next reader gets (not waiting for a sync in progress)."""
        with self._cond:
            if self._current is None:
                raise RuntimeError("WeightSlot: no weights loaded yet; publish weights (RolloutSide.load) first")
            return self._current

    def settled(self) -> Weights:
        """The current weights once no sync is in progress (waits for one that is)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
            if self._current is None:
                raise RuntimeError("WeightSlot: no weights loaded yet; publish weights (RolloutSide.load) first")
            return self._current

    @property
    def pending(self) -> bool:
        """Whether a sync waits to start (drain) or runs."""
        with self._cond:
            return self._pending

    def held(self) -> list[int]:
        """The versions that readers hold now, with repeats (for tests and monitoring)."""
        with self._cond:
            return sorted(w.version for w, n in self._holds.values() for _ in range(n))

    def hold(self) -> Weights:
        """The current weights, held until `release`; waits while a sync is pending."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
            if self._current is None:
                raise RuntimeError("WeightSlot: no weights loaded yet; publish weights (RolloutSide.load) first")
            self._hold(self._current)
            me = threading.get_ident()
            self._readers[me] = self._readers.get(me, 0) + 1
            return self._current

    def poll(self, held: Weights) -> Weights:
        """The weights a reader holding `held` uses next: the newest published, else `held`. Never
        waits; on a switch the hold moves to the new weights and `held` may be freed."""
        with self._cond:
            new = self._current
            if new is None or new is held:
                return held
            self._hold(new)
            self._release(held)
            return new

    def release(self, held: Weights) -> None:
        """Drop a reader's hold; replaced weights that no one holds any more are freed."""
        with self._cond:
            self._release(held)
            me = threading.get_ident()
            if self._readers.get(me, 0) > 1:
                self._readers[me] -= 1
            else:
                self._readers.pop(me, None)
            self._cond.notify_all()

    @contextlib.contextmanager
    def loading(self, *, drain: bool) -> Iterator[Callable[[Weights], None]]:
        """A sync: replaces the current weights by the `Weights` passed to the yielded `publish`.
        The current weights are freed on entry when no reader holds them (else by the last reader
        to let go); readers that start meanwhile wait. `drain`: first wait until no reader holds any
        weights (`WrongThread` if the calling thread is one of them). Leaving without publishing
        leaves the slot empty."""
        with self._cond:
            if drain and threading.get_ident() in self._readers:
                raise WrongThread("WeightSlot.loading(drain=True): called from a thread that holds the weights "
                                  f"(thread {threading.current_thread().name!r} is sampling), so it would wait for "
                                  "itself; load from another thread, or with in_flight='continue'")
            self._cond.wait_for(lambda: not self._pending)
            self._pending = True
            if drain:
                self._cond.wait_for(lambda: not self._holds)
            old, self._current = self._current, None
            if old is not None and id(old) not in self._holds:
                old.free()
        try:
            yield self._publish
        finally:
            with self._cond:
                self._pending = False
                self._cond.notify_all()

    def close(self) -> None:
        """Free the current weights (readers must have released theirs)."""
        with self._cond:
            if self._holds:
                raise RuntimeError(f"WeightSlot.close: readers still hold versions {self.held()}")
            old, self._current = self._current, None
        if old is not None:
            old.free()

    def _publish(self, weights: Weights) -> None:
        with self._cond:
            if self._current is not None:
                raise RuntimeError("WeightSlot: publish once per loading() block")
            self._current = weights

    def _hold(self, weights: Weights) -> None:
        self._holds.setdefault(id(weights), [weights, 0])[1] += 1

    def _release(self, held: Weights) -> None:
        entry = self._holds[id(held)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._holds[id(held)]
            if held is not self._current:
                held.free()
