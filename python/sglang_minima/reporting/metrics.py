"""Prometheus metrics ``sglang:minima_*``, created in the scheduler process with SGLang's labels.

Gauges use ``multiprocess_mode="mostrecent"`` like SGLang's scheduler gauges; cumulative counts are
Counters fed with the increase since the last update. Names:

- ``sglang:minima_pages{tier}`` and ``sglang:minima_bytes{tier,kind}`` (kind payload/metadata/padding)
  for tier in recent, anchor, stale_hot (Stale pages still FP8), hot_other, stale, held_hot, held_tq3,
  free_hot, free_tq3, padding
- ``sglang:minima_live_tokens``, ``sglang:minima_bytes_per_live_token``
- ``sglang:minima_peak_scratch_bytes``: the most transient scratch one attention call or conversion
  held at once (decoded tiles, scores, staging; ops/scratch.py), beside the cache bytes above
- ``sglang:minima_peak_pages_held{format}``: the most physical pages of a format (hot/tq3) held at once
  since start, quarantined ones included: a workload's need against ``--minima-fp8-page-fraction``'s split
- ``sglang:minima_conversions_total{direction}``, ``sglang:minima_conversion_pages_total{direction}``,
  ``sglang:minima_conversion_seconds_total{direction}``, ``sglang:minima_conversion_failed_pages_total{direction}``,
  ``sglang:minima_conversion_no_room_pages_total{direction}`` (pages asked for and left in their format, no
  free page of the other format, counted per ask: retier rising means the TQ3 side of the split binds)
  (direction retier = hot -> TQ3, promote = TQ3 -> hot), ``sglang:minima_pressure_retier_pages_total{tier}``
  (tier cached, stale, deferred, anchor, recent: what a page converted for want of a free hot page was)
- ``sglang:minima_allocation_syncs_total``: device syncs an allocation waited on (no free hot page: the
  quarantine freed at once, a pressure conversion published at once), host stalls between forwards
- ``sglang:minima_route_pages_total{format}``, ``sglang:minima_route_tokens_total{format}`` (format hot/tq3;
  hot is FP8 e4m3, or the model dtype with ``--minima-hot-dtype auto``)
- ``sglang:minima_fallbacks_total``, ``sglang:minima_prefix_hit_pages_total{format}``
- ``sglang:minima_prefill_hot_deferrals_total``: prefill admissions put off to the next step because
  the step's hot pages were spent (the request fit the logical pool)
- ``sglang:minima_lifecycle_ticks_total{outcome}``: lifecycle ticks between steps that ran, and
  (deferred) those that waited for ``--minima-tick-min-new-pages`` new pages
- ``sglang:minima_window_anchor_pages_total``: pages the observation window kept hot as Anchors when
  requests' prefills ended (``--minima-anchor-window``)
"""

from __future__ import annotations

from typing import Any

from sglang_minima.mem_cache.stats import MinimaStats
from sglang_minima.mem_cache.tier_store import TieredPageStore
from sglang_minima.reporting.memory_report import MemoryReport, memory_report

_metrics: MinimaMetrics | None = None


def scheduler_metric_labels() -> dict[str, Any]:
    """The labels of SGLang's SchedulerMetricsCollector (observability/metrics_collector.py)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_observability, get_parallel, get_serving

    parallel = get_parallel()
    engine_type = (
        "dynamic"
        if get_disagg().enable_pd_role_switch
        else DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode)
    )
    labels: dict[str, Any] = {
        "model_name": get_serving().served_model_name,
        "engine_type": engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(get_observability().extra_metric_labels or {})
    return labels


def get_minima_metrics(labels: dict[str, Any]) -> MinimaMetrics:
    """The process's metrics (a Prometheus name can be registered once per process)."""
    global _metrics
    if _metrics is None:
        _metrics = MinimaMetrics(labels)
    return _metrics


