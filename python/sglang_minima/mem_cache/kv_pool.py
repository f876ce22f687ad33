"""MinimaKVPool: SGLang's MHA KV pool with Minima's tiered physical storage behind logical slots.

SGLang (allocator, radix tree, ``req_to_token``) keeps addressing *logical* slots. This pool owns a
``TieredPageStore``: a page table logical page -> (format, physical page), an FP8 region of
``num_hot_pages`` pages and a TQ3 region of the rest. ``k_buffer`` / ``v_buffer`` are the hot
region, so SGLang's own write path stores new tokens there after ``set_kv_buffer`` translated their
slots; new tokens always land on hot pages.

Read interface for attention backends (stable):

- ``page_size``, ``layout`` (TQ3PageLayout), ``codebook`` (codec Codebook)
- ``page_table.fmt`` int8 [num_logical_pages + 1] (FMT_HOT = 0, FMT_TQ3 = 1) and
  ``page_table.phys`` int32 [num_logical_pages + 1], indexed by logical page ``slot // page_size``
  (logical page 0 is SGLang's padding page)
- ``hot_k_buffer(layer_id)`` / ``hot_v_buffer(layer_id)``: [(num_hot_pages + 1) * page_size, H, D],
  uint8 holding e4m3 bits (``hot_dtype=fp8_e4m3``) or the model dtype; physical page 0 is padding;
  ``k_scale(layer_id)`` / ``v_scale(layer_id)``: the per-layer FP8 scales (floats)
- ``tq3_buffer(layer_id)``: uint8 [num_tq3_pages + 1, layout.page_bytes]; ``rotation(layer_id)``
- ``hot_slots(logical_slots)``: physical hot slots of logical slots on hot pages
- ``note_read(logical_pages, hot_tokens=, tq3_tokens=)`` once per forward with every page it reads
  (holds them until the forward is done, counts routes); ``note_page_scores(logical_pages, mass)``
  once per step with each page's attention mass summed over layers, heads and queries;
  ``note_window_mass(logical_pages, mass, ends)`` likewise for the last queries of each request in an
  extend step (``anchor_window``), with each request's sequence length after it by ``req_pool_idx``;
  ``note_fallback()`` once per decode step the GPU kernels hand to the torch path;
  ``note_scratch_bytes(n)`` with the scratch high-water mark of an attention call (ops.scratch)
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from sglang_minima.codec.codebook import Codebook
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.mem_cache.page_table import PageTable
from sglang_minima.mem_cache.stats import MinimaStats
from sglang_minima.mem_cache.tier_store import (
    StoreShape,
    TieredPageStore,
    check_head_dim,
    check_page_size,
    config_layout,
    split_pages,
)
from sglang_minima.selection import resolve_config

logger = logging.getLogger(__name__)


class MinimaKVPool(MHATokenToKVPool):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, *args, **kwargs):
        if kwargs.get("quant_method") is not None or kwargs.get("post_capture_active"):
            raise ValueError("Minima-KV does not combine with a KV quant recipe or post-capture KV backing")
        check_page_size(page_size)  # before SGLang allocates anything; head_dim in _create_buffers
        self.minima_config: MinimaConfig = resolve_config()
        hot_dtype = torch.float8_e4m3fn if self.minima_config.hot_dtype == "fp8_e4m3" else dtype
        self._write_slots: tuple | None = None  # set_kv_buffer's (logical slots, their versions, hot slots)
        self._write_prepared = False  # the backend translated them at its plan (prepare_write)
        super().__init__(size, page_size, hot_dtype, *args, **kwargs)

    def _create_buffers(self) -> None:
        if self.v_head_dim != self.head_dim or self.kv_cache_layout != "nhd":
            raise ValueError(
                f"Minima-KV needs equal K/V head dims and the NHD layout, got "
                f"{self.head_dim}/{self.v_head_dim}, {self.kv_cache_layout}"
            )
        check_head_dim(self.head_dim)
        cfg = self.minima_config
        num_logical = self.size // self.page_size
        num_hot = num_logical if cfg.disable_stale else split_pages(num_logical, cfg.fp8_page_fraction)
        shape = StoreShape(
            num_logical_pages=num_logical,
            num_hot_pages=num_hot,
            num_layers=self.layer_num,
            hot_dtype=self.dtype,
            layout=config_layout(cfg, self.head_num, self.page_size, self.head_dim),
        )
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.store = TieredPageStore(
                shape,
                device=self.device,
                rotation_seed=cfg.rotation_seed,
                first_layer_id=self.start_layer,
            )
        # The pool owns the lifecycle: the allocator (pressure) and the radix cache (steps) use this one.
        self.lifecycle = LifecycleController(self.store, cfg)
        self.k_buffer, self.v_buffer = self.store.hot_k, self.store.hot_v
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        # Slot-row transfer descriptors (PD, VMM backing) assume one buffer row per logical slot.
        self._kv_buffer_descs = ()
        self._init_data_ptrs_and_strides()

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Allocated bytes, K side and V side: hot buffers plus each side's share of the TQ3 pages."""
        layout, n = self.layout, self.store.shape.num_tq3_pages + 1
        hot = self.store.hot_k[0].numel() * self.store.hot_k[0].element_size() if self.layer_num else 0
        k_tq3 = layout.k_code_bytes + layout.meta_bytes + layout.k_mean_bytes
        v_tq3 = layout.page_bytes - k_tq3
        return self.layer_num * (hot + n * k_tq3), self.layer_num * (hot + n * v_tq3)

    def set_kv_buffer(
        self,
        layer,
        loc_info,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        layer_id_override: Optional[int] = None,
        dcp_kv_mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Write new tokens of logical slots ``loc`` into their hot pages."""
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local = self.local_layer(layer_id)
        if k_scale is not None:
            self.store.k_scales[local] = float(k_scale)
        if v_scale is not None:
            self.store.v_scales[local] = float(v_scale)
        with torch.profiler.record_function("minima.kv_write"):
            # One translation per forward: every layer writes the same slots and the mapping does not
            # change within a forward (it would bump the store's version). Keyed on the slots' memory,
            # not the tensor object: SGLang's breakable prefill graphs hand each layer a fresh slice of
            # one buffer (attention_input_scope; a translation per layer on the H200, 2026-12-03). The
            # version counter, shared by every view of a buffer, catches it refilled in place; the
            # cache holds the tensor, so its memory is not reused. The first layer translates (a
            # forward that ended before its last write, an error, leaves nothing behind for the next
            # one) unless the backend did at its plan (``prepare_write``): then every layer writes the
            # plan's translation, whatever view of the step's slots it is handed (a breakable prefill
            # graph's layers get the graph's copy of them), and none reads the page table.
            cached, key = self._write_slots, self._write_key(loc)
            planned = self._write_prepared and cached is not None and cached[0].numel() == loc.numel()
            if not planned and (cached is None or local == 0 or cached[1] != key):
                if self._write_prepared:  # a layer writing other slots than its plan translated
                    logger.warning("minima: a layer writes %d slots, its plan translated %d: translated again",
                                   loc.numel(), cached[0].numel() if cached is not None else 0)
                    self._write_prepared = False
                cached = self._write_slots = (loc, key, self.store.page_table.hot_slots(loc))
            super().set_kv_buffer(layer, cached[2], cache_k, cache_v, k_scale, v_scale, layer_id_override, dcp_kv_mask)
            if local == self.layer_num - 1:
                self._write_slots = None  # the forward's last write: nothing keeps its slots alive
                self._write_prepared = False
                # After the last layer's write, in the forward's stream order: a page reads as
                # sealed (convertible) only once every layer of its tokens is written, so a
                # conversion between steps never encodes a page a forward still in flight (the
                # overlap scheduler's next batch) has written in its first layers only. The fill
                # of the physical pages written: see PageTable.hot_fill.
                self.store.page_table.note_written(cached[2])

    def _write_key(self, loc: torch.Tensor) -> tuple:
        return (self.store.version, loc.data_ptr(), loc.shape, loc.stride(), loc.dtype, loc._version)

    def prepare_write(self, loc: torch.Tensor | None) -> None:
        """Translate the forward's write slots now, at the backend's plan (None: this forward's layers
        translate them): a backend that declares its scheduler-shared reads done there
        (``MinimaAttnBackend``: an extend's plan, a captured decode's in-graph metadata) reads the page
        table no later, so a logical page SGLang frees and maps again while the forward runs is
        written at the physical page it had."""
        self._write_prepared = loc is not None
        self._write_slots = None if loc is None else (loc, self._write_key(loc), self.store.page_table.hot_slots(loc))

    # ---------------------------------------------------------------- read interface

    def local_layer(self, layer_id: int) -> int:
        """The store's index of a model layer (a pipeline stage's pool starts at ``start_layer``)."""
        return layer_id - self.start_layer

    @property
    def page_table(self) -> PageTable:
        return self.store.page_table

    @property
    def layout(self) -> TQ3PageLayout:
        return self.store.layout

    @property
    def codebook(self) -> Codebook:
        return self.store.codebook

    @property
    def stats(self) -> MinimaStats:
        return self.store.stats

    @property
    def holds_tq3_pages(self) -> bool:
        """Whether any TQ3 page is mapped, converting or quarantined (host bookkeeping, no device
        read): False means no logical page can be TQ3 now, nor until the next conversion starts."""
        return self.store.tq3_pool.num_held > 0

    def hot_k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.store.hot_k[self.local_layer(layer_id)]

    def hot_v_buffer(self, layer_id: int) -> torch.Tensor:
        return self.store.hot_v[self.local_layer(layer_id)]

    def k_scale(self, layer_id: int) -> float:
        return self.store.k_scales[self.local_layer(layer_id)]

    def v_scale(self, layer_id: int) -> float:
        return self.store.v_scales[self.local_layer(layer_id)]

    def tq3_buffer(self, layer_id: int) -> torch.Tensor:
        return self.store.tq3[self.local_layer(layer_id)]

    def rotation(self, layer_id: int) -> LayerRotation:
        return self.store.rotations[self.local_layer(layer_id)]

    def hot_slots(self, logical_slots: torch.Tensor) -> torch.Tensor:
        return self.store.page_table.hot_slots(logical_slots)

    def note_read(self, logical_pages: torch.Tensor, *, hot_tokens: int = 0, tq3_tokens: int = 0) -> None:
        self.store.note_read(logical_pages, hot_tokens=hot_tokens, tq3_tokens=tq3_tokens)

    def note_read_on_device(self, logical_pages: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """``note_read`` counted on the device, with no host read (mem_cache/device_routes.py): the
        captured decode steps, and the extend steps the GPU backend plans on the device."""
        self.store.device_routes.count(self.store.page_table, logical_pages, tokens, rows)

    def note_device_step(self) -> None:
        """A step that counts on the device was launched (a graph replay, a device-planned extend)."""
        self.store.device_routes.mark_step()

    def note_page_scores(self, logical_pages: torch.Tensor, mass: torch.Tensor) -> None:
        self.store.note_page_scores(logical_pages, mass, self.minima_config.score_ewma)

    def note_window_mass(self, logical_pages: torch.Tensor, mass: torch.Tensor, ends: dict[int, int]) -> None:
        self.store.note_window_mass(logical_pages, mass, ends)

    def note_fallback(self, n: int = 1) -> None:
        self.store.stats.fallbacks += n

    def note_scratch_bytes(self, nbytes: int) -> None:
        self.store.stats.note_scratch_bytes(nbytes)
