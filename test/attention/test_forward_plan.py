"""forward_plan.py (batched, fixed-shape, on the device) against plan.py (per request, the reference)
on random page tables: shared prefix pages, partial last pages, TQ3 full last pages, padding rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_minima.layers.attention.forward_plan import plan_forward, split_extend
from sglang_minima.ops.host_copy import to_device
from sglang_minima.layers.attention.plan import plan_batch
from sglang_minima.mem_cache.device_routes import DeviceRouteCounter
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, PageTable
from sglang_minima.mem_cache.stats import MinimaStats

PS = 4
NUM_LOGICAL = 40


@st.composite
def batches(draw):
    """A page table and a batch of requests over it (row 0 is SGLang's padding row, all slots 0)."""
    fmt = torch.tensor(draw(st.lists(st.sampled_from([FMT_HOT, FMT_TQ3]), min_size=NUM_LOGICAL + 1,
                                     max_size=NUM_LOGICAL + 1)), dtype=torch.int8)
    fmt[0] = FMT_HOT  # the padding page
    perm = draw(st.permutations(list(range(1, NUM_LOGICAL + 1))))
    phys = torch.tensor([0, *perm], dtype=torch.int32)  # distinct physical ids (per format would do)
    num_rows = draw(st.integers(2, 6))
    max_len = 8 * PS
    req_to_token = torch.zeros(num_rows, max_len, dtype=torch.int32)
    pages_of: list[list[int]] = [[]]
    unused = draw(st.permutations(list(range(1, NUM_LOGICAL + 1))))
    for row in range(1, num_rows):
        n = draw(st.integers(1, 8))
        shared = draw(st.integers(0, min(n, len(pages_of[-1]))))  # a prefix shared with the row before
        own, unused = unused[: n - shared], unused[n - shared :]  # a page holds one prefix's positions
        pages = pages_of[-1][:shared] + own
        pages_of.append(pages)
        req_to_token[row, : n * PS] = torch.cat([torch.arange(lp * PS, (lp + 1) * PS) for lp in pages]).to(torch.int32)
    rows, kv_lens, q_lens = [], [], []
    for _ in range(draw(st.integers(1, 6))):
        row = draw(st.integers(0, num_rows - 1))
        n = len(pages_of[row])
        if row == 0:  # a padded graph row: one token on the padding page
            kv = 1
        else:
            kv = draw(st.integers((n - 1) * PS + 1, n * PS))
            last = pages_of[row][-1]
            if kv % PS and fmt[last] == FMT_TQ3:
                fmt[last] = FMT_HOT  # a partial page is being written: it is hot
        rows.append(row)
        kv_lens.append(kv)
        q_lens.append(draw(st.integers(1, kv)))
    return req_to_token, rows, kv_lens, q_lens, fmt, phys


@settings(max_examples=200, deadline=None)
@given(batches())
def test_matches_the_per_request_planner(case):
    req_to_token, rows, kv_lens, q_lens, fmt, phys = case
    want = plan_batch(req_to_token, rows, kv_lens, q_lens, fmt, phys, PS)
    got = plan_forward(req_to_token, torch.tensor(rows), torch.tensor(kv_lens), torch.tensor(q_lens),
                       fmt, phys, PS, max_pages=8)
    assert got.q_indptr.tolist() == [r.q_start for r in want.requests] + [sum(q_lens)]
    for i, r in enumerate(want.requests):
        hot = slice(int(got.hot.indptr[i]), int(got.hot.indptr[i + 1]))
        tq3 = slice(int(got.tq3.indptr[i]), int(got.tq3.indptr[i + 1]))
        first = torch.ones_like(r.hot_positions, dtype=torch.bool)
        first[1:] = r.hot_positions[1:] // PS != r.hot_positions[:-1] // PS
        assert got.hot.pages[hot].tolist() == (r.hot_slots[first] // PS).tolist()
        assert got.hot.page_index[hot].tolist() == (r.hot_positions[first] // PS).tolist()
        assert got.tq3.pages[tq3].tolist() == r.tq3_pages.tolist()
        assert (got.tq3.page_index[tq3] * PS).tolist() == r.tq3_page_starts.tolist()
        if r.num_hot_tokens:
            last_hot_page = int(r.hot_positions[-1]) // PS
            assert int(got.hot_last_page_len[i]) == int((r.hot_positions // PS == last_hot_page).sum())
        n = -(-kv_lens[i] // PS)
        assert got.logical_pages[i, :n].tolist() == r.logical_pages.tolist()
        assert not got.logical_pages[i, n:].any()
    counts = want.counts
    assert got.token_counts().tolist() == [counts.hot_tokens, counts.tq3_tokens]
    assert int(got.hot.indptr[-1]) == counts.hot_pages and int(got.tq3.indptr[-1]) == counts.tq3_pages
    # past the live entries: padding, page 0
    assert not got.hot.pages[int(got.hot.indptr[-1]):].any() and not got.tq3.pages[int(got.tq3.indptr[-1]):].any()


def test_padding_row_plans_the_padding_page():
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    fmt, phys = torch.zeros(9, dtype=torch.int8), torch.zeros(9, dtype=torch.int32)
    plan = plan_forward(req_to_token, torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([1, 1]),
                        fmt, phys, PS, max_pages=4)
    assert plan.hot.indptr.tolist() == [0, 1, 2] and plan.hot.pages[:2].tolist() == [0, 0]
    assert plan.tq3.indptr.tolist() == [0, 0, 0]
    assert plan.hot_last_page_len.tolist() == [1, 1]


def test_shapes_are_fixed_by_batch_and_max_pages():
    """The same shapes whatever the page table says: what a captured graph needs."""
    req_to_token = torch.arange(64, dtype=torch.int32).view(2, 32) + PS  # logical pages 1..16
    shapes = set()
    for tags in ([FMT_HOT] * 17, [FMT_TQ3] * 17, [FMT_HOT, FMT_TQ3] * 8 + [FMT_HOT]):
        fmt = torch.tensor(tags, dtype=torch.int8)
        plan = plan_forward(req_to_token, torch.tensor([0, 1]), torch.tensor([30, 17]), torch.tensor([1, 1]),
                            fmt, torch.arange(17, dtype=torch.int32), PS, max_pages=8)
        shapes.add((plan.hot.pages.shape, plan.tq3.pages.shape, plan.logical_pages.shape))
    assert shapes == {(torch.Size([16]), torch.Size([16]), torch.Size([2, 8]))}


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    req_to_token = (torch.arange(64, dtype=torch.int32).view(2, 32) + PS).cuda()
    fmt = torch.tensor([FMT_HOT, FMT_TQ3] * 8 + [FMT_HOT], dtype=torch.int8, device="cuda")
    phys = torch.arange(17, dtype=torch.int32, device="cuda")
    args = (torch.tensor([0, 1], device="cuda"), torch.tensor([30, 17], device="cuda"),
            torch.tensor([1, 1], device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = plan_forward(req_to_token, *args, fmt, phys, PS, max_pages=8)
        plan.token_counts()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    cpu = plan_forward(req_to_token.cpu(), *(a.cpu() for a in args), fmt.cpu(), phys.cpu(), PS, max_pages=8)
    assert torch.equal(plan.tq3.pages.cpu(), cpu.tq3.pages) and torch.equal(plan.hot.indptr.cpu(), cpu.hot.indptr)


@pytest.mark.gpu
def test_the_extend_split_reads_the_device_once_on_cuda():
    """split_extend's one host read (the batch's TQ3 page counts) is its only sync: its host lists go
    to the device through pinned memory, asynchronously. Equal to the same split on CPU."""
    import warnings

    req_to_token = (torch.arange(64, dtype=torch.int32).view(2, 32) + PS).cuda()
    fmt = torch.tensor([FMT_HOT] + [FMT_TQ3] * 3 + [FMT_HOT] * 13, dtype=torch.int8, device="cuda")
    phys = torch.arange(17, dtype=torch.int32, device="cuda")
    rows, kv_lens, q_lens = [0, 1], [30, 17], [9, 17]  # row 0: pages 1-3 TQ3 read by 9 new tokens
    args = (to_device(rows, torch.int64, "cuda"), to_device(kv_lens, torch.int32, "cuda"),
            to_device(q_lens, torch.int32, "cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            split = split_extend(plan_forward(req_to_token, *args, fmt, phys, PS, max_pages=8), q_lens, kv_lens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    cpu = split_extend(plan_forward(req_to_token.cpu(), torch.tensor(rows), torch.tensor(kv_lens),
                                    torch.tensor(q_lens), fmt.cpu(), phys.cpu(), PS, max_pages=8), q_lens, kv_lens)
    assert torch.equal(split.prefix_indptr, cpu.prefix_indptr) and torch.equal(split.prefix_slots.cpu(), cpu.prefix_slots)
    assert [t.pages.cpu().tolist() for t in split.tq3] == [t.pages.tolist() for t in cpu.tq3] == [[1, 2, 3]]


@pytest.mark.gpu
def test_an_extend_split_without_tq3_pages_reads_nothing_on_cuda():
    """A pool that holds no TQ3 page (Stale disabled, or nothing converted yet) lets the backend skip
    split_extend's host read: no sync at all, the same split as with the read."""
    req_to_token = (torch.arange(64, dtype=torch.int32).view(2, 32) + PS).cuda()
    fmt = torch.full((17,), FMT_HOT, dtype=torch.int8, device="cuda")
    phys = torch.arange(17, dtype=torch.int32, device="cuda")
    rows, kv_lens, q_lens = [0, 1], [30, 17], [9, 17]
    args = (to_device(rows, torch.int64, "cuda"), to_device(kv_lens, torch.int32, "cuda"),
            to_device(q_lens, torch.int32, "cuda"))
    plan = plan_forward(req_to_token, *args, fmt, phys, PS, max_pages=8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        split = split_extend(plan, q_lens, kv_lens, tq3_possible=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    read = split_extend(plan, q_lens, kv_lens)
    assert split.tq3 == read.tq3 == () and torch.equal(split.prefix_indptr, read.prefix_indptr)
    assert torch.equal(split.prefix_slots, read.prefix_slots)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_device_route_counts_are_the_host_counts_of_the_real_rows(case):
    """What a captured step adds on the device (mem_cache/device_routes.py) is what an eager step
    counts on the host (TieredPageStore.note_read) for the same requests, padding rows left out."""
    req_to_token, rows, kv_lens, q_lens, fmt, phys = case
    plan = plan_forward(req_to_token, torch.tensor(rows), torch.tensor(kv_lens), torch.ones(len(rows)),
                        fmt, phys, PS, max_pages=8)
    real = torch.tensor(rows) != 0
    table = PageTable(NUM_LOGICAL, PS, torch.device("cpu"))
    table.fmt.copy_(fmt)
    table.phys.copy_(phys)
    counter, stats = DeviceRouteCounter(torch.device("cpu")), MinimaStats()
    counter.count(table, plan.logical_pages, plan.token_counts(real), real)
    counter.mark_step()
    counter.fold(stats, wait=True)
    keep = [i for i, r in enumerate(rows) if r != 0]
    want = plan_batch(req_to_token, [rows[i] for i in keep], [kv_lens[i] for i in keep], [1] * len(keep), fmt, phys, PS)
    pages = want.logical_pages
    read = fmt[pages[phys[pages] != 0]] if keep else torch.zeros(0, dtype=torch.int8)
    expected = [int((read == FMT_HOT).sum()), want.counts.hot_tokens, int((read == FMT_TQ3).sum()), want.counts.tq3_tokens]
    got = [stats.route_hot_pages, stats.route_hot_tokens, stats.route_tq3_pages, stats.route_tq3_tokens]
    assert got == expected
    counter.fold(stats, wait=True)  # nothing new: nothing added twice
    assert [stats.route_hot_pages, stats.route_hot_tokens, stats.route_tq3_pages, stats.route_tq3_tokens] == expected
