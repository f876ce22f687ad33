"""ops.batched_decode (the whole batch per tile of pages) against ops.paged (one request at a time)."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.fp8 import fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import encode_pages
from sglang_minima.layers.attention.forward_plan import plan_forward
from sglang_minima.layers.attention.plan import plan_batch
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.batched_decode import hot_batch_decode, mixed_batch_decode, tq3_batch_decode
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention

PS, HKV, HQ, D = 16, 2, 6, 64
K_SCALE, V_SCALE = 0.5, 0.25


def _pool(kv_lens: list[int], stale: float, seed: int):
    """A page table and FP8 + TQ3 buffers for one layer: request i on its own logical pages, each page
    TQ3 with probability ``stale`` unless it is the request's partial last page."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PS) for n in kv_lens]
    total = sum(pages)
    fmt = torch.zeros(total + 1, dtype=torch.int8)
    phys = torch.zeros(total + 1, dtype=torch.int32)
    req_to_token = torch.zeros(len(kv_lens), max(pages) * PS, dtype=torch.int32)
    layout, codebook = TQ3PageLayout(HKV, PS, D), tq3_codebook(D)
    rotation = LayerRotation(HKV, D, 0, 0)
    hot_k = torch.zeros((total + 1) * PS, HKV, D, dtype=torch.uint8)
    hot_v = torch.zeros_like(hot_k)
    tq3 = torch.zeros(total + 1, layout.page_bytes, dtype=torch.uint8)
    lp, n_hot, n_tq3 = 1, 0, 0
    for row, (n, kv) in enumerate(zip(pages, kv_lens)):
        for j in range(n):
            req_to_token[row, j * PS : (j + 1) * PS] = torch.arange(lp * PS, (lp + 1) * PS)
            k = torch.randn(PS, HKV, D, generator=g) * 2
            v = torch.randn(PS, HKV, D, generator=g)
            partial = j == n - 1 and kv % PS
            if not partial and float(torch.rand((), generator=g)) < stale:
                n_tq3 += 1
                fmt[lp], phys[lp] = FMT_TQ3, n_tq3
                kq, vq = fp8_quantize(k, K_SCALE), fp8_quantize(v, V_SCALE)
                tq3[n_tq3] = encode_pages(kq.permute(1, 0, 2)[None], vq.permute(1, 0, 2)[None], layout, rotation,
                                          codebook, k_scale=K_SCALE, v_scale=V_SCALE)[0]
            else:
                n_hot += 1
                fmt[lp], phys[lp] = FMT_HOT, n_hot
                hot_k[n_hot * PS : (n_hot + 1) * PS] = fp8_quantize(k, K_SCALE)
                hot_v[n_hot * PS : (n_hot + 1) * PS] = fp8_quantize(v, V_SCALE)
            lp += 1
    return req_to_token, fmt, phys, hot_k, hot_v, tq3, layout, codebook, rotation


@pytest.mark.parametrize("kv_lens, stale", [([37, 100, 16, 64], 0.7), ([130, 5], 1.0), ([48, 33, 70], 0.0)])
@pytest.mark.parametrize("tile_pages", [1, 3, 64])
def test_matches_the_per_request_ops(kv_lens, stale, tile_pages):
    req_to_token, fmt, phys, hot_k, hot_v, tq3, layout, codebook, rotation = _pool(kv_lens, stale, seed=len(kv_lens))
    rows = list(range(len(kv_lens)))
    q = torch.randn(len(kv_lens), HQ, D, generator=torch.Generator().manual_seed(7))
    plan = plan_forward(req_to_token, torch.tensor(rows), torch.tensor(kv_lens), torch.ones(len(rows), dtype=torch.int64),
                        fmt, phys, PS, max_pages=max(-(-n // PS) for n in kv_lens))
    out, lse = mixed_batch_decode(q, plan.hot, plan.tq3, plan.kv_lens, hot_k, hot_v, tq3, layout, codebook, rotation,
                                  D**-0.5, K_SCALE, V_SCALE, tile_pages=tile_pages)
    routes = plan_batch(req_to_token, rows, kv_lens, [1] * len(rows), fmt, phys, PS)
    for i, r in enumerate(routes.requests):
        hot = HotPagedKV(hot_k, hot_v, r.hot_slots, r.hot_positions, K_SCALE, V_SCALE)
        tq = Tq3PagedKV(tq3, r.tq3_pages, layout, codebook, r.tq3_page_starts)
        want_out, want_lse = mixed_paged_attention(q[i : i + 1], hot, tq, rotation, D**-0.5, r.q_positions)
        torch.testing.assert_close(out[i : i + 1], want_out, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i : i + 1], want_lse, atol=2e-5, rtol=1e-5)


def test_a_format_with_no_pages_gives_the_empty_state():
    req_to_token, fmt, phys, hot_k, hot_v, tq3, layout, codebook, _ = _pool([32, 32], 1.0, seed=3)
    plan = plan_forward(req_to_token, torch.tensor([0, 1]), torch.tensor([32, 32]), torch.ones(2, dtype=torch.int64),
                        fmt, phys, PS, max_pages=2)
    q = torch.randn(2, HQ, D)
    out, lse = hot_batch_decode(q, plan.hot, plan.kv_lens, PS, hot_k, hot_v, D**-0.5, K_SCALE, V_SCALE)
    assert torch.isneginf(lse).all() and not out.any()
    out, lse = tq3_batch_decode(q, plan.tq3, plan.kv_lens, tq3, layout, codebook, D**-0.5)
    assert torch.isfinite(lse).all()
