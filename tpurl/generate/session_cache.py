"""Session reuse: the KV pages of a session's finished request, kept for its next request.

An agent calls the engine again and again with a prompt that is its last prompt, the completion it
got, and a few tokens more (a tool's answer, the next user turn). A `Service` request may name the
session it belongs to (`Service.submit(session=...)`, the endpoint's `/sessions/<id>/v1` calls).
When such a request's sample 0 ends, its sequence leaves its slot with its pages (`Engine.detach`)
and is parked here under the session, with its token ids (prompt + completion; the last sampled
token is not yet cached). The session's next request whose prompt starts with those ids, token for
token, resumes the parked sequence instead of a prefill: its pages are sized for the new request
(`Engine.size_detached`) and one extend program appends the new tokens (`tpurl.generate.extend`),
so only the tokens after the cached ones are computed. A request whose prompt does not extend the
parked ids (a rewritten history, a chat template that re-renders a turn) releases them and is
prefilled as usual.

A session keeps at most one parked sequence (its newest). Parked sequences give their pages back
when a request that waits for admission needs them (oldest first, `evict`), when the session's
next request does not extend them, and when the service stops. A resumed request samples from the
extend program's logits instead of a prefill's: the same tokens up to float rounding, drawn with
the same seeds. With in-flight weight updates a resumed request attends to keys and values that
earlier weights computed (as a multi-turn environment's resumed episodes do).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from tpurl.generate.engine import Engine
from tpurl.generate.extend import Resume
from tpurl.generate.page_book import Detached
from tpurl.generate.records import Request


@dataclasses.dataclass(eq=False)
class Parked:
    """A session's sequence out of any slot: its token ids (`ids`; all but the last are cached in
    `seq`'s pages)."""

    ids: np.ndarray
    seq: Detached

    def extended_by(self, prompt: np.ndarray) -> bool:
        """Whether `prompt` starts with the parked ids, token for token."""
        return len(prompt) >= len(self.ids) and np.array_equal(prompt[:len(self.ids)], self.ids)


class SessionCache:
    """The parked sequences of one decode state, by session, oldest first, and the requests that
    will resume one (`waiting`: request index and its parked sequence, until a slot and pages are
    free); see the module docstring. Owns their pages until a resume hands them to a slot."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._parked: collections.OrderedDict[str, Parked] = collections.OrderedDict()
        self.waiting: list[tuple[int, Parked]] = []

    @staticmethod
    def supported(engine: Engine) -> bool:
        """Whether `engine` can resume parked sequences: paged, without router replay (a resumed
        request would lack its cached prompt's routes) and not bitwise (no bitwise extends)."""
        return engine.paged and not engine.records_routes and not engine.model_cfg.bitwise

    def __len__(self) -> int:
        return len(self._parked)

    def pages(self) -> int:
        """Pages the parked sequences hold (all replicas)."""
        return sum(len(p.seq.pages) for p in self._parked.values())

    def match(self, index: int, session: str, request: Request) -> bool:
        """Whether request `index` of `session` resumes the session's parked sequence (then it
        waits in `waiting` for a slot): one sample, and a prompt that extends the parked ids."""
        parked = self._parked.pop(session, None)
        if parked is None:
            return False
        if request.n_samples > 1 or not parked.extended_by(request.prompt):
            self._release(parked)
            return False
        self.waiting.append((index, parked))
        return True

    def resumes(self, free_slots: list[list[int]], requests: dict[int, Request], *, busy: bool
                ) -> tuple[list[tuple[int, Resume]], list[int]]:
        """The waiting requests that find a free slot of their sequence's replica (popped from
        `free_slots`) and its pages (evicting older parked sequences for them), as `Resume`s that
        append the prompt's new tokens; and the requests to prefill instead: those that cannot get
        their pages while nothing else runs (`busy` False: no running sequence will free any)."""
        out, prefill = [], []
        for entry in list(self.waiting):
            index, parked = entry
            request, slots = requests[index], free_slots[parked.seq.replica]
            if not slots:
                continue
            length, max_new = len(request.prompt), request.sampling.max_new_tokens
            if self._room(parked.seq, length, max_new):
                self.waiting.remove(entry)
                n = len(parked.ids)
                out.append((index, Resume(slot=slots.pop(), seq=parked.seq, tokens=request.prompt[n - 1:].tolist(),
                                          start=n - 1, steps=0, remaining=max_new, seed=request.seeds[0])))
            elif not (busy or out):  # nothing runs, and no resume of this round will free pages
                self.waiting.remove(entry)
                self._release(parked)
                prefill.append(index)
        self.engine.stats["session_resumes"] += len(out)
        return out, prefill

    def _room(self, seq: Detached, length: int, max_new_tokens: int) -> bool:
        """Size `seq`'s pages for a request of `length` + `max_new_tokens`, evicting the oldest
        parked sequences while its pool lacks them; False if even that leaves too few."""
        while not self.engine.size_detached(seq, length, max_new_tokens):
            if not self.evict():
                return False
        return True

    def cancel(self, index: int) -> None:
        """Release the parked sequence that request `index` waits to resume, if any."""
        for entry in [e for e in self.waiting if e[0] == index]:
            self.waiting.remove(entry)
            self._release(entry[1])

    def park(self, session: str, ids: np.ndarray, seq: Detached) -> None:
        """Keep `seq` (token ids `ids`) as `session`'s newest sequence, releasing an older one."""
        self._release(self._parked.pop(session, None))
        self._parked[session] = Parked(np.asarray(ids, np.int32), seq)

    def evict(self) -> bool:
        """Release the oldest parked sequence; False if none is parked."""
        if not self._parked:
            return False
        self._release(self._parked.popitem(last=False)[1])
        self.engine.stats["session_evictions"] += 1
        return True

    def clear(self) -> None:
        """Release every parked sequence (and those waiting to resume)."""
        for index in [index for index, _ in self.waiting]:
            self.cancel(index)
        while self._parked:
            self._release(self._parked.popitem()[1])

    def _release(self, parked: Parked | None) -> None:
        if parked is not None:
            self.engine.release_detached(parked.seq)
