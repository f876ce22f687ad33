"""How Minima reaches SGLang 0.5.23: a radix-cache backend, three AROUND hooks, one AFTER hook and one prompt check.

- ``--radix-cache-backend minima`` -> ``MinimaRadixCache`` (through ``create_unified_radix_cache``,
  so Mamba/SWA components keep working);
- ``SRTPlatform.get_kv_pool_cls(kind="mha")`` -> ``MinimaKVPool``: honoured at every construction
  site, including the full-attention pool inside ``HybridLinearKVPool``;
- ``SRTPlatform.get_paged_allocator_cls()`` -> ``MinimaPagedAllocator``;
- ``DefaultPoolConfigurator._compute_cell_size`` -> the blended bytes per token, so SGLang's
  ``max_total_num_tokens`` is the logical capacity;
- ``DefaultPoolConfigurator.__init__`` (AFTER) -> the ``minima`` backend's prefill scratch (one TQ3
  tile, ``prefill_scratch_reserve``) charged in ``_fixed_overhead_bytes``, as SGLang charges its own
  KV-shard scratch, before the rest of the memory becomes tokens.
Neither CPU nor CUDA platforms override the two platform methods, so hooking the base class
reaches both. Every hook is gated at run time on ``minima_selected()``. With ``--enable-metrics``
the radix cache reports the ``sglang:minima_*`` metrics after each step's lifecycle work.

``TokenizerManager._validate_one_request`` (BEFORE, in the HTTP process) refuses with a 400 the
prompts SGLang 0.5.23 passes on and that then kill the scheduler: no tokens (``"text": ""``: a
zero-length extend) and token ids outside the vocabulary (the embedding lookup raises);
docs/results/reliability/bad_input.md.

``sglang.srt.models.utils.enable_fused_set_kv_buffer`` (AROUND) answers False when Minima is
selected: on CUDA with a bf16 pool (``--minima-hot-dtype auto``) some models (Qwen3-MoE, gpt-oss, ...)
would let their RoPE kernel write K/V at the logical ``out_cache_loc`` straight into the pool's
buffers, past Minima's logical-to-hot slot translation; unfused, they call ``set_kv_buffer``.

``plugin.register()`` installs these; like the plugin, this module is wiring: nothing below imports it.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.mem_cache.registry import (
    create_unified_radix_cache,
    get_radix_cache_factory,
    register_radix_cache_backend,
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_parallel, get_server_args

from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.kv_pool import MinimaKVPool
from sglang_minima.mem_cache.radix_cache import MinimaRadixCache
from sglang_minima.mem_cache.tier_store import minima_cell_size, prefill_scratch_reserve
from sglang_minima.reporting.metrics import get_minima_metrics, scheduler_metric_labels
from sglang_minima.selection import MINIMA_BACKEND_NAME, minima_selected, resolve_config

logger = logging.getLogger(__name__)

_PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
_POOL_SIZING = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
_VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_FUSED_KV_WRITE = "sglang.srt.models.utils.enable_fused_set_kv_buffer"
_SCHEDULER_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"

_installed = False


def install_memory_hooks() -> None:
    """Register the radix-cache backend and the hooks; idempotent."""
    global _installed
    if _installed:
        return
    if get_radix_cache_factory(MINIMA_BACKEND_NAME) is None:
        register_radix_cache_backend(MINIMA_BACKEND_NAME, minima_radix_cache_factory)
    HookRegistry.register(f"{_PLATFORM}.get_kv_pool_cls", kv_pool_cls_hook, HookType.AROUND)
    HookRegistry.register(f"{_PLATFORM}.get_paged_allocator_cls", paged_allocator_cls_hook, HookType.AROUND)
    HookRegistry.register(_CELL_SIZE, cell_size_hook, HookType.AROUND)
    HookRegistry.register(_POOL_SIZING, prefill_scratch_hook, HookType.AFTER)
    HookRegistry.register(_VALIDATE_REQUEST, validate_prompt_ids_hook, HookType.BEFORE)
    HookRegistry.register(_FUSED_KV_WRITE, fused_kv_write_hook, HookType.AROUND)
    HookRegistry.register(_SCHEDULER_IDLE, scheduler_idle_hook, HookType.BEFORE)
    _installed = True


def validate_prompt_ids_hook(manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE ``_validate_one_request`` (returns None: the arguments go on unchanged); a ValueError
    here takes SGLang's own 400 path."""
    if not minima_selected() or input_ids is None:
        return
    if any(getattr(obj, f, None) is not None for f in ("input_embeds", "image_data", "video_data", "audio_data")):
        return  # embeddings and multimodal placeholders are not vocabulary ids
    if not isinstance(obj, GenerateReqInput):  # only generation was seen to crash; embeddings keep SGLang's checks
        return
    check_prompt_ids(input_ids, manager.model_config.vocab_size)


