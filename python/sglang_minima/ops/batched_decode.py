"""Decode for a whole batch at once: one query per request over per-format CSR page lists (a
ForwardPlan's, layers/attention/forward_plan.py), in a few torch ops per tile of pages (segment
softmax), not one loop per request.

The same (out, base-2 LSE) as the per-request ops in paged.py, up to summation order: each tile
of ``tile_pages`` pages (across requests) is decoded, scored against the query of the request
each page belongs to, reduced per request with scatter ops, and folded into the running state
with merge_attention_states. Scratch is one tile, never the whole cache (noted in ops.scratch). Keys are masked by
position (``page_index * page_size + offset < kv_len``), so partial last pages need no special case.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from ..codec.codebook import Codebook
from ..codec.fp8 import Scale
from ..codec.layout import TQ3PageLayout
from ..codec.rotation import LayerRotation
from ..codec.tq3 import decode_pages
from .dense import LOG2E
from .merge import merge_attention_states
from .paged import dequantize_hot
from .scratch import note as note_scratch

DEFAULT_TILE_PAGES = 64


class PageList(Protocol):
    """One format's pages of a batch, CSR over requests (ForwardPlan.hot / .tq3)."""

    indptr: torch.Tensor  # int32 [B + 1]
    pages: torch.Tensor  # int32 [capacity]: physical page ids
    page_index: torch.Tensor  # int32 [capacity]: page number within the request


def _segment_attend(
    q: torch.Tensor, req: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D]; pages k [n, P, H, D], v [n, P, H, Dv] of request ``req`` [n] (``visible`` bool
    [n, P]) -> (out fp32 [B, Hq, Dv], lse base 2 [B, Hq]); requests with no visible key give (0, -inf).
    Scores are one small GEMM per page against its request's query (no per-token copy of q)."""
    b, hq, d = q.shape
    n, _, h, dv = v.shape
    g = hq // h
    qg = q.to(torch.float32).view(b, h, g, d)[req]  # [n, H, G, D]
    s = torch.einsum("nhgd,nphd->nhgp", qg, k.to(torch.float32)) * (sm_scale * LOG2E)
    s = s.masked_fill(~visible.view(n, 1, 1, -1), float("-inf"))
    idx = req.view(n, 1, 1).expand(n, h, g)
    m = torch.full((b, h, g), float("-inf"), dtype=torch.float32, device=q.device)
    m = m.scatter_reduce(0, idx, s.amax(-1), reduce="amax")
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m[req].unsqueeze(-1))
    note_scratch(qg, s, p)
    denom = torch.zeros_like(m).index_add_(0, req, p.sum(-1))
    out = torch.zeros(b, h, g, dv, dtype=torch.float32, device=q.device)
    out.index_add_(0, req, torch.einsum("nhgp,nphd->nhgd", p, v.to(torch.float32)))
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    return out.view(b, hq, dv), (m + torch.log2(denom)).view(b, hq)


def page_tiles(pages: PageList, tile_pages: int) -> Iterator[tuple[torch.Tensor, slice]]:
    """(request of each entry, entries) per tile of the live CSR entries."""
    live = int(pages.indptr[-1])
    entries = torch.arange(live, device=pages.indptr.device)
    req = torch.searchsorted(pages.indptr[1:].to(torch.int64), entries, right=True)
    for start in range(0, live, tile_pages):
        yield req[start : start + tile_pages], slice(start, min(start + tile_pages, live))


def token_visibility(page_index: torch.Tensor, req: torch.Tensor, kv_lens: torch.Tensor, page_size: int):
    """bool [n, page_size]: the tokens of these pages that lie before their request's end."""
    offs = torch.arange(page_size, device=page_index.device)
    pos = page_index.to(torch.int64).view(-1, 1) * page_size + offs
    return pos < kv_lens.to(torch.int64)[req].view(-1, 1)


def hot_batch_decode(
    q: torch.Tensor,
    hot: PageList,
    kv_lens: torch.Tensor,
    page_size: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    sm_scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] over each request's hot pages (buffers [(pages + 1) * page_size, H, D], physical
    page p at rows p * page_size ..) -> (out fp32 [B, Hq, Dv], lse base 2 [B, Hq])."""
    ps = page_size
    out = torch.zeros(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    h = k_buffer.shape[1]
    k_pages = k_buffer.view(-1, ps, h, k_buffer.shape[-1])
    v_pages = v_buffer.view(-1, ps, h, v_buffer.shape[-1])
    for req, span in page_tiles(hot, tile_pages):
        ids = hot.pages[span].to(torch.int64)
        k, v = dequantize_hot(k_pages[ids], k_scale), dequantize_hot(v_pages[ids], v_scale)
        visible = token_visibility(hot.page_index[span], req, kv_lens, ps)
        # Rows past a request's end hold whatever the page held before (SGLANG_DEBUG_MEMORY_POOL's
        # NaN poison too): their weight is 0, but 0 * NaN is NaN.
        v.masked_fill_(~visible.view(*visible.shape, 1, 1), 0.0)
        note_scratch(k, v, visible)
        tile = _segment_attend(q, req, k, v, visible, sm_scale)
        out, lse = merge_attention_states(out, lse, *tile)
        del k, v, visible  # before the next tile is decoded: scratch is one tile at a time
    return out, lse


def tq3_batch_decode(
    q_rot: torch.Tensor,
    tq3: PageList,
    kv_lens: torch.Tensor,
    buffer: torch.Tensor,
    layout: TQ3PageLayout,
    codebook: Codebook,
    sm_scale: float,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q' = R q [B, Hq, D] (ROTATED) over each request's TQ3 pages -> (out' fp32 ROTATED, lse base 2)."""
    d, ps = layout.head_dim, layout.page_size
    out = torch.zeros(q_rot.shape[0], q_rot.shape[1], d, dtype=torch.float32, device=q_rot.device)
    lse = torch.full(q_rot.shape[:2], float("-inf"), dtype=torch.float32, device=q_rot.device)
    for req, span in page_tiles(tq3, tile_pages):
        k, v = decode_pages(buffer[tq3.pages[span].to(torch.int64)], layout, codebook)  # [n, H, P, D]
        visible = token_visibility(tq3.page_index[span], req, kv_lens, ps)
        note_scratch(k, v, visible)
        tile = _segment_attend(q_rot, req, k.transpose(1, 2), v.transpose(1, 2), visible, sm_scale)
        out, lse = merge_attention_states(out, lse, *tile)
        del k, v, visible  # before the next tile is decoded: scratch is one tile at a time
    return out, lse


def mixed_batch_decode(
    q: torch.Tensor,
    hot: PageList,
    tq3: PageList,
    kv_lens: torch.Tensor,
    hot_k: torch.Tensor,
    hot_v: torch.Tensor,
    tq3_buffer: torch.Tensor,
    layout: TQ3PageLayout,
    codebook: Codebook,
    rotation: LayerRotation,
    sm_scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] (original space) over hot + TQ3 pages -> (out fp32 original space, lse base 2)."""
    out, lse = hot_batch_decode(q, hot, kv_lens, layout.page_size, hot_k, hot_v, sm_scale, k_scale, v_scale, tile_pages)
    if int(tq3.indptr[-1]):
        q_rot = rotation.rotate(q, head_axis=-2)
        out_rot, lse_tq3 = tq3_batch_decode(q_rot, tq3, kv_lens, tq3_buffer, layout, codebook, sm_scale, tile_pages)
        out, lse = merge_attention_states(out, lse, rotation.unrotate(out_rot, head_axis=-2), lse_tq3)
    return out, lse
