"""ops.lut_decode (the CPU fast path) against ops.batched_decode (the reference): same out and LSE
up to float rounding, for any batch, context, Stale fraction, tile size and geometry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.fp8 import fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages
from sglang_minima.ops.dense import attend
from sglang_minima.layers.attention.forward_plan import plan_forward
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.batched_decode import (
    hot_batch_decode,
    mixed_batch_decode,
    tq3_batch_decode,
)
from sglang_minima.ops.lut_decode import (
    lut_hot_batch_decode,
    lut_mixed_batch_decode,
    lut_tq3_batch_decode,
)

K_SCALE, V_SCALE = 0.5, 0.25


def _pool(kv_lens, stale, seed, page_size=16, kv_heads=2, head_dim=64, hot_dtype=torch.uint8, layer=0, key_bits=3,
          key_center=False, key_offset=0.0, value_code="uniform", value_bits=3):
    """One layer's page table and hot + TQ3 buffers: request i on its own logical pages (in a shuffled
    physical order), each full page TQ3 with probability ``stale``; the partial last page stays hot.
    ``key_offset``: every key of a page also carries one random vector of that scale per head."""
    g = torch.Generator().manual_seed(seed)
    ps, h, d = page_size, kv_heads, head_dim
    pages = [-(-n // ps) for n in kv_lens]
    total = sum(pages)
    fmt = torch.zeros(total + 1, dtype=torch.int8)
    phys = torch.zeros(total + 1, dtype=torch.int32)
    req_to_token = torch.zeros(len(kv_lens), max(pages) * ps, dtype=torch.int32)
    layout = TQ3PageLayout(h, ps, d, key_bits, key_center, value_code, value_bits)
    codebook = key_codebook(d, key_bits)
    rotation = LayerRotation(h, d, layer, seed=3)
    fp8 = hot_dtype == torch.uint8
    hot_k = torch.zeros((total + 1) * ps, h, d, dtype=hot_dtype)
    hot_v = torch.zeros_like(hot_k)
    tq3 = torch.zeros(total + 1, layout.page_bytes, dtype=torch.uint8)
    hot_ids = (torch.randperm(total, generator=g) + 1).tolist()
    tq3_ids = (torch.randperm(total, generator=g) + 1).tolist()
    lp = 1
    for row, (n, kv) in enumerate(zip(pages, kv_lens)):
        for j in range(n):
            req_to_token[row, j * ps : (j + 1) * ps] = torch.arange(lp * ps, (lp + 1) * ps)
            k = torch.randn(ps, h, d, generator=g) * 2 + key_offset * torch.randn(1, h, d, generator=g)
            v = torch.randn(ps, h, d, generator=g)
            partial = j == n - 1 and kv % ps
            if not partial and float(torch.rand((), generator=g)) < stale:
                p = tq3_ids.pop()
                fmt[lp], phys[lp] = FMT_TQ3, p
                kq, vq = fp8_quantize(k, K_SCALE), fp8_quantize(v, V_SCALE)
                tq3[p] = encode_pages(kq.permute(1, 0, 2)[None], vq.permute(1, 0, 2)[None], layout, rotation,
                                      codebook, k_scale=K_SCALE, v_scale=V_SCALE)[0]
            else:
                p = hot_ids.pop()
                fmt[lp], phys[lp] = FMT_HOT, p
                hot_k[p * ps : (p + 1) * ps] = fp8_quantize(k, K_SCALE) if fp8 else k.to(hot_dtype)
                hot_v[p * ps : (p + 1) * ps] = fp8_quantize(v, V_SCALE) if fp8 else v.to(hot_dtype)
            lp += 1
    rows = torch.arange(len(kv_lens))
    plan = plan_forward(req_to_token, rows, torch.tensor(kv_lens), torch.ones(len(kv_lens), dtype=torch.int64),
                        fmt, phys, ps, max_pages=max(pages))
    scales = (K_SCALE, V_SCALE) if fp8 else (None, None)
    return plan, hot_k, hot_v, tq3, layout, codebook, rotation, scales


def _both(plan, hot_k, hot_v, tq3, layout, codebook, rotation, scales, q, tile_pages):
    args = (q, plan.hot, plan.tq3, plan.kv_lens, hot_k, hot_v, tq3, layout, codebook, rotation, q.shape[-1] ** -0.5)
    want = mixed_batch_decode(*args, *scales, tile_pages=tile_pages)
    got = lut_mixed_batch_decode(*args, *scales, tile_pages=tile_pages)
    return want, got


def _close(got, want, atol=2e-5):
    (out, lse), (want_out, want_lse) = got, want
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=atol, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    kv_lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    stale=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    tile_pages=st.sampled_from([1, 3, 32]),
    geometry=st.sampled_from([(16, 2, 6, 64), (32, 1, 3, 128), (64, 3, 9, 64), (16, 2, 4, 256)]),
    seed=st.integers(0, 10_000),
)
def test_matches_the_reference_batched_decode(kv_lens, stale, tile_pages, geometry, seed):
    ps, h, hq, d = geometry
    pool = _pool(kv_lens, stale, seed, ps, h, d)
    q = torch.randn(len(kv_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1)) * 2
    want, got = _both(*pool, q, tile_pages)
    _close(got, want)


@settings(max_examples=10, deadline=None)
@given(
    kv_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    stale=st.sampled_from([0.5, 1.0]),
    tile_pages=st.sampled_from([1, 32]),
    geometry=st.sampled_from([(16, 2, 6, 64), (32, 1, 3, 128), (16, 2, 4, 256)]),
    seed=st.integers(0, 10_000),
)
def test_four_bit_keys_match_the_reference_batched_decode(kv_lens, stale, tile_pages, geometry, seed):
    """4-bit Stale keys (one byte per pair, a 256-entry pair table) read as the codec decodes them."""
    ps, h, hq, d = geometry
    pool = _pool(kv_lens, stale, seed, ps, h, d, key_bits=4)
    assert pool[4].key_bits == 4 and pool[5].levels == 16
    q = torch.randn(len(kv_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1)) * 2
    want, got = _both(*pool, q, tile_pages)
    _close(got, want)


@settings(max_examples=24, deadline=None)
@given(
    kv_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    stale=st.sampled_from([0.5, 1.0]),
    tile_pages=st.sampled_from([1, 32]),
    key_bits=st.sampled_from([3, 4]),
    key_center=st.booleans(),
    value_code=st.sampled_from(["uniform", "lloyd-max"]),
    value_bits=st.sampled_from([3, 4]),
    seed=st.integers(0, 10_000),
)
@example(kv_lens=[97, 113, 113, 147], stale=0.5, tile_pages=1, key_bits=3, key_center=True, value_code="uniform",
         value_bits=3, seed=200)  # 2.3e-5 apart (CI, 2026-12-07)
def test_layout_options_match_the_reference_batched_decode(kv_lens, stale, tile_pages, key_bits, key_center,
                                                           value_code, value_bits, seed):
    """Page-centered keys (``key_center``): the page's mean key enters the scores as one q . mean per
    page and head, as the codec decodes it; keys share a large offset per page (post-RoPE keys do).
    ``lloyd-max`` values: the weights times each token's scale against the codes' centroids, no zero
    term. 4-bit values: their codes four pairs a word, the same decode. The reference decodes the
    pages with the codec."""
    pool = _pool(kv_lens, stale, seed, 16, 2, 64, key_bits=key_bits, key_center=key_center,
                 key_offset=6.0 if key_center else 0.0, value_code=value_code, value_bits=value_bits)
    assert (pool[4].key_center, pool[4].value_code, pool[4].value_bits) == (key_center, value_code, value_bits)
    q = torch.randn(len(kv_lens), 6, 64, generator=torch.Generator().manual_seed(seed + 1)) * 2
    want, got = _both(*pool, q, tile_pages)
    # the page offsets put scores near 60 (LSE), where float32 rounding of the two summation orders
    # reaches 2.3e-5 in an output (CI, seed 200; 1.8e-5 the worst of 80 random cases here; 4e-6
    # without the offsets): a decode error is 1e-2 or more
    _close(got, want, atol=1e-4 if key_center else 2e-5)


def test_four_bit_tq3_decode_equals_dense_attention_over_the_decoded_pages():
    plan, _, _, tq3, layout, codebook, rotation, _ = _pool([96, 200, 64], 1.0, 3, 16, 2, 64, key_bits=4)
    q_rot = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(4))
    out, lse = lut_tq3_batch_decode(q_rot, plan.tq3, plan.kv_lens, tq3, layout, codebook, 64**-0.5, tile_pages=5)
    for b in range(3):
        entries = slice(int(plan.tq3.indptr[b]), int(plan.tq3.indptr[b + 1]))
        k, v = decode_pages(tq3[plan.tq3.pages[entries].to(torch.int64)], layout, codebook)  # [n, H, P, D]
        k, v = (x.transpose(1, 2).reshape(-1, 2, 64) for x in (k, v))
        want_out, want_lse = attend(q_rot[b : b + 1], k, v, 64**-0.5)
        torch.testing.assert_close(out[b : b + 1], want_out, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b : b + 1], want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("hot_dtype", [torch.bfloat16, torch.float32])
def test_hot_pages_in_the_model_dtype(hot_dtype):
    """--minima-hot-dtype auto: hot pages in the model dtype, no scales."""
    pool = _pool([70, 130, 9], 0.6, 5, hot_dtype=hot_dtype)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2))
    want, got = _both(*pool, q, tile_pages=2)
    _close(got, want)


def test_each_format_alone_matches_and_an_empty_format_is_the_empty_state():
    plan, hot_k, hot_v, tq3, layout, codebook, rotation, _ = _pool([64, 200], 0.7, 11)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(4))
    sm = 64**-0.5
    _close(lut_hot_batch_decode(q, plan.hot, plan.kv_lens, 16, hot_k, hot_v, sm, K_SCALE, V_SCALE),
           hot_batch_decode(q, plan.hot, plan.kv_lens, 16, hot_k, hot_v, sm, K_SCALE, V_SCALE))
    q_rot = rotation.rotate(q, head_axis=-2)
    _close(lut_tq3_batch_decode(q_rot, plan.tq3, plan.kv_lens, tq3, layout, codebook, sm),
           tq3_batch_decode(q_rot, plan.tq3, plan.kv_lens, tq3, layout, codebook, sm))
    plan, hot_k, hot_v, tq3, layout, codebook, rotation, _ = _pool([32, 32], 1.0, 3)
    out, lse = lut_hot_batch_decode(q, plan.hot, plan.kv_lens, 16, hot_k, hot_v, sm, K_SCALE, V_SCALE)
    assert torch.isneginf(lse).all() and not out.any()


def test_a_request_with_pages_of_one_format_only_beside_one_with_both():
    """Requests of one batch that have no TQ3 (or no hot) page get the other format's state alone."""
    plan, hot_k, hot_v, tq3, layout, codebook, rotation, scales = _pool([10, 160, 48], 1.0, 8)
    assert int(plan.tq3.counts[0]) == 0 and int(plan.hot.counts[2]) == 0
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(9))
    want, got = _both(plan, hot_k, hot_v, tq3, layout, codebook, rotation, scales, q, tile_pages=4)
    _close(got, want)
    assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("decode", [lut_hot_batch_decode, hot_batch_decode])
def test_rows_past_a_requests_end_do_not_reach_the_output(decode):
    """A partial last page's unwritten rows hold what the page held before, e.g. the NaN that
    SGLANG_DEBUG_MEMORY_POOL's poison leaves in a page handed out again: weight 0, and no NaN out."""
    kv_lens = [70, 130, 9]
    plan, hot_k, hot_v, *_ = _pool(kv_lens, 0.0, 5)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2))
    args = (q, plan.hot, plan.kv_lens, 16)
    want = decode(*args, hot_k, hot_v, 64**-0.5, K_SCALE, V_SCALE)
    poisoned_k, poisoned_v = hot_k.clone(), hot_v.clone()
    for row, n in enumerate(kv_lens):  # the rows of each request's last page past its end
        last = int(plan.hot.pages[int(plan.hot.indptr[row + 1]) - 1])
        poisoned_k[last * 16 + n % 16 : (last + 1) * 16] = 0xFF  # NaN in e4m3
        poisoned_v[last * 16 + n % 16 : (last + 1) * 16] = 0xFF
    got = decode(*args, poisoned_k, poisoned_v, 64**-0.5, K_SCALE, V_SCALE)
    assert torch.isfinite(got[0]).all()
    _close(got, want)
