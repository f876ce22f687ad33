"""Counters of Minima's page lifecycle and attention routes (cumulative since start)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRESSURE_TIERS = ("stale", "cached", "deferred", "anchor", "recent")
"""What a page the pressure path converts was, in the order it takes them: Stale, held by no live
request, Stale but kept hot until its request's prefill ends (``--minima-defer-prefill-conversion``,
or its observation window, ``--minima-anchor-window``), Anchor, Recent."""


@dataclass
class ConversionStats:
    """One direction of conversion (hot -> TQ3 retier, or TQ3 -> hot promotion)."""

    batches: int = 0
    pages: int = 0
    seconds: float = 0.0
    failed_pages: int = 0
    no_room_pages: int = 0
    """Pages a conversion was asked for that kept their format because the destination pool had no
    free page, counted per ask (by the tick or the pressure path; a page asked again counts again):
    a rate, not a number of pages. For retier: the TQ3 pages are all taken, so Stale pages stay FP8
    and the pool's split, not the policy, sets the mix."""

    def record(self, pages: int, seconds: float) -> None:
        self.batches += 1
        self.pages += pages
        self.seconds += seconds


@dataclass
class MinimaStats:
    retier: ConversionStats = dataclasses.field(default_factory=ConversionStats)
    promote: ConversionStats = dataclasses.field(default_factory=ConversionStats)
    pressure_retier_pages: int = 0
    """Pages converted at allocation time because no hot page was free (included in retier)."""
    pressure_retier_tiers: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(PRESSURE_TIERS, 0))
    """The same pages by what they were when converted (``PRESSURE_TIERS``): Stale ones cost nothing
    the next tick would not have spent; cached ones are read as TQ3 by the prefix hits that come;
    deferred ones are a prompt's pages its own later chunks then read as TQ3; Anchor and Recent ones
    are what the policy meant to keep FP8."""
    allocation_syncs: int = 0
    """Device syncs an allocation waited on (reserve_hot: the pending conversions and the quarantine
    freed at once, and each pressure conversion's publish): host stalls between forwards."""
    route_hot_pages: int = 0
    route_hot_tokens: int = 0
    route_tq3_pages: int = 0
    route_tq3_tokens: int = 0
    fallbacks: int = 0
    """Decode steps the GPU kernels could not serve, attended by the torch path instead."""
    peak_scratch_bytes: int = 0
    """Most transient scratch alive at once in one attention call or one conversion (ops.scratch):
    decoded tiles, scores and conversion staging, beside the cache's own bytes."""
    prefill_hot_deferrals: int = 0
    """Prefill admissions put off to the next step: the request fit the logical pool, but the
    step's hot pages were spent (HotPageBudget)."""
    lifecycle_ticks: int = 0
    """Lifecycle ticks that ran (classification, conversions, promotions between steps)."""
    lifecycle_ticks_deferred: int = 0
    """Steps whose tick would have run but waited for --minima-tick-min-new-pages new pages."""
    prefix_hit_hot_pages: int = 0
    prefix_hit_tq3_pages: int = 0
    window_anchor_pages: int = 0
    """Pages the observation window pinned as Anchors when requests' prefills ended (--minima-anchor-window)."""

    def note_pressure(self, tiers: dict[str, int]) -> None:
        """Pages the pressure path converted, by ``PRESSURE_TIERS`` name."""
        for tier, n in tiers.items():
            self.pressure_retier_tiers[tier] += n
            self.pressure_retier_pages += n

    def note_scratch_bytes(self, nbytes: int) -> None:
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, nbytes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