def check_prompt_ids(input_ids, vocab_size: int) -> None:
    """Raise ValueError for a prompt with no tokens or with an id outside ``[0, vocab_size)``."""
    if len(input_ids) == 0:
        raise ValueError("The prompt has no tokens: send at least one token (text or input_ids).")
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"The prompt has token id {bad} outside the vocabulary [0, {vocab_size}).")


def fused_kv_write_hook(original_fn, *args, **kwargs) -> bool:
    if minima_selected():
        return False  # every K/V write goes through MinimaKVPool.set_kv_buffer (slot translation)
    return original_fn(*args, **kwargs)


def scheduler_idle_hook(scheduler, *args, **kwargs):
    """BEFORE ``Scheduler.on_idle``: no batch to run, so no step will come to move the release
    quarantine on (an abort, a disconnect or an eviction freed pages between steps) or publish the
    pending conversions: do both now, after a device sync (mem_cache/physical_pool.py); and bring the last CUDA-graph steps' route
    counts into the stats (mem_cache/device_routes.py)."""
    cache = getattr(scheduler, "tree_cache", None)
    if isinstance(cache, MinimaRadixCache):
        cache.store.drain_quarantine()
        cache.store.device_routes.fold(cache.store.stats, wait=True)  # the last CUDA-graph steps' routes


def minima_radix_cache_factory(ctx):
    cache = create_unified_radix_cache(ctx, cache_class=MinimaRadixCache)
    if ctx.params.enable_metrics:
        cache.step_listeners.append(get_minima_metrics(scheduler_metric_labels()).report)
    return cache


def kv_pool_cls_hook(original_fn, platform, *, kind):
    if kind == "mha" and minima_selected():
        return MinimaKVPool
    return original_fn(platform, kind=kind)


def paged_allocator_cls_hook(original_fn, platform):
    if minima_selected():
        return MinimaPagedAllocator
    return original_fn(platform)


def prefill_scratch_hook(result, configurator, kvc, *args, **kwargs) -> None:
    """AFTER ``DefaultPoolConfigurator.__init__``: the extend path's bounded scratch is counted in
    SGLang's memory budget (without it, a pool sized to the last byte leaves a long prefill over
    TQ3 pages to find its tile in the activations' margin)."""
    if not minima_selected() or kvc.use_mla_backend:
        return None
    parallel = get_parallel()
    reserve = prefill_scratch_reserve(
        get_server_args(),
        num_kv_heads=kvc.model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size),
        head_dim=kvc.model_config.head_dim,
        page_size=kvc.page_size,
    )
    if reserve:
        configurator._fixed_overhead_bytes += reserve
        logger.info("Minima: %.1f MiB of the KV budget kept for the prefill's TQ3 tile", reserve / 2**20)
    return None


def cell_size_hook(original_fn, configurator, kvc, num_layers: int) -> int:
    cell = original_fn(configurator, kvc, num_layers)
    if not minima_selected() or kvc.use_mla_backend:
        return cell
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
