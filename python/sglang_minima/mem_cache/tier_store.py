"""TieredPageStore: the physical side of Minima-KV, with no SGLang import.

It owns the page table, the two physical pools with their reference counts and release
quarantines, the step count, the hot (FP8) and TQ3 buffers of every layer, and the conversions
between the two formats (the torch codec; on CUDA, the TileLang kernels: kernel_conversions.py).
``MinimaKVPool`` wraps one store inside SGLang; tests drive a store directly.

Ownership (see README.md): SGLang owns logical pages (request rows, tree, locks). A logical page
mapped here holds one reference on its physical page; conversions add their own. A page whose last
reference goes waits in its pool's quarantine until no forward in flight can read it.

Conversions run on the conversion stream (conversion_stream.py; on CUDA a side stream) and stay
pending until their copy is done: the sources stay mapped (forwards keep reading the old format),
the destinations are allocated but not mapped. ``publish_conversions`` (each tick, and with a wait
wherever the store needs the result now: ``drain_quarantine``) then maps the destinations and drops
the sources. A logical page SGLang frees meanwhile is not mapped again: its destination goes back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from minima_kernels.heuristics import prefill_scratch_bytes, prefill_tq3_kernel  # pure Python: no tilelang, no GPU

from sglang_minima.codec.codebook import Codebook, key_codebook
from sglang_minima.codec.fp8 import fp8_requantize
from sglang_minima.codec.layout import (
    CHUNK_TOKENS, HEAD_DIM_MULTIPLE, TQ3PageLayout, head_dim_fits, page_size_fits,
)
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages, to_original_space
from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.conversion_stream import ConversionStream, conversion_stream_for
from sglang_minima.mem_cache.device_routes import DeviceRouteCounter
from sglang_minima.mem_cache.kernel_conversions import KernelConversions, kernel_conversions
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, PageTable
from sglang_minima.mem_cache.physical_pool import PhysicalPagePool
from sglang_minima.mem_cache.stats import ConversionStats, MinimaStats
from sglang_minima.ops import scratch
from sglang_minima.selection import MINIMA_BACKEND

logger = logging.getLogger(__name__)


def check_page_size(page_size: int) -> None:
    """Refuse a page size that TQ3 pages cannot hold, naming the flag (docs/TQ3P.md, constraints)."""
    if not page_size_fits(page_size):
        raise ValueError(
            f"Minima-KV needs --page-size to be a multiple of {CHUNK_TOKENS}: a TQ3 page holds whole "
            f"{CHUNK_TOKENS}-token tensor-core tiles; got --page-size {page_size}"
        )


def check_head_dim(head_dim: int) -> None:
    """Refuse a model whose head_dim TQ3 pages cannot hold, naming the model's value."""
    if not head_dim_fits(head_dim):
        raise ValueError(
            f"Minima-KV needs the model's head_dim to be a multiple of {HEAD_DIM_MULTIPLE}: TQ3 packs each "
            f"head's codes in 96-bit triples of 16 code pairs per lane; this model has head_dim={head_dim}"
        )


def check_geometry(page_size: int, head_dim: int) -> None:
    check_page_size(page_size)
    check_head_dim(head_dim)


def config_layout(config: MinimaConfig, num_kv_heads: int, page_size: int, head_dim: int) -> TQ3PageLayout:
    """The TQ3 page layout the ``--minima-*`` flags give a model of this geometry (code widths,
    page-centered keys, value code)."""
    return TQ3PageLayout(
        num_kv_heads, page_size, head_dim, config.key_bits, config.key_center, config.value_code, config.value_bits
    )


def minima_cell_size(
    config: MinimaConfig, *, num_kv_heads: int, head_dim: int, num_layers: int, page_size: int, model_dtype_bytes: int
) -> int:
    """Bytes per logical token, all layers, K+V, metadata and page padding included:
    fraction * hot + (1 - fraction) * TQ3 (``config_layout``'s pages), rounded up. SGLang sizes the pool with this first, so an
    unsupported geometry is refused here, before any allocation."""
    check_geometry(page_size, head_dim)
    hot = 2 * num_kv_heads * head_dim * (1 if config.hot_dtype == "fp8_e4m3" else model_dtype_bytes)
    tq3 = config_layout(config, num_kv_heads, page_size, head_dim).page_bytes / page_size
    fraction = 1.0 if config.disable_stale else config.fp8_page_fraction
    return math.ceil(num_layers * (fraction * hot + (1.0 - fraction) * tq3))


