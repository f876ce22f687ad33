"""Conversions held pending on the conversion stream (a side stream on CUDA), on CPU with a stream
whose completion the test controls: readers see the old format until publish, the bytes published
are the synchronous path's, a page freed or converted meanwhile is handled, reset cancels, the
controller does not settle, the references add up, and the debug poison marks freed pages."""

import pytest
import torch

from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, UNMAPPED
from store_helpers import PS, HeldConversionStream, make_store, random_kv, read_page, write_tokens


def _stores(**kwargs):
    """A store whose conversions stay pending until the test completes them, and its synchronous twin."""
    stream = HeldConversionStream()
    return stream, make_store(stream=stream, **kwargs), make_store(**kwargs)


def _fill(stores, pages, seed=0):
    pages = torch.tensor(pages)
    slots = (pages[:, None] * PS + torch.arange(PS)).flatten()
    k, v = random_kv(slots.numel(), torch.Generator().manual_seed(seed))
    for store in stores:
        store.map_new(pages)
        write_tokens(store, slots, k, v)
    return pages


def _snapshot(store, pages):
    return [torch.cat(read_page(store, int(p), layer)) for p in pages for layer in range(2)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_readers_see_the_old_format_until_publish_and_then_the_synchronous_bytes():
    stream, store, sync = _stores()
    pages = _fill((store, sync), [2, 5, 7])
    before = _snapshot(store, pages)
    src = store.page_table.phys[pages].long()
    assert store.retier(pages) == sync.retier(pages) == 3
    for _ in range(3):  # held across steps: the sources stay mapped and read as before
        store.end_step()
        sync.end_step()
        store.publish_conversions()
        assert store.page_table.fmt[pages].tolist() == [FMT_HOT] * 3
        assert torch.equal(store.page_table.phys[pages].long(), src)
        assert _same(_snapshot(store, pages), before)
        assert store.hot_pool.refcount[src].tolist() == [2] * 3  # the mapping and the conversion
        assert store.reference_mismatches() == 0 and store.stats.retier.pages == 0
        assert store.held_by_conversions(store.tq3_pool) == 3 and store.tq3_pool.num_free == sync.tq3_pool.num_free
    stream.complete()
    store.publish_conversions()
    assert not store.conversions_pending and store.stats.retier.pages == 3 and store.stats.retier.batches == 1
    assert torch.equal(store.page_table.fmt, sync.page_table.fmt) and torch.equal(store.page_table.phys, sync.page_table.phys)
    assert all(torch.equal(a, b) for a, b in zip(store.tq3, sync.tq3))
    assert store.hot_pool.refcount[src].tolist() == [0] * 3 and store.hot_pool.num_quarantined == 3
    assert store.reference_mismatches() == 0


def test_a_pending_promotion_then_publishes_the_synchronous_bytes():
    stream, store, sync = _stores()
    pages = _fill((store, sync), [1, 3])
    stream.hold = False
    store.retier(pages)
    sync.retier(pages)
    stream.hold = True
    tq3 = _snapshot(store, pages)
    assert store.promote(pages) == sync.promote(pages) == 2
    assert store.page_table.fmt[pages].tolist() == [FMT_TQ3] * 2 and _same(_snapshot(store, pages), tq3)
    assert store.held_by_conversions(store.hot_pool) == 2 and store.reference_mismatches() == 0
    stream.complete()
    store.publish_conversions()
    assert store.page_table.fmt[pages].tolist() == [FMT_HOT] * 2
    assert _same(_snapshot(store, pages), _snapshot(sync, pages))


def test_a_page_with_a_pending_conversion_is_not_converted_again():
    stream, store, _ = _stores()
    pages = _fill((store,), [2, 3])
    assert store.retier(pages[:1]) == 1
    assert store.retier(pages) == 1  # page 3 only
    assert store.tq3_pool.num_held == 2 and store.stats.retier.pages == 0
    stream.complete()
    store.publish_conversions()
    assert store.page_table.fmt[pages].tolist() == [FMT_TQ3] * 2 and store.stats.retier.pages == 2
    stream.hold = False
    store.retier(pages)  # already TQ3: nothing to do
    stream.hold = True
    assert store.promote(pages[1:]) == 1 and store.promote(pages) == 1  # page 2 only
    assert store.hot_pool.refcount.sum() == 2 and store.reference_mismatches() == 0


@pytest.mark.parametrize("remap", [False, True])
def test_a_page_freed_while_its_conversion_is_pending_is_not_mapped_by_the_publish(remap):
    stream, store, _ = _stores()
    pages = _fill((store,), [2, 3])
    src2 = int(store.page_table.phys[2])
    store.retier(pages)
    tq3_free = store.tq3_pool.num_free
    store.unmap(torch.tensor([2]))  # SGLang freed it: the conversion's reference keeps the source
    assert store.hot_pool.refcount[src2] == 1 and store.reference_mismatches() == 0
    assert store.held_by_conversions(store.hot_pool) == 1 and store.held_by_conversions(store.tq3_pool) == 2
    if remap:  # and allocated it again: a fresh hot page, which the publish must not clobber
        store.map_new(torch.tensor([2]))
        new = int(store.page_table.phys[2])
    stream.complete()
    store.publish_conversions()
    assert int(store.page_table.fmt[3]) == FMT_TQ3
    if remap:
        assert int(store.page_table.fmt[2]) == FMT_HOT and int(store.page_table.phys[2]) == new
    else:
        assert int(store.page_table.phys[2]) == UNMAPPED
    assert store.tq3_pool.num_free == tq3_free + 1  # page 2's destination: never read, free at once
    assert src2 in store.hot_pool._freed  # page 2's source: a forward may have read it, quarantined
    assert store.stats.retier.pages == 1 and store.reference_mismatches() == 0


def test_reset_cancels_pending_conversions_after_waiting_for_them():
    stream, store, _ = _stores()
    pages = _fill((store,), [1, 2, 3])
    store.retier(pages)
    store.promote(torch.tensor([9]))  # unmapped: nothing
    store.reset()
    assert stream.waits == 1 and not store.conversions_pending and not store.converting.any()
    assert store.hot_pool.num_free == 6 and store.tq3_pool.num_free == 10 and store.reference_mismatches() == 0
    pages = _fill((store,), [1, 2])  # the store works on
    stream.hold = False
    assert store.retier(pages) == 2 and store.page_table.fmt[pages].tolist() == [FMT_TQ3] * 2


def test_reserve_hot_waits_for_pending_conversions():
    stream, store, _ = _stores(num_hot=4)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, retier_batch_pages=2))
    pages = _fill((store,), [1, 2, 3, 4])
    store.retier(pages[:2])  # pending: their hot pages are not free yet
    assert store.hot_pool.num_free == 0 and ctl.hot_reachable() == 4
    assert ctl.reserve_hot(3)  # publishes (a wait), frees the sources, converts one more
    assert stream.waits >= 1 and not store.conversions_pending
    assert store.hot_pool.num_free >= 3 and store.reference_mismatches() == 0


