"""Host-side page allocator for the paged KV cache, with reference counts.

Every page of the pool is usable: there is no reserved or "garbage" page. Unused page-table entries
hold the sentinel `num_pages` (out of range); device writes through them are dropped
(`.at[].set(mode="drop")`) and reads through them are masked by the sequence length.

A page is live while its reference count is positive. Group sampling shares a prompt's full pages
between the G sequences of a group (and the prefix that owns them) by incrementing the count; a page
returns to the free list only when the last holder releases it, so a live page is never handed to
another sequence. Misuse (releasing a free page, asking for more pages than are free) raises.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class PoolExhausted(RuntimeError):
    """Not enough free pages right now; the caller should wait for sequences to finish."""


class PageAllocator:
    """Free list + reference counts over `num_pages` pages. Pure host bookkeeping (numpy)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)
        # A stack: the most recently freed page is reused first (keeps the working set compact).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages, each with reference count 1. Raises `PoolExhausted` if fewer are free."""
        if n < 0:
            raise ValueError(f"PageAllocator.allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise PoolExhausted(f"need {n} KV pages but only {len(self._free)} of {self.num_pages} are free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each (live) page."""
        pages = list(pages)
        if pages and np.any(self.refcount[pages] <= 0):
            raise ValueError(f"PageAllocator.share: pages {[p for p in pages if self.refcount[p] <= 0]} are free; "
                             "only live pages can be shared")
        np.add.at(self.refcount, pages, 1)

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        pages = list(pages)
        counts = np.bincount(np.asarray(pages, np.int64), minlength=self.num_pages)
        if np.any(counts > self.refcount):
            bad = np.nonzero(counts > self.refcount)[0].tolist()
            raise ValueError(f"PageAllocator.release: pages {bad} would be released more often than they are "
                             "referenced (double release)")
        self.refcount -= counts.astype(np.int32)
        freed = [p for p in dict.fromkeys(pages) if self.refcount[p] == 0]
        self._free.extend(freed)
        return freed
