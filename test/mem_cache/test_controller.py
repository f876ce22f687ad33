"""LifecycleController: tiers, the per-step tick and the pressure path."""

from types import SimpleNamespace

import pytest
import torch

from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.mem_cache.page_table import (
    FMT_HOT, FMT_TQ3, TIER_ANCHOR, TIER_NONE, TIER_RECENT, TIER_STALE, PageTable,
)
from store_helpers import PS, HeldConversionStream, make_store, random_kv, write_tokens


def _request(store, pages, tokens=None):
    """Map ``pages`` and write ``tokens`` tokens into them (all, by default)."""
    pages = torch.tensor(pages)
    store.map_new(pages)
    n = pages.numel() * PS if tokens is None else tokens
    slots = (pages[:, None] * PS + torch.arange(PS)).flatten()[:n]
    write_tokens(store, slots, *random_kv(n))
    return pages


def test_classify_recent_sink_budget_and_shared_pages():
    store = make_store(num_logical=20, num_hot=20)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=2, sink_pages=1, anchor_pages=1))
    a = torch.tensor([1, 2, 3, 4, 5, 6])
    b = torch.tensor([1, 2, 9])  # shares the first two pages with a
    tiers = ctl.classify([a, b])
    assert tiers[a].tolist() == [TIER_ANCHOR, TIER_RECENT, TIER_STALE, TIER_ANCHOR, TIER_RECENT, TIER_RECENT]
    assert tiers[9] == TIER_RECENT and tiers[7] == TIER_NONE


@pytest.mark.gpu
def test_classify_waits_for_nothing_on_cuda():
    # the tiers of live pages from host lengths and fixed-shape ops: no device read (the tick's
    # first device op would otherwise wait for the forward in flight)
    ctl = LifecycleController(SimpleNamespace(page_table=PageTable(20, PS, device="cuda")),
                              MinimaConfig(recent_pages=2, sink_pages=1, anchor_pages=1))
    a, b = torch.tensor([1, 2, 3, 4, 5, 6], device="cuda"), torch.tensor([1, 2, 9], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tiers = ctl.classify([a, b])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tiers[a].tolist() == [TIER_ANCHOR, TIER_RECENT, TIER_STALE, TIER_ANCHOR, TIER_RECENT, TIER_RECENT]
    assert tiers[9] == TIER_RECENT and tiers[7] == TIER_NONE


def test_attention_score_fills_the_anchor_budget():
    store = make_store(num_logical=20, num_hot=20)
    ctl = LifecycleController(
        store, MinimaConfig(recent_pages=1, sink_pages=0, anchor_pages=1, attention_score_anchors=True)
    )
    seq = torch.tensor([1, 2, 3, 4])
    store.note_page_scores(torch.tensor([2, 3]), torch.tensor([5.0, 1.0]), decay=0.0)
    assert ctl.classify([seq])[seq].tolist() == [TIER_STALE, TIER_ANCHOR, TIER_STALE, TIER_RECENT]


def test_tick_converts_sealed_stale_pages_oldest_first_in_batches():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, retier_batch_pages=2))
    seq = _request(store, [1, 2, 3, 4, 5, 6], tokens=6 * PS - 1)  # last page still being written
    ctl.tick([])  # allocated before this tick: the next converts a batch, not the pages allocated since
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT, FMT_HOT, FMT_HOT]
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT]


def test_disable_stale_never_converts():
    store = make_store(num_logical=8, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, disable_stale=True))
    seq = _request(store, [1, 2, 3])
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT] * 3
    assert not ctl.reserve_hot(store.shape.num_hot_pages + 1)


