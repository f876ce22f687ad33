"""Bytes per tier, reconciled exactly with the bytes the store allocated.

Every physical page of both regions is in exactly one row: a mapped page under its tier (hot pages
by the controller's label, TQ3 pages as Stale; a hot page the last tick labelled Stale is ``stale_hot``:
its conversion not published yet, or no free TQ3 page for it), a page held only by a conversion or the
release quarantine, a free page, or the padding page of each region. The rows add up to
``allocated_bytes`` by construction, and ``reconcile()`` checks that against the buffers themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sglang_minima.codec.accounting import PageBytes, tq3_bytes
from sglang_minima.codec.layout import fp8_page_bytes
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, TIER_ANCHOR, TIER_RECENT, TIER_STALE
from sglang_minima.mem_cache.tier_store import TieredPageStore

TIERS = ("recent", "anchor", "stale_hot", "hot_other", "stale")
"""stale_hot: live requests' Stale pages still FP8 (their conversion pending, deferred, or without a free
TQ3 page: where the split's TQ3 side binds, they pile up here; with Stale disabled, every one of them);
hot_other: hot pages no live request held at the last tick (cached prefixes). A live request's sinks are
Anchors."""


@dataclass(frozen=True)
class TierUsage:
    pages: int
    payload_bytes: int
    metadata_bytes: int
    padding_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.metadata_bytes + self.padding_bytes

    @classmethod
    def of(cls, pages: int, per_page: PageBytes, num_layers: int) -> TierUsage:
        n = pages * num_layers
        return cls(pages, n * per_page.payload, n * per_page.metadata, n * per_page.padding)


@dataclass(frozen=True)
class MemoryReport:
    tiers: dict[str, TierUsage]
    held_hot: TierUsage
    held_tq3: TierUsage
    free_hot: TierUsage
    free_tq3: TierUsage
    padding_pages: TierUsage
    live_tokens: int
    allocated_bytes: int

    @property
    def live_bytes(self) -> int:
        return sum(t.total_bytes for t in self.tiers.values())

    @property
    def bytes_per_live_token(self) -> float:
        return self.live_bytes / self.live_tokens if self.live_tokens else 0.0

    def rows(self) -> dict[str, TierUsage]:
        return {
            **self.tiers,
            "held_hot": self.held_hot,
            "held_tq3": self.held_tq3,
            "free_hot": self.free_hot,
            "free_tq3": self.free_tq3,
            "padding": self.padding_pages,
        }

    def accounted_bytes(self) -> int:
        return sum(r.total_bytes for r in self.rows().values())

    def as_dict(self) -> dict:
        return {
            "rows": {name: {**asdict(r), "total_bytes": r.total_bytes} for name, r in self.rows().items()},
            "live_tokens": self.live_tokens,
            "live_bytes": self.live_bytes,
            "bytes_per_live_token": self.bytes_per_live_token,
            "allocated_bytes": self.allocated_bytes,
            "accounted_bytes": self.accounted_bytes(),
        }


def hot_page_bytes(store: TieredPageStore) -> PageBytes:
    """One hot page of one layer (K and V); FP8 scales are per layer, so no per-page metadata."""
    s = store.shape
    elem = torch.empty((), dtype=s.hot_store_dtype).element_size()
    return PageBytes(fp8_page_bytes(s.num_kv_heads, s.page_size, s.head_dim) * elem, 0, 0, s.page_size)


def buffer_bytes(store: TieredPageStore) -> int:
    """What the store's buffers occupy, measured on the tensors."""
    tensors = [*store.hot_k, *store.hot_v, *store.tq3]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(store: TieredPageStore) -> MemoryReport:
    pt, s = store.page_table, store.shape
    hot, tq3 = hot_page_bytes(store), tq3_bytes(store.layout)
    mapped = pt.mapped
    is_hot = mapped & (pt.fmt == FMT_HOT)
    # one device read for every count (the radix cache reports after each step with --enable-metrics)
    recent, anchor, stale_hot, mapped_hot, mapped_tq3, live_tokens = torch.stack([
        (is_hot & (pt.tier == TIER_RECENT)).sum(), (is_hot & (pt.tier == TIER_ANCHOR)).sum(),
        (is_hot & (pt.tier == TIER_STALE)).sum(), is_hot.sum(), (mapped & (pt.fmt == FMT_TQ3)).sum(),
        pt.fill.sum(),
    ]).tolist()
    layers = s.num_layers
    tiers = {
        "recent": TierUsage.of(recent, hot, layers),
        "anchor": TierUsage.of(anchor, hot, layers),
        "stale_hot": TierUsage.of(stale_hot, hot, layers),
        "hot_other": TierUsage.of(mapped_hot - recent - anchor - stale_hot, hot, layers),
        "stale": TierUsage.of(mapped_tq3, tq3, layers),
    }
    padding = TierUsage.of(1, hot, layers)
    padding_tq3 = TierUsage.of(1, tq3, layers)
    return MemoryReport(
        tiers=tiers,
        held_hot=TierUsage.of(store.hot_pool.num_held - mapped_hot, hot, layers),
        held_tq3=TierUsage.of(store.tq3_pool.num_held - mapped_tq3, tq3, layers),
        free_hot=TierUsage.of(store.hot_pool.num_free, hot, layers),
        free_tq3=TierUsage.of(store.tq3_pool.num_free, tq3, layers),
        padding_pages=TierUsage(
            2,
            padding.payload_bytes + padding_tq3.payload_bytes,
            padding.metadata_bytes + padding_tq3.metadata_bytes,
            padding.padding_bytes + padding_tq3.padding_bytes,
        ),
        live_tokens=live_tokens,
        allocated_bytes=buffer_bytes(store),
    )