def prefill_scratch_reserve(server_args, *, num_kv_heads: int, head_dim: int, page_size: int) -> int:
    """``extend_scratch_reserve`` for the backend SGLang runs extend batches on: the prefill backend
    where one is set."""
    backend = server_args.prefill_attention_backend or server_args.attention_backend
    return extend_scratch_reserve(backend, server_args.device, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  page_size=page_size)


def extend_scratch_reserve(backend: str, device: str, *, num_kv_heads: int, head_dim: int, page_size: int) -> int:
    """Bytes the pool's sizing sets aside for the extend path's transient scratch where extend
    batches run on ``backend``: on CUDA with ``minima``, one TQ3 tile of K and V decoded for the
    prefill (``minima_kernels.heuristics``; the kernel's tile where the head dim has the kernels'
    rotation, the torch codec's otherwise), which ``sglang:minima_peak_scratch_bytes`` meters. Nothing
    for ``minima_native``: its torch ops attend tiles of a few pages (``ops.paged``), no larger than
    the activations SGLang leaves room for."""
    if backend != MINIMA_BACKEND or device != "cuda":
        return 0
    kernel = prefill_tq3_kernel(device, head_dim)
    return prefill_scratch_bytes(num_kv_heads, head_dim, page_size, kernel=kernel)


@dataclass(frozen=True)
class StoreShape:
    """What a store holds: logical capacity, the FP8/TQ3 split, the layers, and the TQ3 page layout,
    which carries the KV geometry (KV heads, page size, head dim) and the code options."""

    num_logical_pages: int
    num_hot_pages: int
    num_layers: int
    hot_dtype: torch.dtype
    """Logical dtype of hot pages: torch.float8_e4m3fn, or the model dtype."""
    layout: TQ3PageLayout
    """The TQ3 pages' bytes (``config_layout`` for the ``--minima-*`` flags; it refuses a geometry
    TQ3 pages cannot hold)."""

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_kv_heads(self) -> int:
        return self.layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    @property
    def num_tq3_pages(self) -> int:
        return self.num_logical_pages - self.num_hot_pages

    @property
    def hot_store_dtype(self) -> torch.dtype:
        """FP8 is stored as uint8 bit patterns, as SGLang does (index_put has no fp8 kernel)."""
        return torch.uint8 if self.hot_dtype == torch.float8_e4m3fn else self.hot_dtype


@dataclass
class PendingConversion:
    """A conversion whose copy was launched and is not published yet; it holds one reference on
    each source and on each destination (allocated, not mapped)."""

    id: int
    pages: torch.Tensor  # logical pages, on the device
    pages_host: torch.Tensor  # the same, int64 on the host
    src: torch.Tensor  # source physical pages, int64 on the device (the copy reads them until done)
    dst: torch.Tensor  # destination physical pages, int64 on the host
    dst_ids: torch.Tensor  # the same on the device
    src_pool: PhysicalPagePool
    dst_pool: PhysicalPagePool
    dst_fmt: int
    stats: ConversionStats
    seconds: float  # host time of the launch
    handle: object  # the conversion stream's


def split_pages(num_logical_pages: int, fp8_page_fraction: float) -> int:
    """FP8 physical pages for a logical capacity: round(fraction * L), at least 1."""
    return min(num_logical_pages, max(1, round(fp8_page_fraction * num_logical_pages)))


