"""plan_extend: an extend batch split into new tokens, hot prefix and TQ3 pages, and the split is
exact: attending the three sets as ExtendPlan says (causal, all, all) and merging by LSE gives what
the causal mixed attention over every key gives (the torch reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import encode_pages
from sglang_minima.layers.attention.forward_plan import plan_forward, split_extend
from sglang_minima.layers.attention.plan import plan_batch, plan_extend
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.dense import attend, causal_mask
from sglang_minima.ops.merge import merge_attention_states
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention, tq3_paged_attention

PS, H, HQ, D = 16, 2, 4, 64
SM = D**-0.5
N_PAGES = 24  # logical = physical pages per format in these tables


def _batch(reqs: list[tuple[int, int, list[bool]]]):
    """reqs: (kv_len, q_len, is_tq3 per whole page before the queries) -> the page table, req_to_token
    and the batch's route. Logical page i of request j is its own; TQ3 and hot physical pages differ."""
    fmt = torch.zeros(N_PAGES * 4, dtype=torch.int8)
    phys = torch.zeros(N_PAGES * 4, dtype=torch.int32)
    req_to_token = torch.zeros(len(reqs) + 1, N_PAGES * PS, dtype=torch.int32)
    next_logical, next_hot, next_tq3 = 0, 1, 0
    for row, (kv_len, _, tq3_flags) in enumerate(reqs, start=1):
        for page in range(-(-kv_len // PS)):
            lp = next_logical
            next_logical += 1
            if page < len(tq3_flags) and tq3_flags[page]:
                fmt[lp], phys[lp] = FMT_TQ3, next_tq3
                next_tq3 += 1
            else:
                fmt[lp], phys[lp] = FMT_HOT, next_hot
                next_hot += 1
            n = min(PS, kv_len - page * PS)
            req_to_token[row, page * PS : page * PS + n] = torch.arange(lp * PS, lp * PS + n)
    route = plan_batch(
        req_to_token, list(range(1, len(reqs) + 1)), [r[0] for r in reqs], [r[1] for r in reqs], fmt, phys, PS
    )
    return route, next_hot, next_tq3


def test_prefix_slots_rows_and_tq3_requests():
    # request 0: pages 0 (hot sink), 1 (TQ3), 2 (hot, queries 40..43 start in it); request 1: no prefix
    route, *_ = _batch([(44, 4, [False, True]), (5, 5, [])])
    plan = plan_extend(route, PS)
    assert plan.qo_indptr.tolist() == [0, 4, 9]
    assert plan.prefix_indptr.tolist() == [0, 24, 24]  # 16 sink + 8 tokens of page 2 before the queries
    a = route.requests[0]
    assert torch.equal(plan.prefix_slots.long(), a.hot_slots[:24])
    assert plan.prefix_slots.dtype == torch.int32
    assert plan.prefix_rows.tolist() == [True] * 4 + [False] * 5
    assert [(t.q_start, t.q_len) for t in plan.tq3] == [(a.q_start, a.q_len)]
    assert torch.equal(plan.tq3[0].pages, a.tq3_pages)
    assert plan.num_prefix_tokens == 24


def test_no_prefix_rows_mask_when_every_request_has_one_or_none():
    assert plan_extend(_batch([(20, 4, []), (30, 2, [])])[0], PS).prefix_rows is None
    plan = plan_extend(_batch([(4, 4, []), (7, 7, [])])[0], PS)
    assert plan.prefix_rows is None and plan.num_prefix_tokens == 0 and plan.prefix_slots.numel() == 0


def test_refuses_a_tq3_page_under_the_queries():
    # page 1 (positions 16..31) is TQ3 but the request's queries start at 20
    route, *_ = _batch([(32, 12, [False, True])])
    with pytest.raises(ValueError, match="overlaps the new tokens"):
        plan_extend(route, PS)


def test_refuses_new_tokens_off_hot_pages():
    route, *_ = _batch([(32, 32, [True])])  # plan_request accepts it; a prefill's queries cannot be TQ3
    with pytest.raises(ValueError, match="not all on hot pages|overlaps"):
        plan_extend(route, PS)


def _buffers(n_hot: int, n_tq3: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k8, v8 = torch.randn(n_hot * PS, H, D, generator=g), torch.randn(n_hot * PS, H, D, generator=g)
    layout, rot, cb = TQ3PageLayout(H, PS, D), LayerRotation(H, D, layer_id=1), tq3_codebook(D)
    k3, v3 = torch.randn(max(n_tq3, 1), H, PS, D, generator=g), torch.randn(max(n_tq3, 1), H, PS, D, generator=g)
    return fp8_quantize(k8, 0.5), fp8_quantize(v8, 0.25), encode_pages(k3, v3, layout, rot, cb), layout, rot, cb


def _requests(min_full_pages: int, max_full_pages: int, max_requests: int):
    """Requests as (full pages before the queries, extra prefix tokens, queries, TQ3 flag per page)."""
    return st.lists(
        st.tuples(st.integers(min_full_pages, max_full_pages), st.integers(0, PS - 1), st.integers(1, 40),
                  st.lists(st.booleans(), max_size=max_full_pages)),
        min_size=1,
        max_size=max_requests,
    )


@settings(max_examples=25, deadline=None)
@given(_requests(1, 5, 3), st.integers(0, 100))
def test_three_sets_merged_equal_the_causal_mixed_attention(shapes, seed):
    reqs = []
    for full_pages, extra, q_len, flags in shapes:
        prefix = full_pages * PS + extra  # tokens before the queries
        sealed = prefix // PS  # whole pages before the first query: the only ones that may be TQ3
        reqs.append((prefix + q_len, q_len, [f for f in flags[:sealed]]))
    route, n_hot, n_tq3 = _batch(reqs)
    plan = plan_extend(route, PS)
    kb, vb, tq3_buf, layout, rot, cb = _buffers(n_hot, n_tq3, seed)
    q = torch.randn(int(plan.qo_indptr[-1]), HQ, D, generator=torch.Generator().manual_seed(seed))

    for i, r in enumerate(route.requests):
        rows = slice(r.q_start, r.q_start + r.q_len)
        qr = q[rows]
        hot = HotPagedKV(kb, vb, r.hot_slots, r.hot_positions, 0.5, 0.25)
        tq3 = Tq3PagedKV(tq3_buf, r.tq3_pages, layout, cb, r.tq3_page_starts)
        want = mixed_paged_attention(qr, hot, tq3, rot, SM, r.q_positions)

        # the new tokens, causal among themselves (here read back from the hot pages)
        new = r.hot_slots[r.num_hot_tokens - r.q_len :]
        k_new, v_new = fp8_dequantize(kb[new], 0.5), fp8_dequantize(vb[new], 0.25)
        pos = torch.arange(r.q_len)
        got = attend(qr, k_new, v_new, SM, causal_mask(pos, pos))
        # the hot prefix, all visible
        lo, hi = int(plan.prefix_indptr[i]), int(plan.prefix_indptr[i + 1])
        if hi > lo:
            slots = plan.prefix_slots[lo:hi].long()
            got = merge_attention_states(*got, *attend(qr, fp8_dequantize(kb[slots], 0.5), fp8_dequantize(vb[slots], 0.25), SM))
        assert (plan.prefix_rows is None and (hi > lo or plan.num_prefix_tokens == 0)) or (
            plan.prefix_rows is not None and bool((plan.prefix_rows[rows] == (hi > lo)).all())
        )
        # the TQ3 pages, all visible, through the fused kernel per tile
        seg = next((t for t in plan.tq3 if t.q_start == r.q_start), None)
        if seg is not None:
            out_rot, lse = tq3_paged_attention(rot.rotate(qr, head_axis=-2), Tq3PagedKV(tq3_buf, seg.pages, layout, cb), SM, tile_pages=2, flash=True)
            got = merge_attention_states(*got, rot.unrotate(out_rot, head_axis=-2), lse)
        else:
            assert r.num_tq3_pages == 0
        assert torch.allclose(got[0], want[0], atol=3e-5), float((got[0] - want[0]).abs().max())
        assert torch.allclose(got[1], want[1], atol=3e-5), float((got[1] - want[1]).abs().max())


@settings(max_examples=60, deadline=None)
@given(_requests(0, 6, 4), st.integers(0, 3), st.booleans())
def test_the_device_split_equals_the_per_request_one(shapes, shared, overlap):
    """split_extend over plan_forward (one host read) against plan_extend over plan_batch, on random
    tables: hot and TQ3 pages mixed, partial pages, requests sharing the first pages of the first one
    (radix hits), an empty hot prefix, and (``overlap``) a TQ3 page under the queries: both refuse."""
    fmt = torch.zeros(N_PAGES * 8, dtype=torch.int8)
    phys = torch.zeros(N_PAGES * 8, dtype=torch.int32)
    req_to_token = torch.zeros(len(shapes) + 1, N_PAGES * PS, dtype=torch.int32)
    next_logical, next_phys = 1, [1, 0]  # logical page 0 and hot page 0: SGLang's padding
    kv_lens, q_lens, first_pages = [], [], []
    for row, (full_pages, extra, q_len, flags) in enumerate(shapes, start=1):
        prefix = full_pages * PS + extra
        kv_len = prefix + q_len
        pages = []
        for page in range(-(-kv_len // PS)):
            if row > 1 and page < min(shared, len(first_pages), prefix // PS):
                pages.append(first_pages[page])  # a radix hit: the first request's own logical page
                continue
            lp, next_logical = next_logical, next_logical + 1
            tq3 = page < prefix // PS and page < len(flags) and flags[page]
            fmt[lp] = FMT_TQ3 if tq3 else FMT_HOT
            phys[lp], next_phys[tq3] = next_phys[tq3], next_phys[tq3] + 1
            pages.append(lp)
        if row == 1:
            first_pages = pages
        for page, lp in enumerate(pages):
            n = min(PS, kv_len - page * PS)
            req_to_token[row, page * PS : page * PS + n] = torch.arange(lp * PS, lp * PS + n)
        kv_lens.append(kv_len)
        q_lens.append(q_len)
    if overlap:  # the page holding the last query goes TQ3
        last = int(req_to_token[1, kv_lens[0] - 1]) // PS
        fmt[last], phys[last] = FMT_TQ3, next_phys[1]
    rows = list(range(1, len(shapes) + 1))
    route = plan_batch(req_to_token, rows, kv_lens, q_lens, fmt, phys, PS)
    fplan = plan_forward(req_to_token, torch.tensor(rows), torch.tensor(kv_lens), torch.tensor(q_lens), fmt, phys, PS,
                         max(-(-k // PS) for k in kv_lens))
    try:
        want = plan_extend(route, PS)
    except ValueError:
        with pytest.raises(ValueError, match="overlaps"):
            split_extend(fplan, q_lens, kv_lens)
        assert overlap
        return
    got = split_extend(fplan, q_lens, kv_lens)
    if not bool((fmt == FMT_TQ3).any()):  # what a pool holding no TQ3 page lets the backend skip: the same split
        same = split_extend(fplan, q_lens, kv_lens, tq3_possible=False)
        assert same.tq3 == () and torch.equal(same.prefix_indptr, got.prefix_indptr)
        assert torch.equal(same.prefix_slots, got.prefix_slots)
    assert torch.equal(got.qo_indptr, want.qo_indptr) and got.qo_indptr.device.type == "cpu"
    assert torch.equal(got.prefix_indptr, want.prefix_indptr) and got.prefix_indptr.device.type == "cpu"
    assert got.prefix_slots.dtype == torch.int32 and torch.equal(got.prefix_slots, want.prefix_slots)
    assert (got.prefix_rows is None) == (want.prefix_rows is None)
    if want.prefix_rows is not None:
        assert torch.equal(got.prefix_rows, want.prefix_rows)
    # the per-request prefixes, consecutive ones with the same pages (a radix hit's) read as one
    merged = []
    for t in want.tq3:
        last = merged[-1] if merged else None
        if last and last.q_start + last.q_len == t.q_start and torch.equal(last.pages, t.pages):
            merged[-1] = dataclasses.replace(last, q_len=last.q_len + t.q_len)
        else:
            merged.append(t)
    assert [(t.q_start, t.q_len) for t in got.tq3] == [(t.q_start, t.q_len) for t in merged]
    for a, b in zip(got.tq3, merged):
        assert a.pages.dtype == b.pages.dtype == torch.int64 and torch.equal(a.pages, b.pages)


def test_neighbours_reading_one_tq3_prefix_share_its_segment():
    """Rows 1-2 and 4 hit row 1's two TQ3 pages (a radix prefix: logical pages 1 and 2), row 3 has
    its own: rows 1-2 share one segment over their queries; row 4, after row 3, gets its own again."""
    fmt = torch.zeros(16, dtype=torch.int8)
    phys = torch.zeros(16, dtype=torch.int32)
    fmt[[1, 2, 9]] = FMT_TQ3
    phys[[1, 2, 9]] = torch.tensor([7, 3, 5], dtype=torch.int32)
    pages = {1: [1, 2, 4], 2: [1, 2, 5], 3: [9, 6], 4: [1, 2, 8]}  # logical pages in position order
    q_lens, kv_lens = [5, 3, 4, 2], [2 * PS + 5, 2 * PS + 3, PS + 4, 2 * PS + 2]
    req_to_token = torch.zeros(5, N_PAGES * PS, dtype=torch.int32)
    for row, lps in pages.items():
        for k, lp in enumerate(lps):
            n = min(PS, kv_lens[row - 1] - k * PS)
            req_to_token[row, k * PS : k * PS + n] = torch.arange(lp * PS, lp * PS + n)
    rows = [1, 2, 3, 4]
    plan = plan_forward(req_to_token, torch.tensor(rows), torch.tensor(kv_lens), torch.tensor(q_lens), fmt, phys, PS,
                        N_PAGES)
    got = split_extend(plan, q_lens, kv_lens)
    assert [(t.q_start, t.q_len, t.pages.tolist()) for t in got.tq3] == [(0, 8, [7, 3]), (8, 4, [5]), (12, 2, [7, 3])]
    want = plan_extend(plan_batch(req_to_token, rows, kv_lens, q_lens, fmt, phys, PS), PS)
    assert [(t.q_start, t.q_len) for t in want.tq3] == [(0, 5), (5, 3), (8, 4), (12, 2)]  # the reference keeps one each
