"""Thread ownership of resources that one thread at a time may use.

A rollout window (the engine's KV pool and host page bookkeeping) belongs to the thread that
opened it until it closes: with asynchronous rollout that is the rollout thread, and a call from
the main thread meanwhile would corrupt the engine's state or wait forever. An `Owner` names the
thread that holds a resource; `check` raises `WrongThread` on any other thread, at once, instead.

    owner = owner_of(engine)          # one owner per engine, shared by every user of it
    owner.claim("RolloutSide.open")       # the calling thread holds it ...
    check_owner(engine, "Engine.init_decode_state")   # ... so this raises on any other thread
    owner.release()                   # any thread may claim it again
"""

from __future__ import annotations

import threading
import weakref


class WrongThread(RuntimeError):
    """A resource was used from a thread that does not own it."""


class Owner:
    """The thread that holds `resource` now (None: no one, any thread may use it)."""

    def __init__(self, resource: str):
        self.resource = resource
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def claim(self, what: str) -> None:
        """Make the calling thread the owner; raises `WrongThread` if another thread owns it."""
        with self._lock:
            self._check(what)
            self._thread = threading.current_thread()

    def release(self) -> None:
        """Let any thread claim the resource again."""
        with self._lock:
            self._thread = None

    def check(self, what: str) -> None:
        """Raise `WrongThread` unless the calling thread owns the resource or no thread does."""
        with self._lock:
            self._check(what)

    def _check(self, what: str) -> None:
        owner = self._thread
        if owner is not None and owner is not threading.current_thread():
            raise WrongThread(f"{what}: called from thread {threading.current_thread().name!r}, but the "
                              f"{self.resource} belongs to thread {owner.name!r} until it is closed there; call it "
                              "from that thread")


_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()


def owner_of(obj, resource: str | None = None) -> Owner:
    """The one `Owner` of `obj` (made on first use, named `resource` or after obj's type)."""
    with _OWNERS_LOCK:
        owner = _OWNERS.get(obj)
        if owner is None:
            owner = _OWNERS[obj] = Owner(resource or type(obj).__name__)
        return owner


def check_owner(obj, what: str) -> None:
    """`owner_of(obj).check(what)` for an object someone claimed; nothing for one never claimed."""
    owner = _OWNERS.get(obj)
    if owner is not None:
        owner.check(what)
