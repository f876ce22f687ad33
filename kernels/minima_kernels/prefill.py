"""Extend, chunked prefill and mixed batches over Minima's mixed FP8 / TQ3 cache.

Per request, three disjoint key sets, each attended by all of the request's queries as noted, merged
by LSE (base 2):

- its new tokens, causal, from the forward's own K/V: FlashInfer's ragged prefill, as SGLang's
  flashinfer backend attends an extend's new tokens (so the prompt's own tokens are attended as
  precisely as in SGLang's FP8-KV serving);
- its hot prefix (Recent and Anchor tokens before the new ones), all visible: FlashInfer's paged
  prefill over the FP8 hot buffers with one token per "page" (the physical slots), SGLang's layout
  for its own paged prefill, so both wrappers are the JIT modules SGLang's FP8 arm builds too;
- its TQ3 pages, all visible (a TQ3 page is sealed, so it precedes every query of the request):
  decoded and un-rotated into a bf16 tile by one TileLang launch (``PageConversions.tq3_to_bf16_heads``,
  head-major) and attended by FlashInfer's ragged prefill over that ``HND`` tile. A tile holds up to
  ``tile_tokens`` TQ3 tokens of the batch's requests in order (a request may continue in the next
  tile; the rows of requests without TQ3 pages between them ride along with no keys and are masked
  in the merge), so a layer launches a few kernels per tile, and a batch's tiles are its TQ3 tokens
  over ``tile_tokens``, however many requests hold them (a launch per request and tile before:
  docs/results/device/profile_prefill_1725.md). The scratch is one tile, never the prefix. Head
  dims that are not a power of two (no Hadamard rotation in the kernels) decode with the torch codec in
  the rotated space (``sglang_minima.ops``), request by request.

Each part is merged into the first in place by FlashInfer's ``merge_state_in_place`` (one launch;
rows without a hot prefix masked out), in q's dtype as SGLang's flashinfer backend merges its ragged
and paged parts: the host launches a handful of kernels per layer, which is what a small model's
prefill step costs (docs/results/device/profile_prefill_1525.md). Where that kernel does not launch
(head dims other than 64-512 in powers of two, or more query heads than its block holds: SGLang's
``_safe_merge_state`` guards the same limit) the torch merge does it.

``plan()`` takes the split (``sglang_minima.layers.attention.plan.ExtendPlan``: host index pointers,
device slots and pages) once per forward step and plans the FlashInfer wrappers (no device read);
``run()`` launches one layer's attention. Prefill is eager (SGLang captures no extend graphs here).
"""

from dataclasses import dataclass

import flashinfer
import torch
from sglang_minima.codec.codebook import Codebook
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.ops.host_copy import to_device
from sglang_minima.ops.merge import merge_attention_states
from sglang_minima.ops.paged import Tq3PagedKV, tq3_paged_attention
from sglang_minima.ops.scratch import note as note_scratch

from .heuristics import prefill_tile_pages, prefill_tq3_kernel

TILE_PLAN_BYTES = 1 << 20
"""A tile wrapper's int workspace (device, and as much pinned host memory): its plan's work lists,
a few int32 per 16-row query tile and per query row (FlashInfer's own default, 8 MiB, would be
held once per tile of the largest batch seen)."""
MERGE_HEAD_DIMS = (64, 128, 256, 512)
"""Head dims FlashInfer's merge kernels are built for (cascade.cu's DISPATCH_HEAD_DIM)."""