def test_the_controller_does_not_settle_while_conversions_are_pending():
    stream, store, _ = _stores(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, retier_batch_pages=8))
    seq = _fill((store,), [1, 2, 3])
    key = ("req", 3)
    ctl.tick([seq], key=key)  # launches the conversion of pages 1 and 2
    assert store.conversions_pending and store.page_table.fmt[seq].tolist() == [FMT_HOT] * 3
    for _ in range(2):
        store.end_step()
        assert not ctl.settled(key)  # a skipped tick would never publish them
        ctl.tick([seq], key=key)
        assert store.conversions_pending and store.stats.retier.pages == 0
    stream.complete()
    store.end_step()
    assert not ctl.settled(key)
    ctl.tick([seq], key=key)  # publishes them, then finds nothing to do
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT] and store.stats.retier.pages == 2
    assert ctl.settled(key)


def test_a_copy_that_fails_at_launch_leaves_nothing_pending():
    stream, store, _ = _stores()
    pages = _fill((store,), [4, 5])
    phys = store.page_table.phys.clone()

    def broken(src, dst):
        raise RuntimeError("launch fault")

    store._per_layer = lambda copy_layer: broken
    assert store.retier(pages) == 0
    assert not store.conversions_pending and torch.equal(store.page_table.phys, phys)
    assert store.stats.retier.failed_pages == 2 and store.reference_mismatches() == 0


@pytest.mark.parametrize("via_env", [False, True])
def test_debug_poison_fills_pages_as_they_return_to_the_free_list(monkeypatch, via_env):
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL", raising=False)
    assert make_store().hot_pool.on_free is None  # off by default
    if via_env:
        monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    store = make_store(debug_poison=None if via_env else True)
    pages = _fill((store,), [1, 2])
    hot = int(store.page_table.phys[1])
    store.retier(pages[1:])  # page 2 on TQ3, its hot page quarantined
    tq3 = int(store.page_table.phys[2])
    store.unmap(pages)
    store.end_step()
    rows = slice(hot * PS, (hot + 1) * PS)
    assert not store.hot_k[0][rows].view(torch.float8_e4m3fn).float().isnan().any()  # quarantined: intact
    store.end_step()
    assert store.hot_k[0][rows].view(torch.float8_e4m3fn).float().isnan().all()
    assert store.hot_v[1][rows].view(torch.float8_e4m3fn).float().isnan().all()
    assert (store.tq3[0][tq3] == 0xFF).all()
