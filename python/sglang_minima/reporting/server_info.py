"""The ``minima`` section of /server_info (the plugin's AFTER hook on get_internal_state calls this)."""

from __future__ import annotations

from typing import Any

from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.tier_store import prefill_scratch_reserve
from sglang_minima.reporting.memory_report import memory_report


def minima_server_info(scheduler) -> dict[str, Any]:
    """Pages and bytes per tier, the reference-count check, lifecycle and route counters (the peak
    transient scratch among them, apart from the cache's bytes, beside the scratch the pool's sizing
    kept for the prefill) of this scheduler's Minima pool."""
    allocator = scheduler.token_to_kv_pool_allocator
    if not isinstance(allocator, MinimaPagedAllocator):
        return {"active": False}
    store = allocator.kv_pool.store
    store.device_routes.fold(store.stats, wait=True)  # every CUDA-graph step's routes, exactly
    shape = store.shape
    reserve = prefill_scratch_reserve(
        scheduler.server_args, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=shape.page_size
    )
    return {
        "active": True,
        "pool": {
            "logical_pages": shape.num_logical_pages,
            "hot_pages": shape.num_hot_pages,
            "tq3_pages": shape.num_tq3_pages,
            "page_size": shape.page_size,
            "num_layers": shape.num_layers,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "hot_dtype": str(shape.hot_dtype).removeprefix("torch."),
            "tq3_key_bits": store.layout.key_bits,
            "tq3_key_center": store.layout.key_center,
            "tq3_value_code": store.layout.value_code,
            "tq3_value_bits": store.layout.value_bits,
            "tq3_page_bytes_per_layer": store.layout.page_bytes,
            "quarantined_pages": store.num_quarantined,
            # the most pages of each format held at once since start: the workload's need of each
            "peak_hot_pages_held": store.hot_pool.peak_held,
            "peak_tq3_pages_held": store.tq3_pool.peak_held,
            "step": store.step,
            "prefill_scratch_reserve_bytes": reserve,
        },
        "memory": memory_report(store).as_dict(),
        "references": {"mismatched_pages": store.reference_mismatches()},
        "stats": store.stats.as_dict(),
    }
