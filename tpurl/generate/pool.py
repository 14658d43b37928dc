"""`KVPool`: the owner of one decode state of an engine (the KV cache and the per-slot arrays).

The engine protocol passes the decode state in and out of every `insert`/`generate` call and
donates it, so whoever holds the state owns device memory that no one else can see. `KVPool`
makes that ownership explicit: it allocates the state (`Engine.init_decode_state`), steps the
engine with it (`insert_batch`, `step`), and frees it (`release`, or leaving a `with` block).
Nothing else holds the state, so releasing the pool frees all of its device memory, and callers
never delete or track decode-state arrays themselves.

A pool can serve several `driver.generate` calls in a row (each call leaves every slot and page
free); a call that fails midway leaves the host bookkeeping of the engine unknown, so its owner
releases the pool then (the `with` block does).
"""

from __future__ import annotations

import jax

from tpurl.generate.engine import Engine
from tpurl.generate.protocol import ResultTokens


class KVPool:
    """One live decode state of `engine`; see the module docstring. Typical use::

        with KVPool(engine) as pool:
            pool.insert_batch([(prefix, slot, sample_index), ...])
            result = pool.step(params)
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._state = engine.init_decode_state()

    @property
    def alive(self) -> bool:
        return self._state is not None

    def arrays(self) -> list[jax.Array]:
        """The device arrays of the decode state (for memory accounting; do not keep them: the next
        engine call donates them)."""
        return jax.tree.leaves(self._live())

    def insert_batch(self, requests) -> None:
        """`Engine.insert_batch` on this pool's state (see there)."""
        self._state = self.engine.insert_batch(self._live(), requests)

    def step(self, params, *, top: bool = True) -> ResultTokens:
        """One decode step for every active slot (`Engine.generate`; `top` False: no top logprobs);
        returns its device results."""
        self._state, result = self.engine.generate(params, self._live(), top=top)
        return result

    def extend(self, params, requests, sampling) -> ResultTokens:
        """Resume detached sequences and sample their next tokens with `sampling`, one config or
        one per request (`Engine.extend_batch`)."""
        self._state, result = self.engine.extend_batch(params, self._live(), requests, sampling)
        return result

    def release(self) -> None:
        """Free the pool's device memory now (idempotent)."""
        if self._state is not None:
            for x in jax.tree.leaves(self._state):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
        self._state = None

    def _live(self):
        if self._state is None:
            raise RuntimeError("KVPool: the pool was released; allocate a new KVPool(engine)")
        return self._state

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