def test_the_observation_window_pins_anchors_once_the_prefill_ends_and_keeps_them():
    store = make_store(num_logical=20, num_hot=10)
    config = MinimaConfig(recent_pages=1, sink_pages=1, anchor_pages=2, anchor_window=64,
                          defer_prefill_conversion=True)
    ctl = LifecycleController(store, config)
    seq = _request(store, [1, 2, 3, 4, 5, 6])
    ctl.tick([seq], [True], requests=["a"])  # in prefill: nothing pinned, nothing converted (deferred)
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT] * 6
    # the window of the chunk that ends the prefill: page 4 most, then page 2; page 3 none;
    # page 1 (the sink) and page 6 (Recent) are never picked, whatever their mass
    store.note_window_mass(seq, torch.tensor([9.0, 2.0, 0.0, 5.0, 1.0, 9.0]), {})
    # allocated past the prompt, but its window's forward not launched yet (the overlap scheduler): wait
    ctl.tick([seq], [False], requests=["a"], window_ready=[False])
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT] * 6 and store.stats.window_anchor_pages == 0
    ctl.tick([seq], [False], requests=["a"], window_ready=[True])
    assert store.page_table.tier[seq].tolist() == [TIER_ANCHOR, TIER_ANCHOR, TIER_STALE, TIER_ANCHOR, TIER_STALE,
                                                   TIER_RECENT]
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_HOT, FMT_TQ3, FMT_HOT, FMT_TQ3, FMT_HOT]
    assert store.stats.window_anchor_pages == 2
    # a later window (a decode step, another chunk) does not move them: picked once per request
    store.note_window_mass(seq, torch.tensor([0.0, 0.0, 0.0, 0.0, 7.0, 0.0]), {})
    ctl.tick([seq], [False], requests=["a"])
    assert store.page_table.tier[seq].tolist()[:5] == [TIER_ANCHOR, TIER_ANCHOR, TIER_STALE, TIER_ANCHOR, TIER_STALE]
    # released: its pins go with it
    assert not ctl.window_pins([], [], [], []).any()


def test_the_observation_window_never_picks_a_page_already_tq3():
    store = make_store(num_logical=20, num_hot=10)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, anchor_pages=1, anchor_window=64,
                                                  defer_prefill_conversion=False))
    seq = _request(store, [1, 2, 3])
    ctl.tick([seq], [True], requests=["a"])  # no deferral: the first chunk's Stale pages 1-2 convert
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT]
    store.drain_quarantine()
    more = _request(store, [4, 5])
    seq = torch.cat([seq, more])
    store.note_window_mass(seq, torch.tensor([9.0, 9.0, 1.0, 2.0, 0.0]), {})  # the TQ3 pages attended most
    ctl.tick([seq], [False], requests=["a"])
    # the window's heaviest hot page (4) is pinned, pages 1-2 stay TQ3 (no promotion), page 3 converts
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT, FMT_HOT]
    assert store.stats.promote.pages == 0
    assert store.stats.window_anchor_pages == 1  # page 5 is Recent, page 3 had the window's least mass


def test_window_pins_need_one_identity_per_request():
    ctl = LifecycleController(make_store(num_logical=8, num_hot=8),
                              MinimaConfig(anchor_pages=1, anchor_window=16))
    with pytest.raises(ValueError, match="request ids"):
        ctl.window_pins([torch.tensor([1, 2])], [False], [], [True])


def _anchor_on_page_1(num_hot: int):
    """One request of pages 1-4, one Recent page and one score Anchor (page 1) after a tick: pages 2-3 TQ3."""
    store = make_store(num_logical=16, num_hot=num_hot)
    ctl = LifecycleController(
        store, MinimaConfig(recent_pages=1, sink_pages=0, anchor_pages=1, attention_score_anchors=True)
    )
    seq = _request(store, [1, 2, 3, 4])
    store.note_page_scores(torch.tensor([1]), torch.tensor([1.0]), decay=0.0)
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]
    store.drain_quarantine()  # no forward in flight: the converted pages' sources are free
    return store, ctl, seq


def test_promotion_when_a_stale_page_reenters_the_anchor_budget():
    store, ctl, seq = _anchor_on_page_1(num_hot=8)
    store.note_page_scores(torch.tensor([3]), torch.tensor([1.0]), decay=0.0)
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT, FMT_HOT]
    assert store.stats.promote.pages == 1


