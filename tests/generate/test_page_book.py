"""The engine's page book on its own (no device): allocation and refcounted sharing across replica
pools, all-or-nothing inserts, pending clears, epochs, detach/resume/release and admission
arithmetic, each against page counts worked out by hand.

Page size 4 throughout. A prompt of 10 tokens with max_new_tokens=7 caches 10 + 7 - 1 = 16
positions: 4 pages, the first 10 // 4 = 2 of them full prompt pages (what later samples share)."""

import numpy as np
import pytest

from tpurl.generate.allocator import PoolExhausted
from tpurl.generate.kv_cache import PagedCacheShape
from tpurl.generate.page_book import Detached, PageBook
from tpurl.generate.protocol import Prefix
from tpurl.generate.sampling import SamplingConfig


def _book(slots: int = 4, replicas: int = 1, num_pages: int = 16) -> PageBook:
    shape = PagedCacheShape(num_layers=1, num_kv_heads=1, num_pages=num_pages, page_size=4, head_dim=2,
                            max_pages_per_seq=8, dtype="float32", replicas=replicas)
    book = PageBook(slots, replicas, shape)
    book.reset()
    return book


def _prefix(length: int = 10, max_new: int = 7, samples: int = 1) -> Prefix:
    return Prefix(k=None, v=None, row=0, prompt_ids=np.arange(length), sampling=SamplingConfig(max_new_tokens=max_new),
                  seeds=np.arange(samples, dtype=np.uint32), first_tokens=np.zeros(samples, np.int32),
                  first_logprobs=np.zeros(samples, np.float32), inserted=np.zeros(samples, bool))


def _insert(book: PageBook, requests):
    allocation = book.allocate(requests)
    book.commit(requests, allocation)
    return allocation


def test_samples_share_full_prompt_pages_within_a_replica_only():
    book = _book(slots=4, replicas=2)
    assert [book.replica_of(s) for s in range(4)] == [0, 0, 1, 1]
    group = _prefix(samples=3)
    allocation = book.allocate([(group, 0, 0), (group, 1, 1), (group, 2, 2)])
    first, second, other = allocation.placements
    # Each allocator hands out its lowest free pages first; ids are local to the replica's pool.
    assert (first.replica, first.pages, first.shared) == (0, [0, 1, 2, 3], None)
    assert (second.replica, second.pages, second.shared) == (0, [0, 1, 4, 5], 2)  # 2 shared + 2 own
    assert (other.replica, other.pages, other.shared) == (1, [0, 1, 2, 3], None)  # the prompt's own copy
    assert group.shared_pages == {0: [0, 1], 1: [0, 1]} and group.pool_epoch == book.epoch
    # Replica 0: pages 0, 1 held by two sequences and the prefix; replica 1: by one and the prefix.
    assert book.allocators[0].refcount[:6].tolist() == [3, 3, 1, 1, 1, 1]
    assert book.allocators[1].refcount[:4].tolist() == [2, 2, 1, 1]
    assert [book.free_pages(r) for r in (0, 1)] == [10, 12]
    book.commit([(group, 0, 0), (group, 1, 1), (group, 2, 2)], allocation)
    # Every sample placed: the prefix's references are gone, the sequences' stay.
    assert group.shared_pages is None and group.inserted.all()
    assert book.allocators[0].refcount[:2].tolist() == [2, 2] and [book.free_pages(r) for r in (0, 1)] == [10, 12]
    assert book.pages_of(1) == [0, 1, 4, 5] and book.used_slots() == [0, 1, 2]
    book.free(0)  # its own pages 2, 3 come back; 0, 1 are still slot 1's
    assert book.free_pages(0) == 12
    book.free(1)
    book.free(2)
    assert [book.free_pages(r) for r in (0, 1)] == [16, 16] and book.used_slots() == []
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        book.free(1)


def test_admission_arithmetic():
    book = _book(slots=2, num_pages=10)
    pair = _prefix(samples=2)
    assert book.request_pages(10, 7) == 4 and book.request_pages(10, 7, 2) == 4 + 2
    assert book.request_pages(10, 7, 0) == 0
    assert book.pages_needed(pair, 2) == 6 and book.can_insert(pair, 2)
    _insert(book, [(pair, 0, 0)])  # sample 1 still to come: the prefix keeps its 2 shared pages
    assert book.free_pages(0) == 10 - 4 and pair.shared_pages == {0: [0, 1]}
    assert book.pages_needed(pair) == 4 - 2 and book.pages_needed(pair, 3) == 3 * 2
    assert book.can_insert(pair) and not book.can_insert(pair, 4)  # 8 pages, 6 free
    assert book.can_insert(_prefix(length=20, max_new=5))  # ceil(24 / 4) = 6 pages: just fits
    assert not book.can_insert(_prefix(length=21, max_new=8))  # ceil(28 / 4) = 7
    with pytest.raises(ValueError, match="needs 11 KV pages but the pool has only 10"):
        book.check_fits(40, 5)  # ceil(44 / 4) = 11
    book.check_fits(36, 5)  # 10 pages: fits an empty pool
    with pytest.raises(ValueError, match="each of the 2 replica pools has only 16"):
        _book(replicas=2).check_fits(60, 20)
    dense = PageBook(2)
    dense.reset()
    assert dense.request_pages(10, 7) == 0 and dense.pages_needed(pair, 2) == 0 and dense.can_insert(pair, 9)


