"""sglang:minima_* Prometheus metrics: SGLang's labels, gauges per tier, counters that only grow."""

from __future__ import annotations

import torch
from prometheus_client import REGISTRY

from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.reporting.memory_report import memory_report
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
    assert _sample("sglang:minima_dense_shadow_bytes") == 0