def test_promotion_with_no_hot_page_free_waits_instead_of_failing():
    store, ctl, seq = _anchor_on_page_1(num_hot=4)
    other = _request(store, [5, 6])  # takes the last two hot pages
    assert store.hot_pool.num_free == 0
    assert store.promote(torch.tensor([3])) == 0  # nothing free: no attempt, no failure
    store.note_page_scores(torch.tensor([3]), torch.tensor([1.0]), decay=0.0)
    ctl.tick([seq, other])  # page 3 wants FP8 again; page 1 goes Stale and frees one hot page ...
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT]
    store.drain_quarantine()
    assert store.hot_pool.num_free == 1  # ... which stays the decode reserve (two requests)
    assert store.stats.promote.pages == 0 and store.stats.promote.failed_pages == 0
    store.unmap(other)  # the other request finished: hot pages are spare again
    store.drain_quarantine()
    ctl.tick([seq])
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT, FMT_HOT]
    assert store.stats.promote.pages == 1 and store.stats.promote.failed_pages == 0


def test_pressure_converts_cached_then_anchor_then_recent_never_the_tail():
    store = make_store(num_logical=16, num_hot=6)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=3, sink_pages=1))
    cached = _request(store, [1])
    seq = _request(store, [2, 3, 4, 5], tokens=4 * PS - 1)
    store.page_table.tier.copy_(ctl.classify([seq]))  # classification without the tick's conversions
    assert store.hot_pool.num_free == 1
    assert ctl.reserve_hot(2)
    assert store.page_table.fmt[cached].item() == FMT_TQ3
    assert ctl.reserve_hot(3)
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_HOT, FMT_HOT, FMT_HOT]
    assert ctl.reserve_hot(5)
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT]
    assert not ctl.reserve_hot(6)  # page 5 is being written
    assert store.stats.pressure_retier_pages == 4
    assert store.stats.pressure_retier_tiers == {"stale": 0, "cached": 1, "deferred": 0, "anchor": 1, "recent": 2}
    # one device sync per converting call (its publish); the refused one had nothing in flight
    assert store.stats.allocation_syncs == 3


def _cached_beside_a_request(num_logical: int, batch: int):
    """Three cached pages (held by the tree only) beside a request of a sink, a Stale and a Recent page
    (being written), classified without the tick's conversions; one hot page of seven free."""
    store = make_store(num_logical=num_logical, num_hot=7)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, pressure_batch_pages=batch))
    cached = _request(store, [1, 2, 3])
    seq = _request(store, [4, 5, 6], tokens=3 * PS - 1)
    store.page_table.tier.copy_(ctl.classify([seq]))
    assert store.hot_pool.num_free == 1
    return store, ctl, cached, seq


@pytest.mark.parametrize("batch, syncs", [(0, 2), (4, 1), (10, 1)])
def test_a_pressure_batch_converts_stale_and_cached_pages_ahead_at_one_sync(batch, syncs):
    """--minima-pressure-batch-pages: the allocation short of one page converts the Stale page and, up to
    the batch, the cached ones at the same sync, so the next allocation finds free pages; never a live
    request's Anchor (the sink) or Recent page beyond the shortfall, whatever the batch."""
    store, ctl, cached, seq = _cached_beside_a_request(16, batch)
    assert ctl.reserve_hot(2)
    ahead = batch > 0
    assert store.page_table.fmt[cached].tolist() == [FMT_TQ3 if ahead else FMT_HOT] * 3
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_TQ3, FMT_HOT]
    assert ctl.reserve_hot(5)  # the batch left it free pages: no sync
    assert store.page_table.fmt[cached].tolist() == [FMT_TQ3] * 3 and store.page_table.fmt[seq][0] == FMT_HOT
    assert store.stats.allocation_syncs == syncs
    assert store.stats.pressure_retier_tiers == {"stale": 1, "cached": 3, "deferred": 0, "anchor": 0, "recent": 0}
    assert store.reference_mismatches() == 0


