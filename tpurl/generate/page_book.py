"""The engine's page book: which KV pages each decode slot, shared prompt and waiting sequence holds.

Host bookkeeping only (numpy, no device arrays). A paged engine's KV lives in R replica pools
(R = 1 without data replicas), one `PageAllocator` each, page ids local to it; slot s uses only the
pool of replica `replica_of(s)`. For the one live decode state (its `epoch`) the book records:

* each slot's pages (`pages_of`; a busy slot of a dense engine holds no pages);
* the slots freed or detached since the last device program (`pending_clears`): the next program
  deactivates them before anything it writes, so their pages can be handed on at once;
* a prefix's shared prompt pages (`Prefix.shared_pages[replica]`, of epoch `Prefix.pool_epoch`):
  with G > 1 samples the first one on a replica writes the prompt and the prefix keeps a reference
  to its full pages, which later samples on that replica share. Pages of an older epoch belong to
  a dropped pool and mean nothing now;
* sequences out of their slots (`Detached`, multi-turn), until resumed or released.

Admission arithmetic (`request_pages`, `pages_needed`, `can_insert`, `free_pages`) says what fits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpurl.generate.allocator import PageAllocator
from tpurl.generate.kv_cache import PagedCacheShape
from tpurl.generate.protocol import Prefix


@dataclasses.dataclass(eq=False)
class Detached:
    """A sequence out of its slot: the replica pool its pages belong to, the pages (in order), and
    the pool (`epoch`) they are pages of. Owned by whoever detached it until it is resumed or
    released (`Engine.release_detached`)."""

    replica: int
    pages: list[int]
    epoch: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """One inserted sequence's pages: its replica, its pages in order, and how many leading ones it
    shares with earlier samples of its prefix (already written there); `shared=None`: it is the
    prompt's first copy on that replica and writes the whole prompt."""

    replica: int
    pages: list[int]
    shared: int | None = None


@dataclasses.dataclass
class Allocation:
    """What one insert call takes: a `Placement` per request, and what to give back if the call
    fails (`PageBook.undo`): every `(replica, page)` reference acquired and every `(prefix,
    replica)` given shared pages."""

    placements: list[Placement]
    taken: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    made_shared: list[tuple[Prefix, int]] = dataclasses.field(default_factory=list)


