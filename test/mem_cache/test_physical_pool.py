"""PhysicalPagePool: free list and reference counts."""

import pytest
import torch

from sglang_minima.mem_cache.physical_pool import PhysicalPagePool


def test_alloc_hands_out_lowest_pages_first_and_never_page_zero():
    pool = PhysicalPagePool(4, "hot")
    assert pool.alloc(3).tolist() == [1, 2, 3]
    assert pool.num_free == 1 and pool.num_held == 3
    assert pool.alloc(2) is None
    assert pool.alloc(1).tolist() == [4]


def test_page_returns_to_free_list_two_step_ends_after_its_last_reference_drops():
    pool = PhysicalPagePool(2, "hot")
    page = pool.alloc(1)
    pool.retain(torch.cat([page, page]))
    pool.release(page)
    pool.release(page)
    assert pool.num_free == 1 and pool.num_quarantined == 0
    pool.release(page)
    assert int(pool.refcount[page]) == 0 and pool.num_free == 1 and pool.num_quarantined == 1
    pool.end_step()  # the forward in flight when it was freed may still read it
    assert pool.num_free == 1 and pool.num_held == 1
    pool.end_step()
    assert pool.num_free == 2 and pool.num_quarantined == 0 and pool.num_held == 0


def test_unread_pages_and_a_drain_skip_the_quarantine():
    pool = PhysicalPagePool(3, "tq3")
    pages = pool.alloc(3)
    pool.release(pages[:1], unread=True)  # a failed conversion's destination: nothing read it
    assert pool.num_free == 1 and pool.num_quarantined == 0
    pool.release(pages[1:])
    pool.end_step()
    assert pool.num_free == 1 and pool.num_quarantined == 2
    pool.drain()  # after a device sync
    assert pool.num_free == 3 and pool.num_quarantined == 0
    assert sorted(pool.alloc(3).tolist()) == [1, 2, 3]


def test_peak_held_is_the_most_pages_held_at_once_quarantine_included():
    pool = PhysicalPagePool(8, "hot")
    first = pool.alloc(3)
    pool.alloc(2)
    assert pool.peak_held == 5
    pool.release(first)
    pool.alloc(2)  # the three freed pages are still quarantined: 7 held
    assert pool.peak_held == 7
    pool.end_step()
    pool.end_step()
    pool.alloc(1)  # 5 held now: the peak stays
    assert pool.num_held == 5 and pool.peak_held == 7
    assert pool.alloc(4) is None and pool.peak_held == 7  # a refused allocation holds nothing


def test_double_release_and_retain_of_free_page_raise():
    pool = PhysicalPagePool(2, "tq3")
    page = pool.alloc(1)
    pool.release(page)
    with pytest.raises(RuntimeError, match="released more times"):
        pool.release(page)
    pool.reset()
    with pytest.raises(RuntimeError, match="retain of a free"):
        pool.retain(torch.tensor([1]))