@pytest.mark.parametrize("matched", [True, False])
def test_a_pressure_batch_leaves_deferred_pages_and_a_just_matched_prefix(matched):
    """The batch takes cached pages only where no request matched them since the last tick (one admitted
    since would read them before its pages are classified), and never the deferral's pages."""
    store = make_store(num_logical=20, num_hot=9)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, defer_prefill_conversion=True,
                                                  pressure_batch_pages=8))
    cached = _request(store, [1, 2, 3])  # held by the tree only
    chunked = _request(store, [4, 5, 6, 7])  # between two chunks of its prefill: 5 and 6 deferred
    decoding = _request(store, [8, 9])
    ctl.tick([chunked, decoding], prefilling=[True, False])
    assert store.hot_pool.num_free == 0 and not store.conversions_pending
    if matched:
        ctl.note_matched(torch.tensor([3]))  # a new request's prefix hit, before the next tick
    assert ctl.reserve_hot(1)
    assert store.page_table.fmt[cached].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT if matched else FMT_TQ3]
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT] * 4 and store.page_table.fmt[decoding].tolist() == [FMT_HOT] * 2
    assert store.stats.pressure_retier_tiers["cached"] == (2 if matched else 3) and store.stats.allocation_syncs == 1
    if matched:
        ctl.tick([chunked, decoding], prefilling=[True, False])  # the match is classified (or gone) now
        assert not ctl._matched.any()


def test_a_pressure_batch_takes_no_more_than_the_free_tq3_pages():
    store, ctl, cached, _ = _cached_beside_a_request(10, 10)  # 3 TQ3 pages
    assert ctl.reserve_hot(2)
    assert store.page_table.fmt[cached].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT]  # the Stale page 5 and two more
    assert store.stats.retier.no_room_pages == 0  # nothing asked for that could not convert


def test_an_allocation_counts_the_device_syncs_it_waits_on():
    store = make_store(num_logical=16, num_hot=4)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0))
    store.unmap(_request(store, [1, 2, 3]))  # a finished request's pages: quarantined, not free yet
    assert store.hot_pool.num_free == 1 and store.num_quarantined == 3
    assert ctl.reserve_hot(1) and store.stats.allocation_syncs == 0  # a free page: nothing to wait for
    assert ctl.reserve_hot(3) and store.stats.allocation_syncs == 1  # the quarantine freed at once
    assert store.stats.pressure_retier_pages == 0 and store.hot_pool.num_free == 4


def test_cached_pages_keep_their_format_until_pressure():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0))
    cached = _request(store, [1, 2])  # held by the tree only
    ctl.tick([])
    assert store.page_table.fmt[cached].tolist() == [FMT_HOT, FMT_HOT]
    assert ctl.reserve_hot(store.hot_pool.num_free + 1)
    assert store.page_table.fmt[cached].tolist() == [FMT_TQ3, FMT_HOT]


def test_defer_prefill_conversion_keeps_a_prefilling_request_hot_until_its_prefill_ends():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, defer_prefill_conversion=True))
    chunked = _request(store, [1, 2, 3, 4])  # between two chunks of its prefill
    decoding = _request(store, [5, 6, 7])
    ctl.tick([chunked, decoding], prefilling=[True, False])
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT] * 4
    assert store.page_table.fmt[decoding].tolist() == [FMT_HOT, FMT_TQ3, FMT_HOT]
    assert store.page_table.tier[chunked].tolist() == [TIER_ANCHOR, TIER_STALE, TIER_STALE, TIER_RECENT]
    store.drain_quarantine()  # the tick's sources are free: one more page needs a conversion
    assert ctl.reserve_hot(store.hot_pool.num_free + 1)  # memory presses: its Stale pages go first
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT, FMT_TQ3, FMT_HOT, FMT_HOT]
    ctl.tick([chunked, decoding], prefilling=[False, False])  # prefill ended
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]


def test_pressure_takes_stale_then_cached_then_deferred_pages():
    """A decoding request's Stale page the tick has not reached goes first (the tick would convert it
    anyway), then a cached page (a prefix hit would read it as TQ3), then an older prompt's deferred
    pages (its own later chunks would); each is counted as what it was."""
    store = make_store(num_logical=16, num_hot=9)
    ctl = LifecycleController(
        store, MinimaConfig(recent_pages=1, sink_pages=1, defer_prefill_conversion=True, retier_batch_pages=1)
    )
    chunked = _request(store, [1, 2, 3, 4])  # between two chunks of its prefill
    decoding = _request(store, [5, 6, 7, 8])
    cached = _request(store, [9])  # held by the tree only
    ctl.tick([])  # (allocated before the last tick: one page a tick from here)
    ctl.tick([chunked, decoding], prefilling=[True, False])  # 6 converts, 7 waits
    assert store.page_table.fmt[decoding].tolist() == [FMT_HOT, FMT_TQ3, FMT_HOT, FMT_HOT]
    store.drain_quarantine()
    assert ctl.reserve_hot(store.hot_pool.num_free + 1)
    assert store.page_table.fmt[decoding].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]
    assert store.page_table.fmt[cached].item() == FMT_HOT
    assert ctl.reserve_hot(store.hot_pool.num_free + 1)
    assert store.page_table.fmt[cached].item() == FMT_TQ3
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT] * 4
    assert ctl.reserve_hot(store.hot_pool.num_free + 2)  # then the prompt's, oldest first
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]
    assert store.stats.pressure_retier_tiers == {"stale": 1, "cached": 1, "deferred": 2, "anchor": 0, "recent": 0}
    assert store.stats.pressure_retier_pages == 4 and store.reference_mismatches() == 0