def fused_merge_fits(num_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether FlashInfer's in-place merge launches for these states: its head dims, and one block of
    (head_dim / vec_size) x num_heads threads within CUDA's 1,024 (cascade.cuh's vec_size choice)."""
    if head_dim not in MERGE_HEAD_DIMS:
        return False
    vec_size = max(16 // dtype.itemsize, head_dim // 32)
    return num_heads * (head_dim // vec_size) <= 1024


@dataclass(frozen=True)
class Tq3Segment:
    """TQ3 pages and the query rows that attend them all: one request's, or consecutive requests'
    that read the same pages (a shared prefix, decoded once)."""

    q_start: int
    q_len: int
    pages: torch.Tensor  # int64 physical TQ3 page ids, on the device


@dataclass(frozen=True)
class _Tq3Tile:
    """TQ3 pages of consecutive requests decoded into one tile, and the ragged prefill planned over it."""

    rows: slice  # query rows from its first request's to its last's
    pages: torch.Tensor  # int32 physical TQ3 page ids on the device, request by request
    wrapper: object  # flashinfer.BatchPrefillWithRaggedKVCacheWrapper, HND
    mask: torch.Tensor | None  # bool [rows]: rows of requests with pages here (None: all of them)


class MinimaPrefillWrapper:
    """FlashInfer over the new tokens and the FP8 hot prefix, the TQ3 prefix in decoded tiles, merged
    by LSE in place.

    One object per layer geometry (query heads, KV heads, head dim, page size, scale, query dtype);
    ``workspace`` is FlashInfer's float workspace (shared with the decode: a forward is one or the other).
    ``tq3_kernel``: decode the TQ3 prefix with the TileLang kernel (default: on CUDA, power-of-two head
    dims) or with the torch codec; ``tile_tokens``: TQ3 tokens per tile (default: the decoder's);
    ``key_bits``: the TQ3 pages' key code width, 3 or 4, and ``key_center``: page-centered keys (the
    kernel's build).
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        sm_scale: float,
        q_dtype: torch.dtype = torch.bfloat16,
        tile_tokens: int | None = None,
        tq3_kernel: bool | None = None,
        key_bits: int = 3,
        key_center: bool = False,
    ):
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if q_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the prefill takes bf16 or fp16 queries, got {q_dtype}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.sm_scale, self.q_dtype = page_size, float(sm_scale), q_dtype
        self._fused_merge = fused_merge_fits(num_qo_heads, head_dim, q_dtype)
        # the TQ3 prefix's decoder (``tq3_kernel``, None: where it applies): the kernel, built now
        # rather than inside a forward, or the torch codec
        if tq3_kernel is None:
            tq3_kernel = prefill_tq3_kernel(workspace.device.type, head_dim)
        self._dequant = None
        if tq3_kernel:
            from .convert import PageConversions  # (tilelang: the CPU stand-in tests import this module without it)

            self._dequant = PageConversions(num_kv_heads, page_size, head_dim, key_bits, key_center)
            _ = self._dequant.dequant_kernel
        self.tile_pages = prefill_tile_pages(page_size, kernel=self._dequant is not None, tile_tokens=tile_tokens)
        # SGLang's choices on Hopper (flashinfer_backend.py): ragged "auto", paged "fa2"
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
        self._paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self._workspace = workspace
        self._tile_wrappers: list = []  # one ragged wrapper per tile of a step (each holds its plan)
        self._has_prefix = False
        self._prefix_rows: torch.Tensor | None = None
        self._tq3: tuple[Tq3Segment, ...] = ()
        self._num_tokens = 0

    def plan(
        self,
        qo_indptr: torch.Tensor,
        prefix_indptr: torch.Tensor,
        prefix_slots: torch.Tensor,
        prefix_rows: torch.Tensor | None,
        tq3: tuple[Tq3Segment, ...],
    ) -> None:
        """Index pointers int32 [B + 1] on the host (queries, hot prefix tokens per request);
        ``prefix_slots`` int32 on the device (the prefix tokens' physical hot slots); ``prefix_rows``
        bool [T] (rows whose request has a hot prefix, None: all or none do)."""
        if qo_indptr.device.type != "cpu" or prefix_indptr.device.type != "cpu":
            raise ValueError("plan() takes the index pointers on the host (a device read per step otherwise)")
        h, hk, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        self._num_tokens = int(qo_indptr[-1])
        self._ragged.plan(
            qo_indptr, qo_indptr, h, hk, d, causal=True, sm_scale=self.sm_scale, q_data_type=self.q_dtype,
        )
        self._has_prefix = int(prefix_indptr[-1]) > 0
        if self._has_prefix:
            batch = qo_indptr.numel() - 1
            self._paged.plan(
                qo_indptr, prefix_indptr, prefix_slots, torch.ones(batch, dtype=torch.int32), h, hk, d, 1,
                causal=False, sm_scale=self.sm_scale, q_data_type=self.q_dtype,
                kv_data_type=torch.float8_e4m3fn,
            )
        self._prefix_rows = prefix_rows
        self._tq3 = tuple(tq3)
        self._tq3_tiles = self._plan_tq3_tiles() if self._dequant is not None and self._tq3 else ()

    def _plan_tq3_tiles(self) -> tuple[_Tq3Tile, ...]:
        """The kernel path's tiles: the segments' pages in request order, cut every ``tile_pages``
        pages. Rows between two segments of a tile (requests without TQ3 pages) are one more ragged
        request with no keys, whose output FlashInfer leaves undefined: the tile's mask keeps them out
        of the merge. Page counts are shapes: no device read."""
        tiles, run, taken = [], [], 0  # run: (segment, first page, end page) of the tile being filled

        def close() -> None:
            nonlocal run, taken
            qo, kv, keep = [0], [0], []
            for seg, a, b in run:  # a segment cut across tiles appears in each, with its pages there
                gap = seg.q_start - (run[0][0].q_start + qo[-1])
                if gap:  # the rows of requests without TQ3 pages since the last segment
                    qo.append(qo[-1] + gap)
                    kv.append(kv[-1])
                    keep += [False] * gap
                qo.append(qo[-1] + seg.q_len)
                kv.append(kv[-1] + (b - a) * self.page_size)
                keep += [True] * seg.q_len
            wrapper = self._tile_wrapper(len(tiles))
            wrapper.plan(
                torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), self.num_qo_heads,
                self.num_kv_heads, self.head_dim, causal=False, sm_scale=self.sm_scale,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
            )
            device = run[0][0].pages.device
            pages = torch.cat([seg.pages[a:b] for seg, a, b in run]).to(torch.int32)
            mask = None if all(keep) else to_device(keep, torch.bool, device)
            tiles.append(_Tq3Tile(slice(run[0][0].q_start, run[0][0].q_start + qo[-1]), pages, wrapper, mask))
            run, taken = [], 0

        for seg in self._tq3:
            n, a = seg.pages.numel(), 0
            while a < n:
                b = min(n, a + self.tile_pages - taken)
                run.append((seg, a, b))
                taken += b - a
                a = b
                if taken == self.tile_pages:
                    close()
        if run:
            close()
        return tuple(tiles)

    def _tile_wrapper(self, i: int):
        """The ``i``-th tile's ragged wrapper (each keeps its plan), made on first use with a small
        int workspace (``TILE_PLAN_BYTES``) beside the shared float one."""
        while len(self._tile_wrappers) <= i:
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "HND", backend="fa2")
            w.reset_workspace_buffer(
                self._workspace, torch.empty(TILE_PLAN_BYTES, dtype=torch.uint8, device=self._workspace.device)
            )
            self._tile_wrappers.append(w)
        return self._tile_wrappers[i]

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hot_kv_cache: tuple[torch.Tensor, torch.Tensor],
        tq3_buffer: torch.Tensor,
        layout: TQ3PageLayout,
        codebook: Codebook,
        rotation: LayerRotation,
        *,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], the new tokens' k, v [T, H, D] (q's dtype), the FP8 hot buffers (e4m3,
        ``[slots, 1, H, D]``) and the layer's TQ3 pages -> out [T, Hq, D] in q's dtype."""
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} rows, the plan {self._num_tokens}")
        q = q.to(self.q_dtype).contiguous()
        # k, v: views of the forward's QKV (rows strided): FlashInfer reads them by their strides
        out, lse = self._ragged.run(q, k.to(self.q_dtype), v.to(self.q_dtype), return_lse=True)
        if self._has_prefix:
            out_p, lse_p = self._paged.run(q, hot_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
            # a request without a hot prefix: an empty state, whatever the kernel wrote (masked out)
            self._merge(out, lse, out_p, lse_p, mask=self._prefix_rows)
        if not self._tq3:
            return out
        with torch.profiler.record_function("minima.prefill_tq3"):
            if self._dequant is not None:
                self._attend_tq3_tiles(q, out, lse, tq3_buffer, rotation)
            else:
                for seg in self._tq3:
                    rows = slice(seg.q_start, seg.q_start + seg.q_len)
                    kv = Tq3PagedKV(tq3_buffer, seg.pages, layout, codebook)
                    out_rot, lse_t = tq3_paged_attention(
                        rotation.rotate(q[rows], head_axis=-2), kv, self.sm_scale, tile_pages=self.tile_pages, flash=True
                    )
                    o_t = rotation.unrotate(out_rot, head_axis=-2).to(out.dtype).contiguous()
                    self._merge(out[rows], lse[rows], o_t, lse_t.to(torch.float32).contiguous())
        return out

    def _attend_tq3_tiles(self, q, out, lse, tq3_buffer, rotation: LayerRotation) -> None:
        """The TQ3 prefix a tile at a time: the tile's pages decoded and un-rotated into bf16 by one
        launch, attended by its requests' queries through the tile's ragged prefill (head-major keys,
        the tile's first tokens by their strides), merged into (out, lse) in place."""
        h, d, p = self.num_kv_heads, self.head_dim, self.page_size
        longest = max(tile.pages.numel() for tile in self._tq3_tiles)
        k_tile = torch.empty(h, longest * p, d, dtype=torch.bfloat16, device=q.device)
        v_tile = torch.empty_like(k_tile)
        note_scratch(k_tile, v_tile)
        for tile in self._tq3_tiles:
            self._dequant.tq3_to_bf16_heads(tq3_buffer, tile.pages, k_tile, v_tile, rotation.signs)
            n = tile.pages.numel() * p
            q_t = q[tile.rows].to(k_tile.dtype)  # (an fp16 model's queries meet the bf16 tile as bf16)
            o_t, lse_t = tile.wrapper.run(q_t, k_tile[:, :n], v_tile[:, :n], return_lse=True)
            # (the merge takes one dtype; rows without keys here are masked out)
            self._merge(out[tile.rows], lse[tile.rows], o_t.to(out.dtype), lse_t, mask=tile.mask)

    def _merge(self, out, lse, o, lse_o, mask=None) -> None:
        """(out, lse) <- their LSE merge with (o, lse_o), in place, where ``mask`` (bool [T]) is set
        (all rows: None). FlashInfer's kernel where it launches, else the torch merge."""
        if self._fused_merge:
            flashinfer.merge_state_in_place(out, lse, o, lse_o, mask=mask)
            return
        merged, merged_lse = merge_attention_states(out, lse, o, lse_o)
        if mask is not None:
            merged = torch.where(mask.view(-1, 1, 1), merged, out.to(merged.dtype))
            merged_lse = torch.where(mask.view(-1, 1), merged_lse, lse)
        out.copy_(merged)
        lse.copy_(merged_lse)