class PageBook:
    """Slot pages, replica allocators, pending clears, the epoch and shared prefixes of one engine
    (see the module docstring). `shape=None`: a dense cache (slots tracked, no pages)."""

    def __init__(self, max_slots: int, replicas: int = 1, shape: PagedCacheShape | None = None):
        if max_slots % replicas:
            raise ValueError(f"PageBook: {max_slots} slots do not split over {replicas} replicas")
        self.max_slots, self.replicas, self.shape = max_slots, replicas, shape
        self._slot_pages: list[list[int] | None] = [None] * max_slots
        self._pending_clear: set[int] = set()
        self._allocators: list[PageAllocator] | None = None
        self._epoch = 0

    @property
    def paged(self) -> bool:
        return self.shape is not None

    @property
    def epoch(self) -> int:
        """The decode state the book describes (bumped by `reset`)."""
        return self._epoch

    @property
    def allocators(self) -> list[PageAllocator] | None:
        """One allocator per replica pool (None for the dense cache or before `reset`)."""
        return self._allocators

    @property
    def allocator(self) -> PageAllocator | None:
        """The allocator of the single pool (one replica only; see `allocators`)."""
        if self.replicas > 1:
            raise ValueError(f"Engine.allocator: the pool is split into {self.replicas} replica pools; "
                             "use Engine.allocators[replica]")
        return self._allocators[0] if self._allocators is not None else None

    def reset(self) -> None:
        """A new decode state: every page free, every slot empty, a new epoch."""
        if self.paged:
            self._allocators = [PageAllocator(self.shape.num_pages) for _ in range(self.replicas)]
        self._slot_pages = [None] * self.max_slots
        self._pending_clear = set()
        self._epoch += 1

    def replica_of(self, slot: int) -> int:
        """The replica (and pool) of decode slot `slot`: slots are split in contiguous blocks."""
        return slot // (self.max_slots // self.replicas)

    # ----------------------------------------------------------------------------------------------
    # Slots and clears.

    def pages_of(self, slot: int) -> list[int] | None:
        """The pages of the sequence in `slot` (None: the slot is free)."""
        return self._slot_pages[slot]

    def busy(self, slot: int) -> bool:
        return self._slot_pages[slot] is not None

    def used_slots(self) -> list[int]:
        return [s for s, pages in enumerate(self._slot_pages) if pages is not None]

    @property
    def pending_clears(self) -> frozenset[int]:
        """Slots freed or detached since the last device program."""
        return frozenset(self._pending_clear)

    def clear_mask(self) -> np.ndarray:
        """The `[B]` mask of the pending clears."""
        mask = np.zeros(self.max_slots, bool)
        mask[list(self._pending_clear)] = True
        return mask

    def mark_cleared(self) -> None:
        """A device program has deactivated the pending slots."""
        self._pending_clear = set()

    # ----------------------------------------------------------------------------------------------
    # Admission arithmetic.

    def free_pages(self, replica: int) -> int:
        """Free pages in replica `replica`'s pool."""
        return self._allocators[replica].num_free

    def request_pages(self, prompt_length: int, max_new_tokens: int, samples: int = 1) -> int:
        """Fresh pages that `samples` sequences of one not yet inserted prompt take (0 for the dense
        cache): the first holds prompt + max_new_tokens, each later one shares the prompt's full pages."""
        if not self.paged or samples < 1:
            return 0
        total = self.shape.sequence_pages(prompt_length, max_new_tokens)
        return total + (samples - 1) * (total - prompt_length // self.shape.page_size)

    def pages_needed(self, prefix: Prefix, count: int = 1, replica: int = 0) -> int:
        """Fresh pages that inserting the next `count` samples of `prefix` into slots of replica
        `replica` allocates from its pool (0 for dense)."""
        if not self.paged:
            return 0
        shared = self._shared(prefix, replica)
        if shared is not None:
            return count * (self.shape.sequence_pages(prefix.true_length, prefix.sampling.max_new_tokens) - len(shared))
        return self.request_pages(prefix.true_length, prefix.sampling.max_new_tokens, count)

    def can_insert(self, prefix: Prefix, count: int = 1, *, replica: int | None = None) -> bool:
        """Whether the next `count` samples of `prefix` fit in the free pages of replica `replica`'s
        pool now (None: of some replica's pool)."""
        if not self.paged:
            return True
        replicas = range(self.replicas) if replica is None else (replica,)
        return any(self.pages_needed(prefix, count, r) <= self.free_pages(r) for r in replicas)

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        """Raise a one-line ValueError if one sequence of this size needs more pages than a pool has."""
        need = self.request_pages(prompt_length, max_new_tokens)
        if self.paged and need > self.shape.num_pages:
            pool = "the pool has" if self.replicas == 1 else f"each of the {self.replicas} replica pools has"
            raise ValueError(f"request needs {need} KV pages but {pool} only {self.shape.num_pages}; "
                             "enlarge the pool (num_pages / kv_memory_bytes) or shorten the request")

    def _shared(self, prefix: Prefix, replica: int) -> list[int] | None:
        """The prefix's shared pages on `replica`, if they are pages of the current pool."""
        if prefix.pool_epoch != self._epoch:
            return None
        return (prefix.shared_pages or {}).get(replica)

    # ----------------------------------------------------------------------------------------------
    # Insert: allocate, then commit (the program ran) or undo (it failed).

    def allocate(self, requests) -> Allocation:
        """Take the pages of `requests` (`(prefix, slot, sample_index)`), in order, as one insert
        after another: a prefix without shared pages on the slot's replica takes fresh pages for
        prompt + max_new_tokens and, with G > 1, keeps a reference to its full prompt pages; its
        later samples there take fresh pages only past them. All or nothing: raises
        `PoolExhausted` with nothing taken if they do not all fit."""
        for prefix, _, _ in requests:
            if prefix.pool_epoch != self._epoch:  # shared pages of an older pool are gone
                prefix.shared_pages = None
        allocation = Allocation(placements=[])
        if not self.paged:
            allocation.placements = [Placement(0, []) for _ in requests]
            return allocation
        try:
            for prefix, slot, _ in requests:
                allocation.placements.append(self._place(prefix, self.replica_of(slot), allocation))
        except BaseException:
            self.undo(allocation)
            raise
        return allocation

    def _place(self, prefix: Prefix, replica: int, allocation: Allocation) -> Placement:
        allocator = self._allocators[replica]
        total = self.shape.sequence_pages(prefix.true_length, prefix.sampling.max_new_tokens)
        shared = self._shared(prefix, replica)
        if shared is not None:
            own = allocator.allocate(total - len(shared))
            allocation.taken += [(replica, p) for p in own]
            allocator.share(shared)
            allocation.taken += [(replica, p) for p in shared]
            return Placement(replica, shared + own, len(shared))
        pages = allocator.allocate(total)
        allocation.taken += [(replica, p) for p in pages]
        if prefix.num_samples > 1:
            full = pages[: prefix.true_length // self.shape.page_size]
            allocator.share(full)  # the prefix's own reference
            allocation.taken += [(replica, p) for p in full]
            prefix.shared_pages = {**(prefix.shared_pages or {}), replica: full}
            prefix.pool_epoch = self._epoch
            allocation.made_shared.append((prefix, replica))
        return Placement(replica, pages)

    def undo(self, allocation: Allocation) -> None:
        """Give back everything `allocation` took (its insert failed; nothing references the pages)."""
        for r, allocator in enumerate(self._allocators or []):
            allocator.release([p for rr, p in allocation.taken if rr == r])
        for prefix, r in allocation.made_shared:
            del prefix.shared_pages[r]
            if not prefix.shared_pages:
                prefix.shared_pages = None
        allocation.taken, allocation.made_shared = [], []

    def commit(self, requests, allocation: Allocation) -> None:
        """The insert program ran (and applied the pending clears): record each request's slot and
        sample, and release the prefixes whose samples are now all inserted."""
        self._pending_clear = set()
        for (prefix, slot, k), placement in zip(requests, allocation.placements):
            self._slot_pages[slot] = list(placement.pages)
            prefix.inserted[k] = True
        for prefix in {id(p): p for p, _, _ in requests}.values():
            if prefix.inserted.all():
                self.release_prefix(prefix)

    def release_prefix(self, prefix: Prefix) -> None:
        """Drop the prefix's reference to its shared prompt pages (idempotent); it cannot be
        inserted again."""
        if prefix.shared_pages is not None and prefix.pool_epoch == self._epoch:
            for r, pages in prefix.shared_pages.items():
                self._allocators[r].release(pages)
        prefix.shared_pages = None
        prefix.inserted[:] = True

    # ----------------------------------------------------------------------------------------------
    # Free, detach, resume.

    def free(self, slot: int) -> None:
        """Free `slot` and release its pages; the slot is cleared by the next program."""
        pages = self._slot_pages[slot]
        if pages is None:
            raise ValueError(f"free_resource: slot {slot} is not in use")
        if self.paged:
            self._allocators[self.replica_of(slot)].release(pages)
        self._slot_pages[slot] = None
        self._pending_clear.add(slot)

    def detach(self, slot: int) -> Detached:
        """Take the sequence in `slot` out of it with its pages; the slot is free (cleared by the
        next program)."""
        pages = self._slot_pages[slot] if self.paged and 0 <= slot < self.max_slots else None
        if pages is None:
            raise ValueError(f"detach: slot {slot} holds no sequence of a paged engine")
        self._slot_pages[slot] = None
        self._pending_clear.add(slot)
        return Detached(replica=self.replica_of(slot), pages=pages, epoch=self._epoch)

    def release_detached(self, seq: Detached) -> None:
        """Give a detached sequence's pages back to its pool (a no-op for a dropped pool's)."""
        if seq.epoch == self._epoch:
            self._allocators[seq.replica].release(seq.pages)
        seq.pages = []

    def resize(self, seq: Detached, pages: int) -> None:
        """Give detached `seq` exactly `pages` pages: fresh ones from its replica's pool appended
        (`PoolExhausted`, nothing taken, if too few are free), or its last ones released."""
        if seq.epoch != self._epoch or not seq.pages:
            raise ValueError("resize: the sequence's pages are gone (another pool, or released)")
        allocator = self._allocators[seq.replica]
        if pages > len(seq.pages):
            seq.pages = seq.pages + allocator.allocate(pages - len(seq.pages))
        elif pages < len(seq.pages):
            allocator.release(seq.pages[pages:])
            seq.pages = seq.pages[:pages]

    def check_resume(self, slot: int, seq: Detached) -> None:
        """Raise a ValueError if `seq` cannot be resumed in `slot`."""
        if not 0 <= slot < self.max_slots or self.busy(slot):
            raise ValueError(f"slot {slot} is not free")
        if seq.epoch != self._epoch or not seq.pages:
            raise ValueError("the sequence's pages are gone (another pool, or released)")
        if self.replica_of(slot) != seq.replica:
            raise ValueError(f"slot {slot} is on replica {self.replica_of(slot)}, the sequence's pages on "
                             f"replica {seq.replica}")

    def resume(self, slot: int, seq: Detached) -> None:
        """`seq` runs in `slot` again (its program ran): the slot holds its pages, `seq` none."""
        self._slot_pages[slot], seq.pages = seq.pages, []