def test_a_tick_converts_as_many_pages_as_were_allocated_since_the_last_one():
    """A wave of new pages is converted by the next tick, past retier_batch_pages (conversions keep
    pace with allocations instead of leaving them to the pressure path); Stale pages that no allocation
    brought (a prefill that ended) convert retier_batch_pages a tick."""
    store = make_store(num_logical=32, num_hot=16)
    ctl = LifecycleController(
        store, MinimaConfig(recent_pages=1, sink_pages=1, defer_prefill_conversion=True, retier_batch_pages=2)
    )
    wave = _request(store, list(range(1, 9)))  # 8 new pages: a sink, 6 Stale, 1 Recent
    chunked = _request(store, list(range(9, 15)))  # 6 more, in prefill: deferred
    ctl.tick([wave, chunked], prefilling=[False, True])
    assert store.page_table.fmt[wave].tolist() == [FMT_HOT] + [FMT_TQ3] * 6 + [FMT_HOT]
    assert store.stats.retier.pages == 6 and store.stats.retier.batches == 3  # launched a batch at a time
    ctl.tick([wave, chunked], prefilling=[False, False])  # its prefill ended: 4 Stale pages, none allocated
    assert store.stats.retier.pages == 8
    ctl.tick([wave, chunked], prefilling=[False, False])
    assert store.stats.retier.pages == 10 and store.page_table.fmt[chunked].tolist() == [FMT_HOT] + [FMT_TQ3] * 4 + [FMT_HOT]


def test_strict_admission_does_not_count_the_hot_pages_a_pending_promotion_will_map():
    """Two requests come to share three pages that are TQ3: the tick promotes two of them (they are
    Anchors now), and while that copy is pending its destinations are hot pages a strict admission
    must not count: published, they are Anchors, which it promised not to convert."""
    stream = HeldConversionStream(hold=False)
    store = make_store(num_logical=24, num_hot=8, stream=stream)
    ctl = LifecycleController(
        store, MinimaConfig(recent_pages=1, sink_pages=1, strict_hot_admission=True, retier_batch_pages=8)
    )
    a = _request(store, [1, 2, 3, 4, 5, 6], tokens=6 * PS - 1)
    ctl.tick([a])
    store.end_step()
    store.drain_quarantine()
    stream.hold = True
    b = torch.cat([a[:3], _request(store, [7], tokens=PS - 1)])  # a prefix hit on a's first pages
    ctl.tick([a, b])
    assert store.conversions_pending and store.stats.promote.pages == 0  # launched, not published
    n = ctl.hot_reachable(admission=True)
    assert n == store.hot_pool.num_free and ctl.hot_reachable() > n
    assert ctl.reserve_hot(n)
    assert store.stats.pressure_retier_tiers["anchor"] == store.stats.pressure_retier_tiers["recent"] == 0


def test_without_defer_prefill_conversion_a_prefilling_request_converts_at_once():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, defer_prefill_conversion=False))
    chunked = _request(store, [1, 2, 3, 4])
    ctl.tick([chunked], prefilling=[True])
    assert store.page_table.fmt[chunked].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]


