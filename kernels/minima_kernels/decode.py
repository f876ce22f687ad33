"""Mixed FP8 / TQ3 paged decode: FlashInfer over the FP8 pages, TileLang over the TQ3 pages, one
LSE merge. ``plan()`` does the host-side work once per batch shape (page lists to the device, split
count, output buffers, kernel selection); ``run()`` only launches device work, so it can be captured
in a CUDA graph with the planned buffers.

Per request, the FP8 pages (Recent + Anchor) and the TQ3 pages (Stale) are two disjoint sets of the
request's KV; attention is order-free, so each set is attended on its own, giving (out, lse) in base 2,
and the two states are merged with ``flashinfer.merge_state`` (also base 2). The TQ3 part runs in the
rotated space: q' = R q before, out = R^T out' after (two small batched matmuls).
"""

import math
from dataclasses import dataclass

import flashinfer
import torch
from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.layout import TQ3PageLayout

from .tq3_decode import CODE_ROW_BYTES, tile_config, tq3_decode_kernel, tq3_merge_splits

NUM_SMS_H200 = 132
CTAS_PER_SM = 2  # tile_config builds the TQ3 kernel for 2 resident CTAs per SM
MIN_PAGES_PER_SPLIT = 2


def key_centroids_fp16(head_dim: int) -> tuple[float, ...]:
    """The TQ3 key codebook rounded to fp16 (the kernel's GEMM operand precision)."""
    return tuple(float(c) for c in tq3_codebook(head_dim).centroids.to(torch.float16).float())


