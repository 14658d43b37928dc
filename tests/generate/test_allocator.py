"""Page allocator: reference counts, sharing, exhaustion, and never handing out a live page."""

import numpy as np
import pytest

from tpurl.generate.allocator import PageAllocator, PoolExhausted


def test_allocate_release_and_exhaustion():
    a = PageAllocator(4)
    p = a.allocate(3)
    assert len(set(p)) == 3 and a.num_free == 1 and set(p) <= set(range(4))
    with pytest.raises(PoolExhausted, match="need 2 KV pages but only 1"):
        a.allocate(2)
    assert a.release(p[:2]) == p[:2]
    assert a.num_free == 3
    with pytest.raises(ValueError, match="double release"):
        a.release([p[0]])
    with pytest.raises(ValueError, match="double release"):
        a.release([p[2], p[2]])  # one reference, released twice in one call
    assert a.refcount[p[2]] == 1  # a rejected release changes nothing


def test_shared_pages_stay_live_until_last_holder_releases():
    a = PageAllocator(3)
    shared = a.allocate(2)
    a.share(shared)  # a second sequence holds them too
    assert a.release(shared) == []  # still referenced by the other holder
    assert a.num_free == 1
    assert sorted(a.release(shared)) == sorted(shared)
    assert a.num_free == 3
    with pytest.raises(ValueError, match="only live pages can be shared"):
        a.share([shared[0]])


def test_random_workload_never_hands_out_a_live_page():
    rng = np.random.default_rng(0)
    a = PageAllocator(32)
    holders: list[list[int]] = []  # each holder owns one reference to each of its pages
    for _ in range(2000):
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(0, 6))
            live = {p for h in holders for p in h}
            try:
                got = a.allocate(n)
            except PoolExhausted:
                assert n > 32 - len(live)
                continue
            assert not live & set(got), "allocator handed out a live page"
            holders.append(got)
        elif op == 1 and holders:
            src = holders[int(rng.integers(len(holders)))]
            a.share(src)
            holders.append(list(src))
        elif holders:
            a.release(holders.pop(int(rng.integers(len(holders)))))
        counts = np.bincount([p for h in holders for p in h], minlength=32)
        np.testing.assert_array_equal(a.refcount, counts)
        assert a.num_free == int(np.sum(counts == 0))
