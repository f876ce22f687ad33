"""sglang:minima_* Prometheus metrics: SGLang's labels, gauges per tier, counters that only grow, and
the fallback counter and scratch gauge fed by what the attention backends tell the pool."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from prometheus_client import REGISTRY, generate_latest
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_minima.config import CONFIG_ENV, MinimaConfig
from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.mem_cache.kv_pool import MinimaKVPool
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.reporting.memory_report import TIERS, memory_report
from sglang_minima.reporting.metrics import get_minima_metrics
from store_helpers import PS, make_store, random_kv, write_tokens

LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}


def _sample(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, {**{k: str(v) for k, v in LABELS.items()}, **labels})
    assert value is not None, name
    return value


def test_metrics_follow_the_store():
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1))
    pages = torch.tensor([1, 2, 3, 4])
    store.map_new(pages)
    write_tokens(store, torch.arange(PS, 5 * PS), *random_kv(4 * PS))
    store.note_read(pages, hot_tokens=4 * PS)
    ctl.tick([pages])
    metrics = get_minima_metrics(LABELS)
    assert get_minima_metrics({}) is metrics
    metrics.update(memory_report(store), store.stats)
    metrics.update(memory_report(store), store.stats)  # counters add only what the stats gained
    assert _sample("sglang:minima_pages", tier="stale") == 2
    assert _sample("sglang:minima_pages", tier="recent") == 1
    assert _sample("sglang:minima_bytes", tier="stale", kind="metadata") == 2 * 2 * store.layout.metadata_bytes
    assert _sample("sglang:minima_conversion_pages_total", direction="retier") == 2
    assert _sample("sglang:minima_route_pages_total", format="hot") == 4
    assert _sample("sglang:minima_route_tokens_total", format="hot") == 4 * PS
    assert _sample("sglang:minima_live_tokens") == 4 * PS
    assert _sample("sglang:minima_peak_scratch_bytes") == store.stats.peak_scratch_bytes > 0  # the retier's staging


def _exported(name: str) -> float:
    """A sample as /metrics serves it: the text exposition of the process's registry (0 while a
    counter was never increased: prometheus_client exports no sample for it then)."""
    text = generate_latest(REGISTRY).decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert len(values) <= 1, (name, values)
    return sum(values)


def test_fallbacks_and_peak_scratch_reach_the_exported_text(monkeypatch):
    """MinimaKVPool.note_fallback / note_scratch_bytes (what the attention backends call) -> the
    store's stats -> the radix cache's step listener (MinimaMetrics.report) -> sglang:minima_* text."""
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig().to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    pool = MinimaKVPool(16 * PS, page_size=PS, dtype=torch.float32, head_num=2, head_dim=64, layer_num=2,
                        device="cpu", enable_memory_saver=False)
    metrics = get_minima_metrics(LABELS)
    metrics.report(pool.store)
    fallbacks = _exported("sglang:minima_fallbacks_total")
    pool.note_fallback()
    pool.note_fallback()
    pool.note_scratch_bytes(4096)
    pool.note_scratch_bytes(1024)  # a smaller step leaves the peak
    pool.store.hot_pool.release(pool.store.hot_pool.alloc(3), unread=True)  # three hot pages held, then none
    syncs = _exported("sglang:minima_allocation_syncs_total")
    page = pool.store.hot_pool.alloc(1)
    pool.store.hot_pool.release(page)  # quarantined: an allocation of every hot page waits for it
    assert pool.lifecycle.reserve_hot(pool.store.hot_pool.num_pages)
    metrics.report(pool.store)
    assert _exported("sglang:minima_allocation_syncs_total") == syncs + 1
    assert _sample("sglang:minima_peak_pages_held", format="hot") == 3
    assert pool.stats.fallbacks == 2
    assert _exported("sglang:minima_fallbacks_total") == fallbacks + 2
    assert _exported("sglang:minima_peak_scratch_bytes") == 4096


def test_hot_deferrals_reach_the_exported_text(monkeypatch):
    """A prefill admission past the step's hot pages (MinimaPagedAllocator's HotPageBudget) -> the
    store's stats -> sglang:minima_prefill_hot_deferrals_total."""
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig(fp8_page_fraction=0.25).to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    pool = MinimaKVPool(16 * PS, page_size=PS, dtype=torch.float32, head_num=2, head_dim=64, layer_num=2,
                        device="cpu", enable_memory_saver=False)
    allocator = MinimaPagedAllocator(16 * PS, PS, torch.float32, "cpu", pool, False)
    tree = SimpleNamespace(evictable_size=lambda: 0, supports_mamba=lambda: False)
    metrics = get_minima_metrics(LABELS)
    metrics.report(pool.store)
    before = _exported("sglang:minima_prefill_hot_deferrals_total")
    budget = allocator.create_prefill_budget(tree)
    budget.reserve(3 * PS, 0)  # the step's 4 FP8 pages: 3 for a chunk, 1 reserved with it
    assert budget.check_prefill(extend_input_len=PS, total_tokens=2 * PS, max_new_tokens=PS, input_tokens=PS,
                                swa_host_hit_length=0, chunk_limit=None) == (True, 0)
    metrics.report(pool.store)
    assert _exported("sglang:minima_prefill_hot_deferrals_total") == before + 1