def test_can_insert_looks_at_the_asked_replica():
    book = _book(slots=4, replicas=2, num_pages=8)
    _insert(book, [(_prefix(length=20, max_new=9), 0, 0)])  # ceil(28 / 4) = 7 pages of replica 0
    small = _prefix()
    assert not book.can_insert(small, replica=0) and book.can_insert(small, replica=1) and book.can_insert(small)
    assert [book.free_pages(r) for r in (0, 1)] == [1, 8]


def test_insert_is_all_or_nothing():
    book = _book(slots=2, num_pages=6)
    pair, big = _prefix(samples=2), _prefix(length=8, max_new=5)  # 4 pages; ceil(12 / 4) = 3 pages
    with pytest.raises(PoolExhausted, match="need 3 KV pages but only 2"):
        book.allocate([(pair, 0, 0), (big, 1, 0)])
    assert book.free_pages(0) == 6 and not book.allocators[0].refcount.any()
    assert pair.shared_pages is None and not pair.inserted.any() and book.used_slots() == []
    # A program that fails after its pages were taken: `undo` gives back the pages and the share.
    allocation = book.allocate([(pair, 0, 0), (pair, 1, 1)])
    assert book.free_pages(0) == 0 and pair.shared_pages == {0: [3, 2]}  # the last pages freed go first
    book.undo(allocation)
    assert book.free_pages(0) == 6 and not book.allocators[0].refcount.any() and pair.shared_pages is None
    assert not pair.inserted.any() and not book.busy(0) and not book.busy(1)


def test_pending_clears_until_a_program_runs():
    book = _book(slots=4)
    _insert(book, [(_prefix(), 0, 0)])
    _insert(book, [(_prefix(), 1, 0)])
    assert book.pending_clears == frozenset()
    book.free(0)
    book.detach(1)
    assert book.pending_clears == {0, 1}
    np.testing.assert_array_equal(book.clear_mask(), [True, True, False, False])
    book.mark_cleared()  # a decode or extend program deactivated them
    assert book.pending_clears == frozenset() and not book.clear_mask().any()
    _insert(book, [(_prefix(), 2, 0)])
    book.free(2)
    assert book.pending_clears == {2}
    _insert(book, [(_prefix(), 0, 0)])  # an insert program applies the pending clears first
    assert book.pending_clears == frozenset()


def test_a_new_epoch_invalidates_older_shared_pages_and_detached_sequences():
    book = _book(slots=4)
    pair, trio = _prefix(samples=2), _prefix(length=8, samples=3)
    _insert(book, [(pair, 0, 0), (trio, 1, 0)])
    seq = book.detach(1)
    old = book.epoch
    assert pair.pool_epoch == old and book.pages_needed(pair) == 2
    book.reset()
    assert book.epoch == old + 1 and book.free_pages(0) == 16 and book.used_slots() == []
    # The pair's shared pages were pages of the dropped pool: its next sample takes (and writes) all 4.
    assert book.pages_needed(pair) == 4
    (placement,) = _insert(book, [(pair, 0, 1)]).placements
    assert placement.shared is None and placement.pages == [0, 1, 2, 3]
    assert pair.shared_pages is None and book.free_pages(0) == 12  # released into the new pool: nothing
    # Releasing a stale prefix or detached sequence touches no allocator of the new pool.
    book.release_prefix(trio)
    book.release_detached(seq)
    assert book.free_pages(0) == 12 and trio.shared_pages is None and seq.pages == []
    with pytest.raises(ValueError, match="pages are gone"):
        book.check_resume(2, Detached(replica=0, pages=[5], epoch=old))


def test_detach_resume_and_release():
    book = _book(slots=4, replicas=2)
    _insert(book, [(_prefix(), 2, 0)])  # replica 1: pages 0..3
    seq = book.detach(2)
    assert (seq.replica, seq.pages, seq.epoch) == (1, [0, 1, 2, 3], book.epoch)
    assert not book.busy(2) and book.free_pages(1) == 12  # the pages stay with the sequence
    with pytest.raises(ValueError, match="slot 2 holds no sequence"):
        book.detach(2)
    with pytest.raises(ValueError, match="slot 0 is on replica 0, the sequence's pages on replica 1"):
        book.check_resume(0, seq)
    _insert(book, [(_prefix(length=3, max_new=2), 3, 0)])
    with pytest.raises(ValueError, match="slot 3 is not free"):
        book.check_resume(3, seq)
    book.free(3)
    book.check_resume(2, seq)
    book.resume(2, seq)
    assert book.pages_of(2) == [0, 1, 2, 3] and seq.pages == [] and book.busy(2)
    again = book.detach(2)
    book.release_detached(again)
    assert again.pages == [] and book.free_pages(1) == 16
    with pytest.raises(ValueError, match="pages are gone"):
        book.check_resume(2, again)


def test_dense_book_tracks_slots_without_pages():
    book = PageBook(2)
    book.reset()
    prefix = _prefix()
    _insert(book, [(prefix, 1, 0)])
    assert book.busy(1) and book.pages_of(1) == [] and book.allocators is None
    with pytest.raises(ValueError, match="holds no sequence of a paged engine"):
        book.detach(1)
    book.free(1)
    assert book.pending_clears == {1} and not book.busy(1)