class TieredPageStore:
    def __init__(
        self,
        shape: StoreShape,
        *,
        device: torch.device | str = "cpu",
        rotation_seed: int = 0,
        first_layer_id: int = 0,
        conversion_kernels: bool = True,
        conversion_stream: ConversionStream | None = None,
        debug_poison: bool | None = None,
    ):
        self.shape = shape
        self.page_size = shape.page_size
        self.layout = shape.layout
        self.device = torch.device(device)
        self.page_table = PageTable(shape.num_logical_pages, shape.page_size, self.device, shape.num_hot_pages)
        # SGLang's memory-pool debug switch: a page back on a free list is filled with NaN bytes, so a
        # forward that still reads it (a use after free) shows NaN.
        if debug_poison is None:
            debug_poison = os.environ.get("SGLANG_DEBUG_MEMORY_POOL", "").lower() in ("1", "true", "yes")
        self.hot_pool = PhysicalPagePool(shape.num_hot_pages, "hot", self._poison_hot if debug_poison else None)
        self.tq3_pool = PhysicalPagePool(shape.num_tq3_pages, "tq3", self._poison_tq3 if debug_poison else None)
        self.epoch = 0  # scheduler steps ended (end_step)
        self.version = 0  # mapping changes (map, unmap, conversions): LifecycleController.settled reads it
        self.mapped_pages = 0  # logical pages mapped since start: the allocations the tick's conversions keep pace with
        self.stats = MinimaStats()
        self.window_ends: dict[int, int] = {}  # anchor_window: req_pool_idx -> where its last window ended
        self.device_routes = DeviceRouteCounter(self.device)  # what CUDA-graph steps read (counted in the graph)
        rows = (shape.num_hot_pages + 1) * shape.page_size
        hot = shape.hot_store_dtype
        self.hot_k = [self._zeros((rows, shape.num_kv_heads, shape.head_dim), hot) for _ in range(shape.num_layers)]
        self.hot_v = [self._zeros((rows, shape.num_kv_heads, shape.head_dim), hot) for _ in range(shape.num_layers)]
        self.tq3 = [
            self._zeros((shape.num_tq3_pages + 1, self.layout.page_bytes), torch.uint8)
            for _ in range(shape.num_layers)
        ]
        self.k_scales = [1.0] * shape.num_layers
        self.v_scales = [1.0] * shape.num_layers
        self.rotations = [
            LayerRotation(shape.num_kv_heads, shape.head_dim, first_layer_id + i, rotation_seed, self.device)
            for i in range(shape.num_layers)
        ]
        self.codebook: Codebook = key_codebook(shape.head_dim, self.layout.key_bits).to(self.device)
        # On CUDA the TileLang kernels convert (one launch per layer, the codec's bytes, 3- or 4-bit
        # keys); else the torch codec.
        self.kernels: KernelConversions | None = kernel_conversions(self) if conversion_kernels else None
        self.conversion_stream = conversion_stream if conversion_stream is not None else conversion_stream_for(self.device)
        self.pending: list[PendingConversion] = []  # launch order
        # Host: the pending conversion (its id) each logical page is in, 0 for none; unmap clears it.
        self.converting = torch.zeros(shape.num_logical_pages + 1, dtype=torch.int64)
        self._conversion_ids = 0

    def _zeros(self, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=self.device)

    @property
    def step(self) -> int:
        return self.epoch

    @property
    def num_quarantined(self) -> int:
        """Physical pages of both formats freed but not yet back on their free lists."""
        return self.hot_pool.num_quarantined + self.tq3_pool.num_quarantined

    @property
    def conversions_pending(self) -> bool:
        return bool(self.pending)

    def held_by_conversions(self, pool: PhysicalPagePool, *, live_destinations: bool = True) -> int:
        """Pages of ``pool`` only pending conversions hold: destinations not published yet, and the
        sources of logical pages SGLang freed meanwhile (both become free or quarantined at publish;
        a live page's destination becomes its mapping: ``live_destinations=False`` leaves those out)."""
        def freed(conv) -> int:  # its logical pages SGLang freed meanwhile
            return int((self.converting[conv.pages_host] != conv.id).sum())

        n = 0
        for conv in self.pending:
            if conv.dst_pool is pool:
                n += conv.dst.numel() if live_destinations else freed(conv)
            if conv.src_pool is pool:
                n += freed(conv)
        return n

    @property
    def is_fp8(self) -> bool:
        return self.shape.hot_dtype == torch.float8_e4m3fn

    # ---------------------------------------------------------------- logical lifecycle

    def map_new(self, pages: torch.Tensor) -> None:
        """Back newly allocated logical pages with hot pages (the caller reserved them)."""
        if pages.numel() == 0:
            return
        phys = self.hot_pool.alloc(pages.numel())
        if phys is None:
            raise RuntimeError(
                f"no free hot page for {pages.numel()} new logical pages ({self.hot_pool.num_free} free)"
            )
        self.page_table.map(pages.to(self.device), FMT_HOT, phys.to(self.device), self.step)
        self.version += 1
        self.mapped_pages += pages.numel()

    def unmap(self, pages: torch.Tensor) -> None:
        """SGLang freed these logical pages: drop each one's mapping reference."""
        pages = pages.to(self.device)
        fmt = self.page_table.fmt[pages]
        phys = self.page_table.phys[pages]
        if bool((phys == 0).any()):
            raise RuntimeError("free of a logical page that is not mapped (double free)")
        if self.pending:
            self.converting[pages.cpu()] = 0  # their pending conversions will not map them again
        self.hot_pool.release(phys[fmt == FMT_HOT])
        self.tq3_pool.release(phys[fmt == FMT_TQ3])
        self.page_table.unmap(pages)
        self.version += 1

    def reset(self) -> None:
        """Every logical page was freed at once (SGLang's allocator clear)."""
        for conv in self.pending:  # no copy may still write a page the pools hand out again
            self.conversion_stream.wait(conv.handle)
        self.pending = []
        self.converting.zero_()
        self.hot_pool.reset()
        self.tq3_pool.reset()
        self.page_table.unmap(torch.arange(self.page_table.num_logical_pages + 1, device=self.device))
        self.version += 1

    def reference_mismatches(self) -> int:
        """Physical pages whose reference count is not what their owners hold: the logical page
        mapping it (1) and each pending conversion copying from or into it (1), or whose place on
        the free list or in the quarantine disagrees with a count of 0. 0 between steps."""
        pt = self.page_table
        mapped = pt.mapped
        wrong = 0
        for pool, fmt in ((self.hot_pool, FMT_HOT), (self.tq3_pool, FMT_TQ3)):
            owners = [pt.phys[mapped & (pt.fmt == fmt)].to("cpu", torch.int64)]
            owners += [conv.src.cpu() for conv in self.pending if conv.src_pool is pool]
            owners += [conv.dst for conv in self.pending if conv.dst_pool is pool]
            wrong += pool.mismatches(torch.bincount(torch.cat(owners), minlength=pool.num_pages + 1))
        return wrong

    # ---------------------------------------------------------------- routes and scores

    def note_read(self, logical_pages: torch.Tensor, *, hot_tokens: int = 0, tq3_tokens: int = 0) -> None:
        """Count a forward's routes: the pages (by format) and tokens it reads. No reference is
        taken: the pools' quarantine keeps a freed page until the forward in flight is done."""
        hot, tq3 = self.page_table.format_counts(logical_pages.to(device=self.device, dtype=torch.int64)).tolist()
        self.stats.route_hot_pages += hot
        self.stats.route_tq3_pages += tq3
        self.stats.route_hot_tokens += hot_tokens
        self.stats.route_tq3_tokens += tq3_tokens

    def note_page_scores(self, logical_pages: torch.Tensor, mass: torch.Tensor, decay: float) -> None:
        """The page score (docs/ARCHITECTURE.md, Tiers): s <- decay * s + (1 - decay) * m / sum(m) over
        all pages, once per step, with m the pages' attention mass (layers/attention/page_mass.py)."""
        total = float(mass.sum())
        score = self.page_table.score
        score.mul_(decay)
        if total > 0:
            pages = logical_pages.to(device=self.device, dtype=torch.int64)
            score.index_add_(0, pages, (1.0 - decay) * mass.to(self.device, torch.float32) / total)

    def note_window_mass(self, logical_pages: torch.Tensor, mass: torch.Tensor, ends: dict[int, int]) -> None:
        """The attention mass of an observation window over the pages it read (``anchor_window``): the
        latest window's mass replaces the last (the controller pins a request's Anchors from it when the
        request's prefill ends). ``ends``: ``req_pool_idx`` -> the sequence length the window ends at,
        a host fact kept in ``window_ends`` (the caller drops a request's entry when it is released)."""
        pages = logical_pages.to(device=self.device, dtype=torch.int64)
        self.page_table.window_mass[pages] = mass.to(self.device, torch.float32)
        self.window_ends.update(ends)

    def end_step(self) -> None:
        """A step's result is processed (once per scheduler step): the quarantines move on."""
        self.hot_pool.end_step()
        self.tq3_pool.end_step()
        self.epoch += 1

    def drain_quarantine(self) -> bool:
        """Publish every pending conversion and free every quarantined page now (their sources
        included): waits for the device, so no copy runs and no forward can read them. Whether it
        had to (anything in flight)."""
        if not (self.num_quarantined or self.pending):
            return False
        torch.get_device_module(self.device).synchronize()
        self.publish_conversions(wait=True)
        self.hot_pool.drain()
        self.tq3_pool.drain()
        return True

    # ---------------------------------------------------------------- conversions

    def hot_convertible(self) -> torch.Tensor:
        """bool [n]: sealed hot pages (full, immutable, not the page being written)."""
        pt = self.page_table
        return pt.sealed & (pt.fmt == FMT_HOT)

    def _not_converting(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages`` less those a pending conversion already converts."""
        if not self.pending:
            return pages
        return pages[(self.converting[pages.cpu()] == 0).to(self.device)]

    def retier(self, pages: torch.Tensor) -> int:
        """FP8 -> TQ3 for sealed hot logical pages, one batched encode per layer; returns pages
        converted (launched: on a side stream they publish once their copy is done)."""
        pages = pages.to(device=self.device, dtype=torch.int64)
        pages = self._not_converting(pages[self.hot_convertible()[pages]])
        copy = self.kernels.encode if self.kernels is not None else self._per_layer(self._encode_layer)
        return self._convert(pages, self.hot_pool, self.tq3_pool, FMT_TQ3, copy, self.stats.retier)

    def promote(self, pages: torch.Tensor) -> int:
        """TQ3 -> FP8 for mapped TQ3 logical pages (decode, un-rotate, re-quantize); returns pages promoted."""
        pages = pages.to(device=self.device, dtype=torch.int64)
        pt = self.page_table
        pages = self._not_converting(pages[pt.mapped[pages] & (pt.fmt[pages] == FMT_TQ3)])
        copy = self.kernels.decode if self.kernels is not None else self._per_layer(self._decode_layer)
        return self._convert(pages, self.tq3_pool, self.hot_pool, FMT_HOT, copy, self.stats.promote)

    def _per_layer(self, copy_layer: Callable[[int, torch.Tensor, torch.Tensor], None]):
        def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
            for layer in range(self.shape.num_layers):
                copy_layer(layer, src, dst)

        return copy

    def _convert(
        self,
        pages: torch.Tensor,
        src_pool: PhysicalPagePool,
        dst_pool: PhysicalPagePool,
        dst_fmt: int,
        copy: Callable[[torch.Tensor, torch.Tensor], None],
        stats: ConversionStats,
    ) -> int:
        """Copy before publish: retain the sources, allocate the destinations and launch their
        copy (every layer) on the conversion stream; ``_publish`` maps them once it is done. A
        failure to launch leaves every page where it was."""
        asked = int(pages.numel())
        pages = pages[: dst_pool.num_free]
        n = int(pages.numel())
        stats.no_room_pages += asked - n
        if n == 0:
            return 0
        start = time.perf_counter()
        src = self.page_table.phys[pages].to(torch.int64)
        src_pool.retain(src)
        dst = dst_pool.alloc(n)
        dst_ids = dst.to(self.device)
        pages_host = pages.cpu()  # before the launch: a device read after it would wait for the copy's inputs
        try:
            with scratch.measure() as meter:
                handle = self.conversion_stream.launch(lambda: copy(src, dst_ids))
            self.stats.note_scratch_bytes(meter.peak_bytes)
        except Exception:
            logger.exception("Minima: converting %d pages to format %d failed; they keep their format", n, dst_fmt)
            dst_pool.release(dst, unread=True)  # never published: no forward read them
            src_pool.release(src)  # the conversion's reference; the mapping keeps each page
            stats.failed_pages += n
            return 0
        self._conversion_ids += 1
        self.converting[pages_host] = self._conversion_ids
        self.pending.append(PendingConversion(
            self._conversion_ids, pages, pages_host, src, dst, dst_ids, src_pool, dst_pool, dst_fmt, stats,
            time.perf_counter() - start, handle,
        ))
        self.publish_conversions()  # where the copy ran at once (the host), it publishes now
        return n

    def publish_conversions(self, *, wait: bool = False) -> None:
        """Publish the pending conversions whose copy is done (with ``wait``: all, waiting for them;
        only between forwards). The page-table writes go on the current stream."""
        waiting = []
        for conv in self.pending:
            if wait:
                self.conversion_stream.wait(conv.handle)
            elif not self.conversion_stream.done(conv.handle):
                waiting.append(conv)
                continue
            self._publish(conv)
        self.pending = waiting

    def _publish(self, conv: PendingConversion) -> None:
        live = self.converting[conv.pages_host] == conv.id  # False: SGLang freed the page meanwhile
        self.converting[conv.pages_host[live]] = 0
        keep = live.to(self.device)
        self.page_table.publish(conv.pages[keep], conv.dst_fmt, conv.dst_ids[keep])
        self.version += 1
        conv.src_pool.release(conv.src[keep])  # the live pages' mappings moved to dst
        conv.src_pool.release(conv.src)  # the conversion is done
        conv.dst_pool.release(conv.dst[~live], unread=True)  # never mapped: no forward read them
        conv.stats.record(int(live.sum()), conv.seconds)

    def _poison_hot(self, pages: list[int]) -> None:
        rows = (torch.tensor(pages, device=self.device)[:, None] * self.page_size
                + torch.arange(self.page_size, device=self.device)).flatten()
        for buf in self.hot_k + self.hot_v:
            buf.view(torch.uint8)[rows] = 0xFF  # NaN in e4m3fn, bf16, fp16 and fp32 alike

    def _poison_tq3(self, pages: list[int]) -> None:
        idx = torch.tensor(pages, device=self.device)
        for buf in self.tq3:
            buf[idx] = 0xFF  # the fp16 norms and scales read NaN

    def _encode_layer(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        k, v = self._hot_pages(layer, src)
        k_scale, v_scale = (self.k_scales[layer], self.v_scales[layer]) if self.is_fp8 else (None, None)
        pages = encode_pages(k, v, self.layout, self.rotations[layer], self.codebook, k_scale=k_scale, v_scale=v_scale)
        scratch.note(k, v, pages)  # staging: the gathered hot pages and their encoding
        self.tq3[layer][dst] = pages

    def _decode_layer(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        k_rot, v_rot = decode_pages(self.tq3[layer][src], self.layout, self.codebook)
        rotation = self.rotations[layer]
        k, v = to_original_space(k_rot, rotation), to_original_space(v_rot, rotation)
        scratch.note(k_rot, v_rot, k, v)  # staging: the decoded pages, rotated and original space
        self._store_hot_pages(layer, dst, k, v)

    def _hot_pages(self, layer: int, phys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hot pages of one layer as [N, H, P, D] (store dtype)."""
        s = self.shape
        idx = phys.to(self.device)
        k = self.hot_k[layer].view(s.num_hot_pages + 1, s.page_size, s.num_kv_heads, s.head_dim)[idx]
        v = self.hot_v[layer].view(s.num_hot_pages + 1, s.page_size, s.num_kv_heads, s.head_dim)[idx]
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)

    def _store_hot_pages(self, layer: int, phys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write [N, H, P, D] decoded float pages into hot pages (a promotion: ``fp8_requantize``, the
        promotion kernel's bytes)."""
        s = self.shape
        idx = phys.to(self.device)
        for buf, x, scale in ((self.hot_k, k, self.k_scales), (self.hot_v, v, self.v_scales)):
            x = x.permute(0, 2, 1, 3)
            stored = fp8_requantize(x, scale[layer]) if self.is_fp8 else x.to(s.hot_dtype)
            buf[layer].view(s.num_hot_pages + 1, s.page_size, s.num_kv_heads, s.head_dim)[idx] = stored