def test_lifecycle_ticks_reach_the_exported_text():
    """Ticks that ran (LifecycleController.tick) and ticks deferred for new pages (the radix cache
    counts those) -> sglang:minima_lifecycle_ticks_total{outcome}."""
    store = make_store(num_logical=16, num_hot=8)
    ctl = LifecycleController(store, MinimaConfig(tick_min_new_pages=4))
    metrics = get_minima_metrics(LABELS)  # one per process: start from what earlier tests' stores reported
    ran, deferred = (_exported_labelled("sglang:minima_lifecycle_ticks_total", outcome) for outcome in ("ran", "deferred"))
    store.stats.lifecycle_ticks, store.stats.lifecycle_ticks_deferred = int(ran), int(deferred)
    pages = torch.tensor([1, 2])
    store.map_new(pages)
    ctl.tick([pages])
    ctl.tick([pages])
    store.stats.lifecycle_ticks_deferred += 3
    metrics.update(memory_report(store), store.stats)
    assert store.stats.lifecycle_ticks == ran + 2
    assert _exported_labelled("sglang:minima_lifecycle_ticks_total", "ran") == ran + 2
    assert _exported_labelled("sglang:minima_lifecycle_ticks_total", "deferred") == deferred + 3


def _exported_labelled(name: str, value: str, label: str = "outcome") -> float:
    text = generate_latest(REGISTRY).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'{label}="{value}"' in line)


def test_pressure_conversions_reach_the_exported_text_by_tier():
    """The pressure path's conversions (LifecycleController.reserve_hot) -> MinimaStats'
    pressure_retier_tiers -> sglang:minima_pressure_retier_pages_total{tier}."""
    store = make_store(num_logical=16, num_hot=4)
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1))
    metrics = get_minima_metrics(LABELS)  # one per process: start from what earlier tests' stores reported
    name = "sglang:minima_pressure_retier_pages_total"
    before = {t: _exported_labelled(name, t, "tier") for t in store.stats.pressure_retier_tiers}
    for tier, n in before.items():
        store.stats.pressure_retier_tiers[tier] = int(n)
    cached = torch.tensor([1])
    store.map_new(cached)
    write_tokens(store, torch.arange(PS, 2 * PS), *random_kv(PS))
    seq = torch.tensor([2, 3, 4])
    store.map_new(seq)
    write_tokens(store, torch.arange(2 * PS, 5 * PS - 1), *random_kv(3 * PS - 1))
    store.page_table.tier.copy_(ctl.classify([seq]))  # the tiers, without the tick's conversions
    assert ctl.reserve_hot(3)  # the Stale page 3, the cached page, then the sink (an Anchor)
    metrics.update(memory_report(store), store.stats)
    gained = {t: _exported_labelled(name, t, "tier") - before[t] for t in before}
    assert gained == {"stale": 1, "cached": 1, "deferred": 0, "anchor": 1, "recent": 0}


def test_stale_pages_a_full_tq3_pool_leaves_fp8_are_their_own_row():
    """A live request's pages the tick labels Stale but cannot convert (4 TQ3 pages for 6) stay FP8:
    the report counts them as stale_hot (not among the cached hot pages), the converted ones as stale."""
    store = make_store(num_logical=16, num_hot=12)  # 4 TQ3 pages
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=1))
    pages = torch.arange(1, 9)  # a sink, six Stale pages, a Recent one
    store.map_new(pages)
    slots = (pages[:, None] * PS + torch.arange(PS)).flatten()
    write_tokens(store, slots, *random_kv(slots.numel(), torch.Generator().manual_seed(0)))
    ctl.tick([pages])
    report = memory_report(store)
    assert tuple(report.tiers) == TIERS  # the rows the gauges and plots name, in their order
    rows = report.rows()
    # the sink is labelled Anchor; nothing is cached
    assert [rows[t].pages for t in ("stale", "stale_hot", "anchor", "recent", "hot_other")] == [4, 2, 1, 1, 0]
    assert store.stats.retier.no_room_pages == 2
    metrics = get_minima_metrics(LABELS)
    metrics.update(memory_report(store), store.stats)
    assert _sample("sglang:minima_pages", tier="stale_hot") == 2
    ctl.tick([pages[:5]])  # no live request holds pages 6-8 now: cached, not waiting
    rows = memory_report(store).rows()
    assert [rows[t].pages for t in ("stale_hot", "hot_other")] == [0, 3]


def test_pages_a_full_tq3_pool_leaves_fp8_reach_the_exported_text():
    """Retier asked for more pages than the TQ3 pool has free: those pages stay FP8 (the split, not the
    policy, sets the mix), counted per ask -> sglang:minima_conversion_no_room_pages_total{direction}."""
    store = make_store(num_logical=16, num_hot=12)  # 4 TQ3 pages
    metrics = get_minima_metrics(LABELS)  # one per process: start from what earlier tests' stores reported
    name = "sglang:minima_conversion_no_room_pages_total"
    before = _exported_labelled(name, "retier", "direction")
    store.stats.retier.no_room_pages = int(before)
    pages = torch.arange(1, 9)  # (logical page 0 is SGLang's padding)
    store.map_new(pages)
    slots = (pages[:, None] * PS + torch.arange(PS)).flatten()
    write_tokens(store, slots, *random_kv(slots.numel(), torch.Generator().manual_seed(0)))  # sealed: full pages
    assert store.retier(pages) == 4
    assert store.page_table.fmt[pages].tolist() == [FMT_TQ3] * 4 + [FMT_HOT] * 4
    assert store.retier(pages) == 0  # asked again: counted again
    assert store.stats.retier.no_room_pages == before + 8 and store.stats.retier.failed_pages == 0
    metrics.update(memory_report(store), store.stats)
    assert _exported_labelled(name, "retier", "direction") == before + 8
