"""How Minima's memory side reaches SGLang 0.5.23: a radix-cache backend and three AROUND hooks.

- ``--radix-cache-backend minima`` -> ``MinimaRadixCache`` (through ``create_unified_radix_cache``,
  so Mamba/SWA components keep working);
- ``SRTPlatform.get_kv_pool_cls(kind="mha")`` -> ``MinimaKVPool``: honoured at every construction
  site, including the full-attention pool inside ``HybridLinearKVPool``;
- ``SRTPlatform.get_paged_allocator_cls()`` -> ``MinimaPagedAllocator``;
- ``DefaultPoolConfigurator._compute_cell_size`` -> the blended bytes per token, so SGLang's
  ``max_total_num_tokens`` is the logical capacity.
Neither CPU nor CUDA platforms override the two platform methods, so hooking the base class
reaches both. Every hook is gated at run time on ``minima_selected()``.
"""

from __future__ import annotations

import math

from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.config import MinimaConfig
from sglang_minima.plugin import MINIMA_BACKEND_NAME, minima_selected, resolve_config

_PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"

_installed = False


def install_memory_hooks() -> None:
    """Register the radix-cache backend and the hooks; idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if get_radix_cache_factory(MINIMA_BACKEND_NAME) is None:
        register_radix_cache_backend(MINIMA_BACKEND_NAME, minima_radix_cache_factory)
    HookRegistry.register(f"{_PLATFORM}.get_kv_pool_cls", kv_pool_cls_hook, HookType.AROUND)
    HookRegistry.register(f"{_PLATFORM}.get_paged_allocator_cls", paged_allocator_cls_hook, HookType.AROUND)
    HookRegistry.register(_CELL_SIZE, cell_size_hook, HookType.AROUND)
    _installed = True


def minima_radix_cache_factory(ctx):
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from sglang_minima.mem_cache.radix_cache import MinimaRadixCache

    return create_unified_radix_cache(ctx, cache_class=MinimaRadixCache)


def kv_pool_cls_hook(original_fn, platform, *, kind):
    if kind == "mha" and minima_selected():
        from sglang_minima.mem_cache.kv_pool import MinimaKVPool

        return MinimaKVPool
    return original_fn(platform, kind=kind)


def paged_allocator_cls_hook(original_fn, platform):
    if minima_selected():
        from sglang_minima.mem_cache.allocator import MinimaPagedAllocator

        return MinimaPagedAllocator
    return original_fn(platform)


def cell_size_hook(original_fn, configurator, kvc, num_layers: int) -> int:
    cell = original_fn(configurator, kvc, num_layers)
    if not minima_selected() or kvc.use_mla_backend:
        return cell
    import torch
    from sglang.srt.runtime_context import get_parallel

    model_config = kvc.model_config
    parallel = get_parallel()
    return minima_cell_size(
        resolve_config(),
        num_kv_heads=model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size),
        head_dim=model_config.head_dim,
        num_layers=num_layers,
        page_size=kvc.page_size,
        model_dtype_bytes=torch._utils._element_size(kvc.kv_cache_dtype),
    )


def minima_cell_size(
    config: MinimaConfig, *, num_kv_heads: int, head_dim: int, num_layers: int, page_size: int, model_dtype_bytes: int
) -> int:
    """Bytes per logical token, all layers, K+V, metadata and page padding included:
    fraction * hot + (1 - fraction) * TQ3, rounded up. SGLang sizes the pool with this first, so an
    unsupported geometry is refused here, before any allocation."""
    from sglang_minima.mem_cache.tier_store import check_geometry

    check_geometry(page_size, head_dim)
    hot = 2 * num_kv_heads * head_dim * (1 if config.hot_dtype == "fp8_e4m3" else model_dtype_bytes)
    tq3 = TQ3PageLayout(num_kv_heads, page_size, head_dim).page_bytes / page_size
    fraction = 1.0 if config.disable_stale else config.fp8_page_fraction
    return math.ceil(num_layers * (fraction * hot + (1.0 - fraction) * tq3))