def choose_num_splits(batch: int, num_kv_heads: int, max_pages: int, num_sms: int = NUM_SMS_H200) -> int:
    """Splits per (request, kv head) so that batch * kv_heads * splits fills the SMs about twice,
    with at least MIN_PAGES_PER_SPLIT pages per split."""
    ctas = batch * num_kv_heads
    want = math.ceil(CTAS_PER_SM * num_sms / ctas)
    return max(1, min(want, max_pages // MIN_PAGES_PER_SPLIT))


def pool_views(pages: torch.Tensor, layout: TQ3PageLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided views of a TQ3 pool [num_pages, page_bytes] uint8 that the decode kernel reads as tiles:
    k_codes, v_codes [num_pages, H, P*3D/512, 64] uint8 and meta [num_pages, 3, H, P] fp16."""
    n, pb = pages.shape[0], layout.page_bytes
    rows = layout.page_size * layout.code_bytes_per_token // CODE_ROW_BYTES
    shape = (n, layout.num_kv_heads, rows, CODE_ROW_BYTES)
    strides = (pb, rows * CODE_ROW_BYTES, CODE_ROW_BYTES, 1)
    k_codes = pages.as_strided(shape, strides, pages.storage_offset() + layout.k_codes_offset)
    v_codes = pages.as_strided(shape, strides, pages.storage_offset() + layout.v_codes_offset)
    halves = pages.view(torch.float16)
    meta = halves.as_strided(
        (n, 3, layout.num_kv_heads, layout.page_size),
        (pb // 2, layout.num_kv_heads * layout.page_size, layout.page_size, 1),
        halves.storage_offset() + layout.k_norm_offset // 2,
    )
    return k_codes, v_codes, meta


@dataclass
class TQ3Plan:
    """Device-side state of the TQ3 part of one plan (page lists, split buffers)."""

    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    num_splits: int
    out_partial: torch.Tensor
    lse_partial: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class MinimaDecodeWrapper:
    """Decode attention over a mixed FP8 / TQ3 paged KV cache (one layer per ``run``).

    FP8 pages: ``(k_cache, v_cache)`` each ``[num_fp8_pages, page_size, H, D]`` e4m3 (SGLang's
    ``[slots, H, D]`` buffers viewed per page), per-layer scales. TQ3 pages: ``[num_tq3_pages,
    page_bytes]`` uint8 TQ3P blocks. Rotation: ``[H, D, D]`` fp32, ``R[h] @ k`` = the codec's rotate.
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        sm_scale: float | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        fp8_page_size: int | None = None,
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.page_size = page_size
        self.fp8_page_size = page_size if fp8_page_size is None else fp8_page_size
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.q_dtype = q_dtype
        self.layout = TQ3PageLayout(num_kv_heads, page_size, head_dim)
        self.device = workspace.device
        self._fp8 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self._tq3_kernel = tq3_decode_kernel(
            num_kv_heads,
            self.group_size,
            head_dim,
            page_size,
            self.sm_scale,
            key_centroids_fp16(head_dim),
            **tile_config(self.group_size, page_size),
        )
        self._merge_kernel = tq3_merge_splits(num_qo_heads, head_dim)
        self._has_fp8 = self._has_tq3 = False
        self.tq3_plan: TQ3Plan | None = None

    def plan(
        self,
        fp8_indptr: torch.Tensor,
        fp8_page_ids: torch.Tensor,
        fp8_last_page_len: torch.Tensor,
        tq3_indptr: torch.Tensor,
        tq3_page_ids: torch.Tensor,
    ) -> None:
        """Page lists per request (CSR, int32, host tensors): FP8 pages with the fill of each
        request's last FP8 page, and TQ3 pages (always full). A request may have no pages of one
        format; every request must have at least one page in total."""
        batch = fp8_indptr.numel() - 1
        if tq3_indptr.numel() - 1 != batch:
            raise ValueError(f"fp8_indptr has {batch} requests, tq3_indptr {tq3_indptr.numel() - 1}")
        fp8_counts = fp8_indptr[1:] - fp8_indptr[:-1]
        tq3_counts = tq3_indptr[1:] - tq3_indptr[:-1]
        if bool(((fp8_counts + tq3_counts) == 0).any()):
            raise ValueError("every request needs at least one FP8 or TQ3 page")
        self._batch = batch
        self._has_fp8 = int(fp8_indptr[-1]) > 0
        self._has_tq3 = int(tq3_indptr[-1]) > 0
        dev = self.device
        if self._has_fp8:
            self._fp8.plan(
                fp8_indptr.to(dev, torch.int32),
                fp8_page_ids.to(dev, torch.int32),
                fp8_last_page_len.to(dev, torch.int32),
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.fp8_page_size,
                q_data_type=self.q_dtype,
                kv_data_type=torch.float8_e4m3fn,
                sm_scale=self.sm_scale,
            )
        self.tq3_plan = None
        if self._has_tq3:
            splits = choose_num_splits(batch, self.num_kv_heads, int(tq3_counts.max()))
            hq, d = self.num_qo_heads, self.head_dim
            f32 = {"device": dev, "dtype": torch.float32}
            self.tq3_plan = TQ3Plan(
                page_indptr=tq3_indptr.to(dev, torch.int32),
                page_ids=tq3_page_ids.to(dev, torch.int32),
                num_splits=splits,
                out_partial=torch.empty(batch, hq, splits, d, **f32),
                lse_partial=torch.empty(batch, hq, splits, **f32),
                out=torch.empty(batch, hq, d, **f32),
                lse=torch.empty(batch, hq, **f32),
            )

    def run_tq3(self, q_rot: torch.Tensor, tq3_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TQ3 part alone, rotated space: q_rot [B, Hq, D] fp16 -> (out' fp32 [B, Hq, D], lse [B, Hq])."""
        p = self.tq3_plan
        k_codes, v_codes, meta = pool_views(tq3_pages, self.layout)
        self._tq3_kernel(q_rot, k_codes, v_codes, meta, p.page_indptr, p.page_ids, p.out_partial, p.lse_partial)
        if p.num_splits == 1:
            return p.out_partial.view(p.out.shape), p.lse_partial.view(p.lse.shape)
        self._merge_kernel(p.out_partial, p.lse_partial, p.out, p.lse)
        return p.out, p.lse

    def run(
        self,
        q: torch.Tensor,
        fp8_kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        tq3_pages: torch.Tensor | None,
        rotation: torch.Tensor,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, D] (q_dtype) -> (out [B, Hq, D] q_dtype, lse [B, Hq] fp32, base 2)."""
        b, hq, d = q.shape
        h, g = self.num_kv_heads, self.group_size
        parts = []
        if self._has_fp8:
            out, lse = self._fp8.run(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
            parts.append((out, lse))
        if self._has_tq3:
            # q'[b, h, g] = R[h] q[b, h, g]; rows: x R^T
            q_heads = q.view(b, h, g, d).permute(1, 0, 2, 3).reshape(h, b * g, d).float()
            q_rot = torch.bmm(q_heads, rotation.transpose(1, 2)).view(h, b, g, d).permute(1, 0, 2, 3)
            out_rot, lse = self.run_tq3(q_rot.reshape(b, hq, d).to(torch.float16), tq3_pages)
            # out = R^T out'; rows: x R
            o_heads = out_rot.view(b, h, g, d).permute(1, 0, 2, 3).reshape(h, b * g, d)
            out = torch.bmm(o_heads, rotation).view(h, b, g, d).permute(1, 0, 2, 3).reshape(b, hq, d)
            parts.append((out.to(q.dtype), lse))
        if len(parts) == 1:
            return parts[0]
        (out_a, lse_a), (out_b, lse_b) = parts
        return flashinfer.merge_state(out_a, lse_a, out_b, lse_b)