class MinimaMetrics:
    def __init__(self, labels: dict[str, Any]):
        from prometheus_client import Counter, Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"sglang:minima_{name}", doc, labelnames=names + list(extra), multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"sglang:minima_{name}", doc, labelnames=names + list(extra))

        self.pages = gauge("pages", "Physical KV pages per Minima tier or state.", ("tier",))
        self.bytes = gauge("bytes", "KV bytes per Minima tier or state (payload, metadata, padding).", ("tier", "kind"))
        self.live_tokens = gauge("live_tokens", "Tokens held in mapped KV pages.")
        self.bytes_per_live_token = gauge("bytes_per_live_token", "KV bytes of mapped pages per live token.")
        self.peak_scratch_bytes = gauge(
            "peak_scratch_bytes", "Most transient scratch (decoded tiles, scores, staging) alive at once in a step."
        )
        self.peak_pages_held = gauge(
            "peak_pages_held", "Most physical pages of a format held at once since start.", ("format",)
        )
        self.conversions = counter("conversions", "Batched page conversions.", ("direction",))
        self.conversion_pages = counter("conversion_pages", "Pages converted.", ("direction",))
        self.conversion_seconds = counter("conversion_seconds", "Time spent converting pages.", ("direction",))
        self.conversion_failed_pages = counter("conversion_failed_pages", "Pages whose conversion failed.", ("direction",))
        self.conversion_no_room_pages = counter(
            "conversion_no_room_pages", "Pages a conversion left in their format: no free destination page.", ("direction",)
        )
        self.pressure_retier_pages = counter(
            "pressure_retier_pages", "Pages converted because no hot page was free, by what they were.", ("tier",)
        )
        self.allocation_syncs = counter(
            "allocation_syncs", "Device syncs an allocation waited on (the quarantine, a pressure conversion's publish)."
        )
        self.route_pages = counter("route_pages", "Pages attended per format.", ("format",))
        self.route_tokens = counter("route_tokens", "Tokens attended per format.", ("format",))
        self.fallbacks = counter("fallbacks", "Forward steps the GPU kernels handed to the torch path.")
        self.prefix_hit_pages = counter("prefix_hit_pages", "Prefix-cache hit pages by format.", ("format",))
        self.prefill_hot_deferrals = counter(
            "prefill_hot_deferrals", "Prefill admissions put off to the next step: the step's hot pages were spent."
        )
        self.lifecycle_ticks = counter(
            "lifecycle_ticks", "Lifecycle ticks between steps: ran, or deferred for new pages.", ("outcome",)
        )
        self.window_anchor_pages = counter(
            "window_anchor_pages", "Pages the observation window pinned as Anchors when prefills ended."
        )
        self._reported: dict[tuple[int, tuple[str, ...]], float] = {}

    def report(self, store: TieredPageStore) -> None:
        """Update every metric from the store (the radix cache calls this after each step)."""
        store.device_routes.fold(store.stats)  # CUDA-graph steps' routes, without a sync
        self.update(memory_report(store), store.stats)
        for fmt, pool in (("hot", store.hot_pool), ("tq3", store.tq3_pool)):
            self.peak_pages_held.labels(**self.labels, format=fmt).set(pool.peak_held)

    def update(self, report: MemoryReport, stats: MinimaStats) -> None:
        for tier, usage in report.rows().items():
            self.pages.labels(**self.labels, tier=tier).set(usage.pages)
            for kind in ("payload", "metadata", "padding"):
                self.bytes.labels(**self.labels, tier=tier, kind=kind).set(getattr(usage, f"{kind}_bytes"))
        self.live_tokens.labels(**self.labels).set(report.live_tokens)
        self.bytes_per_live_token.labels(**self.labels).set(report.bytes_per_live_token)
        self.peak_scratch_bytes.labels(**self.labels).set(stats.peak_scratch_bytes)
        for direction, conv in (("retier", stats.retier), ("promote", stats.promote)):
            self._advance(self.conversions, conv.batches, direction=direction)
            self._advance(self.conversion_pages, conv.pages, direction=direction)
            self._advance(self.conversion_seconds, conv.seconds, direction=direction)
            self._advance(self.conversion_failed_pages, conv.failed_pages, direction=direction)
            self._advance(self.conversion_no_room_pages, conv.no_room_pages, direction=direction)
        for tier, pages in stats.pressure_retier_tiers.items():
            self._advance(self.pressure_retier_pages, pages, tier=tier)
        self._advance(self.allocation_syncs, stats.allocation_syncs)
        for fmt, pages, tokens, hits in (
            ("hot", stats.route_hot_pages, stats.route_hot_tokens, stats.prefix_hit_hot_pages),
            ("tq3", stats.route_tq3_pages, stats.route_tq3_tokens, stats.prefix_hit_tq3_pages),
        ):
            self._advance(self.route_pages, pages, format=fmt)
            self._advance(self.route_tokens, tokens, format=fmt)
            self._advance(self.prefix_hit_pages, hits, format=fmt)
        self._advance(self.fallbacks, stats.fallbacks)
        self._advance(self.prefill_hot_deferrals, stats.prefill_hot_deferrals)
        self._advance(self.lifecycle_ticks, stats.lifecycle_ticks, outcome="ran")
        self._advance(self.lifecycle_ticks, stats.lifecycle_ticks_deferred, outcome="deferred")
        self._advance(self.window_anchor_pages, stats.window_anchor_pages)

    def _advance(self, counter, total: float, **extra: str) -> None:
        """Counters only go up: add what the cumulative stat gained since the last update."""
        key = (id(counter), tuple(sorted(extra.items())))
        gained = total - self._reported.get(key, 0.0)
        if gained > 0:
            counter.labels(**self.labels, **extra).inc(gained)
            self._reported[key] = total
