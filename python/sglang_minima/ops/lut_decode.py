"""Decode for a whole batch with few, large torch ops: the CPU fast path of ``batched_decode``.

The same inputs and the same (out, base-2 LSE) as ``batched_decode.mixed_batch_decode`` (the
reference), up to float rounding (summation order; the key norm, the value scale and zero and the
FP8 scales applied to scores, weights and outputs instead of to every key and value element). What
the reference spends its time on (profiled in docs/results/cpu_decode.md) and what replaces it:

* TQ3 code unpacking (a gather of its word, a shift and a mask per code, by advanced indexing):
  ``codec.packing.key_pair_fields`` / ``value_code_ints`` give a tile's codes in (token, dim) order with
  one 1-D gather of words, one shift and one mask over the whole tile (each triple gets one extra
  word for its spare pair, so every code is adjacent bits of one word).
* key centroids: a key's pair of adjacent dims is one 6-bit field (4-bit keys: one byte), so one
  1-D gather of int64 elements from a 64-entry (256-entry) table of fp32 centroid pairs writes both
  dims; no per-element norm multiply (the fp16 norm correction scales the scores, [tokens] instead
  of [tokens, D]).
* values: ``scale * code + zero`` is never formed: the weights are multiplied by the scale, the
  codes are the GEMM operand, and the zero point adds ``sum(p * zero)`` to the output
  (``lloyd-max`` values: the operand is the codes' centroids, and there is no zero point).
* FP8 pages: the e4m3 table decode writes [page, head, token, dim] at once (no permuted copy for
  the GEMMs); the per-layer scales multiply the query and the output.
* the rotation: q' = R q and out = R^T out' as one small GEMM each (R cached per layer) instead of
  the six-stage FWHT, equal up to rounding; masks only where a page reaches past its request's end.

Pages are still read a tile at a time (no dense copy of the cache) and tiles folded by the
online-softmax merge. ``minima_native`` selects it on CPU (benchmark/ops/bench_cpu_decode.py).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..codec.codebook import Codebook
from ..codec.fp8 import Scale, fp8_dequantize
from ..codec.layout import UNIFORM_VALUES, TQ3PageLayout
from ..codec.packing import key_pair_fields, value_code_ints
from ..codec.tq3 import check_codebook, value_codebook
from ..codec.rotation import LayerRotation
from .batched_decode import PageList, page_tiles, token_visibility
from .dense import LOG2E
from .merge import merge_attention_states
from .scratch import note as note_scratch

DEFAULT_TILE_PAGES = 32
_WORD_BYTES = 4


@lru_cache(maxsize=8)
def _centroid_pairs(centroids: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """int64 [L*L] (L = len(centroids): 8, or 16 for 4-bit keys): the fp32 pair (centroid[f % L],
    centroid[f // L]) of each key pair field f, as one 8-byte element, so a 1-D gather of these writes
    two adjacent dims of a key at once."""
    c = torch.tensor(centroids, dtype=torch.float32)
    levels = c.numel()
    f = torch.arange(levels * levels)
    return torch.stack([c[f % levels], c[f // levels]], dim=1).contiguous().view(torch.int64).view(-1).to(device)


@lru_cache(maxsize=512)
def _rotation_matrices(rotation: LayerRotation, device: torch.device) -> torch.Tensor:
    """fp32 [H, D, D]: R of each kv head (rotate(x)[h] = R[h] @ x[h]), built once per layer."""
    return rotation.matrix().to(device)


def _rotate(x: torch.Tensor, r: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [B, Hq, D] -> R x (or R^T x) per kv head as one batched GEMM; equals LayerRotation's
    transform up to float rounding."""
    b, hq, d = x.shape
    h = r.shape[0]
    y = x.to(torch.float32).view(b, h, hq // h, d)
    return torch.matmul(y, r if inverse else r.transpose(-1, -2)).view(b, hq, d)


def _hot_pages(buffer: torch.Tensor, ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Hot pages ``ids`` of a [slots, H, D] buffer -> fp32 [n, H, P, D], unscaled."""
    _, h, d = buffer.shape
    rows = buffer.view(-1, page_size, h, d).index_select(0, ids).permute(0, 2, 1, 3)
    if buffer.dtype == torch.uint8:
        return fp8_dequantize(rows.to(memory_format=torch.contiguous_format))
    return rows.to(torch.float32, memory_format=torch.contiguous_format)


def _scaled(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    return x if scale is None else x * scale


def _visibility(page_index: torch.Tensor, req: torch.Tensor, kv_lens: torch.Tensor, page_size: int):
    """``token_visibility``, or None when every token of these pages lies before its request's end
    (always for TQ3 pages, which are full): no mask to apply."""
    ends = kv_lens.to(torch.int64).index_select(0, req)
    if bool(((page_index.to(torch.int64) + 1) * page_size <= ends).all()):
        return None
    return token_visibility(page_index, req, kv_lens, page_size)


def _segment_softmax(
    s: torch.Tensor, req: torch.Tensor, visible: torch.Tensor | None, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Base-2 logits s [n, H, G, P] of pages of request ``req`` [n] (``visible`` bool [n, P], None:
    every key) -> (weights p [n, H, G, P],
    per-request max m [B, H, G] (0 where nothing is visible), denominators [B, H, G])."""
    n, h, g, _ = s.shape
    if visible is not None:
        s = s.masked_fill(~visible.view(n, 1, 1, -1), float("-inf"))
    m = torch.full((batch, h, g), float("-inf"), dtype=torch.float32, device=s.device)
    m = m.scatter_reduce(0, req.view(n, 1, 1).expand(n, h, g), s.amax(-1), reduce="amax")
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m.index_select(0, req).unsqueeze(-1))
    denom = torch.zeros_like(m).index_add_(0, req, p.sum(-1))
    return p, m, denom


def _finish(out: torch.Tensor, m: torch.Tensor, denom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-normalized out [B, H, G, Dv] -> (out fp32 [B, Hq, Dv], lse base 2 [B, Hq])."""
    b, h, g, dv = out.shape
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    return out.reshape(b, h * g, dv), (m + torch.log2(denom)).reshape(b, h * g)


def _merge(out, lse, first: bool, tile_out, tile_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one tile's state into the running one (the first tile is the running state)."""
    return (tile_out, tile_lse) if first else merge_attention_states(out, lse, tile_out, tile_lse)


def _empty(b: int, hq: int, dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(b, hq, dv, dtype=torch.float32, device=device)
    return out, torch.full((b, hq), float("-inf"), dtype=torch.float32, device=device)


def lut_hot_batch_decode(
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
    """``batched_decode.hot_batch_decode``: q [B, Hq, D] over each request's hot pages."""
    b, hq, d = q.shape
    h, dv = k_buffer.shape[1], v_buffer.shape[-1]
    g = hq // h
    qs = _scaled(q.to(torch.float32).view(b, h, g, d) * (sm_scale * LOG2E), k_scale)
    out, lse = _empty(b, hq, dv, q.device)
    for req, span in page_tiles(hot, tile_pages):
        ids = hot.pages[span].to(torch.int64)
        k = _hot_pages(k_buffer, ids, page_size)
        s = torch.matmul(qs.index_select(0, req), k.transpose(-1, -2))
        visible = _visibility(hot.page_index[span], req, kv_lens, page_size)
        p, m, denom = _segment_softmax(s, req, visible, b)
        v = _hot_pages(v_buffer, ids, page_size)
        if visible is not None:  # rows past the end may hold anything (the debug poison's NaN): 0 * NaN is NaN
            v.masked_fill_(~visible.view(visible.shape[0], 1, -1, 1), 0.0)
        note_scratch(k, v, s, p)  # one tile's decoded pages and scores
        o = torch.matmul(p, v)  # [n, H, G, Dv]
        del k, v, s  # before the next tile is decoded: scratch is one tile at a time
        acc = torch.zeros(b, h, g, dv, dtype=torch.float32, device=q.device).index_add_(0, req, o)
        out, lse = _merge(out, lse, span.start == 0, *_finish(acc, m, denom))
    return _scaled(out, v_scale), lse


def lut_tq3_batch_decode(
    q_rot: torch.Tensor,
    tq3: PageList,
    kv_lens: torch.Tensor,
    buffer: torch.Tensor,
    layout: TQ3PageLayout,
    codebook: Codebook,
    sm_scale: float,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batched_decode.tq3_batch_decode``: q' = R q [B, Hq, D] (ROTATED) over each request's TQ3
    pages -> (out' fp32 ROTATED, lse base 2)."""
    b, hq, d = q_rot.shape
    h, ps, dev = layout.num_kv_heads, layout.page_size, q_rot.device
    g = hq // h
    check_codebook(codebook, layout, "lut_tq3_batch_decode")
    pairs = _centroid_pairs(tuple(codebook.centroids.tolist()), dev)
    # lloyd-max values decode through their codebook's centroids (uniform ones are the codes themselves)
    v_levels = None if layout.value_code == UNIFORM_VALUES else value_codebook(d, layout.value_bits).centroids.to(dev)
    qs = q_rot.to(torch.float32).view(b, h, g, d) * (sm_scale * LOG2E)
    words = buffer.view(torch.int32)
    k_words, v_words, meta = layout.k_code_bytes // _WORD_BYTES, layout.v_code_bytes // _WORD_BYTES, h * ps
    k0, v0 = layout.k_codes_offset // _WORD_BYTES, layout.v_codes_offset // _WORD_BYTES
    out, lse = _empty(b, hq, d, dev)
    for req, span in page_tiles(tq3, tile_pages):
        n = span.stop - span.start
        pw = words.index_select(0, tq3.pages[span].to(torch.int64))  # [n, page_words]
        fp16 = pw.view(torch.float16)
        k_norm, v_scale = (
            fp16[:, off // 2 : off // 2 + meta].view(n, h, 1, ps).to(torch.float32)
            for off in (layout.k_norm_offset, layout.v_scale_offset)
        )
        fields = key_pair_fields(pw[:, k0 : k0 + k_words].view(n, h, -1), ps, d, layout.key_bits)
        k = pairs.index_select(0, fields.view(-1)).view(torch.float32).view(n * h, ps, d)
        q_req = qs.index_select(0, req).view(n * h, g, d)
        s = torch.bmm(q_req, k.transpose(1, 2)).view(n, h, g, ps) * k_norm
        if layout.key_center:  # the page's mean key, added back: one q . mean per page, head and query
            mean = fp16[:, layout.k_mean_offset // 2 : layout.k_mean_offset // 2 + h * d].to(torch.float32)
            s = s + torch.bmm(q_req, mean.view(n * h, d, 1)).view(n, h, g, 1)
        visible = _visibility(tq3.page_index[span], req, kv_lens, ps)
        p, m, denom = _segment_softmax(s, req, visible, b)
        # values scale * code + zero (uniform) or scale * centroid[code] (lloyd-max): the scale folds
        # into the weights, the zero into their sum
        codes = value_code_ints(pw[:, v0 : v0 + v_words].reshape(n, h, -1), ps, d, layout.value_bits)
        w = (p * v_scale).view(n * h, g, ps)
        if v_levels is None:
            v_zero = fp16[:, layout.v_zero_offset // 2 : layout.v_zero_offset // 2 + meta].view(n, h, 1, ps)
            v = codes.to(torch.float32)
            o = torch.baddbmm((p * v_zero.to(torch.float32)).sum(-1).view(n * h, g, 1), w, v.view(n * h, ps, d))
        else:
            v = v_levels.index_select(0, codes.view(-1).to(torch.int64)).view(codes.shape)
            o = torch.bmm(w, v.view(n * h, ps, d))
        note_scratch(pw, k, v, s, p)  # one tile's page words, decoded keys and values, scores
        acc = torch.zeros(b, h, g, d, dtype=torch.float32, device=dev).index_add_(0, req, o.view(n, h, g, d))
        del pw, k, v, s  # before the next tile is decoded
        out, lse = _merge(out, lse, span.start == 0, *_finish(acc, m, denom))
    return out, lse


def lut_mixed_batch_decode(
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
    """``batched_decode.mixed_batch_decode``: q [B, Hq, D] (original space) over hot + TQ3 pages."""
    ps = layout.page_size
    out, lse = lut_hot_batch_decode(q, hot, kv_lens, ps, hot_k, hot_v, sm_scale, k_scale, v_scale, tile_pages)
    if int(tq3.indptr[-1]):
        r = _rotation_matrices(rotation, q.device)
        out_rot, lse_tq3 = lut_tq3_batch_decode(_rotate(q, r), tq3, kv_lens, tq3_buffer, layout, codebook, sm_scale, tile_pages)
        out, lse = merge_attention_states(out, lse, _rotate(out_rot, r, inverse=True), lse_tq3)
    return out, lse