def test_a_tick_with_nothing_to_do_settles_until_a_page_a_mapping_or_the_key_changes():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1, retier_batch_pages=8))
    seq = _request(store, [1, 2, 3, 4], tokens=3 * PS)  # page 4 mapped, not written yet
    key = (("a", 4),)
    assert not ctl.settled(key)
    ctl.tick([seq], key=key)  # converts pages 2 and 3: work done, so not settled
    assert store.page_table.fmt[seq].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_HOT]
    assert not ctl.settled(key)
    ctl.tick([seq], key=key)  # the converted pages' sources wait in the quarantine: nothing to do
    assert ctl.settled(key)
    assert not ctl.settled((("a", 5),))  # the request crossed a page: its tiers move
    store.end_step()
    assert ctl.settled(key)  # the sources cool for a step more
    store.end_step()  # ... then they are free: promotion may want hot pages
    assert not ctl.settled(key)
    ctl.tick([seq], key=key)
    assert ctl.settled(key)
    other = _request(store, [7])  # another request's allocation: the store's mappings changed
    assert not ctl.settled(key)
    ctl.tick([seq, other], key=key + (("b", 1),))
    assert ctl.settled(key + (("b", 1),))


def test_a_stale_page_still_being_written_keeps_the_tick_running():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0))
    seq = _request(store, [1, 2, 3], tokens=PS + 3)  # page 2 Stale, 3 of its slots written so far
    ctl.tick([seq], key=1)
    ctl.tick([seq], key=1)
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_HOT, FMT_HOT]
    assert not ctl.settled(1)  # a forward in flight may still fill page 2: look again next step
    write_tokens(store, 2 * PS + torch.arange(3, PS), *random_kv(PS - 3))  # its writes land
    ctl.tick([seq], key=1)
    assert store.page_table.fmt[seq].tolist() == [FMT_TQ3, FMT_TQ3, FMT_HOT]
    ctl.tick([seq], key=1)
    assert ctl.settled(1)


def test_ticks_wait_for_new_pages_but_not_for_new_requests_publishing_or_a_short_pool():
    """--minima-tick-min-new-pages: the tick waits until the live requests added that many pages,
    except where waiting could cost: another request set or prefill state, conversions to publish,
    or fewer free FP8 pages than the wait could need."""
    stream = HeldConversionStream()
    store = make_store(num_logical=32, num_hot=24, stream=stream)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, tick_min_new_pages=4))
    a = (("a", 0, False),)
    assert ctl.due(a, 3)  # no tick yet
    ctl.ticked(a, 3)
    assert not ctl.due(a, 3) and not ctl.due(a, 6)  # three pages added: wait
    assert ctl.due(a, 7)  # four
    assert ctl.due((("a", 0, True),), 3)  # its prefill state changed
    assert ctl.due(a + (("b", 1, True),), 4)  # a new request
    assert ctl.due((), 0)  # every request ended
    seq = _request(store, [1, 2, 3])
    ctl.tick([seq])  # converts pages 1 and 2 on the held stream: until published, every step is due
    assert store.conversions_pending and ctl.due(a, 3)
    stream.complete()
    ctl.tick([seq])  # publishes them
    assert not store.conversions_pending and store.stats.retier.pages == 2
    assert not ctl.due(a, 3)
    short = store.hot_pool.num_free - (len(a) + 4) + 1  # fewer free FP8 pages than one wait could need
    store.map_new(torch.arange(10, 10 + short))
    assert ctl.due(a, 3)
    # a tick that fills its conversion batch leaves a backlog: the next step is due, pages or not
    backlog = make_store(num_logical=32, num_hot=24)
    bctl = LifecycleController(backlog, MinimaConfig(recent_pages=1, sink_pages=0, retier_batch_pages=2,
                                                     tick_min_new_pages=4))
    long = _request(backlog, [1, 2, 3, 4, 5, 6])  # five Stale pages, two converted a tick
    bctl.tick([])  # (allocated before the last tick)
    bctl.tick([long])
    bctl.ticked(a, 6)
    assert backlog.stats.retier.pages == 2 and bctl.due(a, 6)
    bctl.tick([long])
    bctl.tick([long])  # the fifth page: the batch not filled, the backlog cleared
    bctl.ticked(a, 6)
    assert backlog.stats.retier.pages == 5 and not bctl.due(a, 6)
    # the default ticks at every page boundary, as before the flag (settled decides alone)
    dflt = LifecycleController(store, MinimaConfig())
    dflt.ticked(a, 3)
    assert dflt.due(a, 3)
