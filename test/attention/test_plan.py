"""plan.py: logical slots + page table -> per-format index arrays, on hand-built page tables."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.layers.attention.plan import RouteCounts, plan_batch, plan_request
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3

PS = 4


def _table(entries: dict[int, tuple[int, int]], num_pages: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """{logical page: (format, physical page)} -> (fmt int8, phys int32); unset pages are hot page 0."""
    fmt = torch.zeros(num_pages, dtype=torch.int8)
    phys = torch.zeros(num_pages, dtype=torch.int32)
    for lp, (f, p) in entries.items():
        fmt[lp], phys[lp] = f, p
    return fmt, phys


def _slots(*logical_pages: int, length: int) -> torch.Tensor:
    """Logical slots of a request whose positions fill the given logical pages in order."""
    row = torch.cat([torch.arange(lp * PS, (lp + 1) * PS) for lp in logical_pages])
    return row[:length].to(torch.int32)


def test_all_hot_slots_follow_physical_pages():
    fmt, phys = _table({3: (FMT_HOT, 7), 5: (FMT_HOT, 2)})
    r = plan_request(_slots(3, 5, length=6), fmt, phys, PS, q_start=0, q_len=6)
    assert r.hot_slots.tolist() == [28, 29, 30, 31, 8, 9]
    assert r.hot_positions.tolist() == list(range(6))
    assert r.tq3_pages.numel() == 0 and r.tq3_page_starts.numel() == 0
    assert (r.num_hot_pages, r.num_hot_tokens, r.num_tq3_pages, r.num_tq3_tokens) == (2, 6, 0, 0)
    assert r.q_positions.tolist() == list(range(6))
    assert r.hot_slots.dtype == r.tq3_pages.dtype == torch.int64


def test_mixed_formats_split_by_page():
    # positions 0-3 hot (sink), 4-11 TQ3 (two stale pages), 12-13 hot (recent, partial)
    fmt, phys = _table({2: (FMT_HOT, 1), 9: (FMT_TQ3, 4), 4: (FMT_TQ3, 3), 6: (FMT_HOT, 5)})
    r = plan_request(_slots(2, 9, 4, 6, length=14), fmt, phys, PS, q_start=3, q_len=1)
    assert r.hot_slots.tolist() == [4, 5, 6, 7, 20, 21]
    assert r.hot_positions.tolist() == [0, 1, 2, 3, 12, 13]
    assert r.tq3_pages.tolist() == [4, 3]
    assert r.tq3_page_starts.tolist() == [4, 8]
    assert (r.num_hot_pages, r.num_hot_tokens, r.num_tq3_pages, r.num_tq3_tokens) == (2, 6, 2, 8)
    assert r.q_start == 3 and r.q_positions.tolist() == [13]
    assert r.own_tokens_hot  # the query's own token is the last hot one


def test_all_stale_prefix_with_new_tokens():
    """A later prefill chunk: the cached prefix is all TQ3, the new tokens are hot."""
    fmt, phys = _table({0: (FMT_TQ3, 1), 1: (FMT_TQ3, 2), 2: (FMT_HOT, 3)})
    r = plan_request(_slots(0, 1, 2, length=11), fmt, phys, PS, q_start=0, q_len=3)
    assert r.tq3_pages.tolist() == [1, 2]
    assert r.tq3_page_starts.tolist() == [0, 4]
    assert r.hot_positions.tolist() == [8, 9, 10]
    assert r.q_positions.tolist() == [8, 9, 10]
    assert r.own_tokens_hot


def test_own_tokens_hot_only_when_every_query_token_is_hot():
    # the ops' unmasked path needs the queries' tokens to be the last hot ones: a query token on a
    # TQ3 page (not a state serving reaches: pages convert once sealed) takes the masked path
    fmt, phys = _table({0: (FMT_HOT, 1), 1: (FMT_TQ3, 2), 2: (FMT_HOT, 3)})
    slots = _slots(0, 1, 2, length=10)
    assert plan_request(slots, fmt, phys, PS, q_start=0, q_len=2).own_tokens_hot
    assert not plan_request(slots, fmt, phys, PS, q_start=0, q_len=3).own_tokens_hot


def test_batch_packs_queries_and_sums_counts():
    fmt, phys = _table({0: (FMT_TQ3, 1), 1: (FMT_HOT, 1), 2: (FMT_HOT, 2), 3: (FMT_HOT, 3)})
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    req_to_token[1, :6] = _slots(0, 1, length=6)  # shares page 0 (TQ3) with row 3
    req_to_token[3, :10] = _slots(0, 2, 3, length=10)
    plan = plan_batch(req_to_token, [3, 1], kv_lens=[10, 6], q_lens=[6, 1], fmt=fmt, phys=phys, page_size=PS)
    a, b = plan.requests
    assert (a.q_start, a.q_len, a.kv_len) == (0, 6, 10)
    assert (b.q_start, b.q_len, b.kv_len) == (6, 1, 6)
    assert a.tq3_pages.tolist() == b.tq3_pages.tolist() == [1]
    assert plan.counts == RouteCounts(hot_pages=3, hot_tokens=8, tq3_pages=2, tq3_tokens=8)
    assert plan.counts + plan.counts == RouteCounts(6, 16, 4, 16)


def test_rejects_unknown_format_tag():
    fmt, phys = _table({0: (5, 1)})
    with pytest.raises(ValueError, match="unknown format tags \\[5\\]"):
        plan_request(_slots(0, length=3), fmt, phys, PS, q_start=0, q_len=1)


def test_rejects_misaligned_tq3_page():
    fmt, phys = _table({1: (FMT_TQ3, 1)})
    slots = torch.tensor([0, 6, 7, 4], dtype=torch.int32)  # position 1 at offset 2 of logical page 1
    with pytest.raises(ValueError, match="page-aligned"):
        plan_request(slots, fmt, phys, PS, q_start=0, q_len=1)


@pytest.mark.parametrize("q_len", [0, 4])
def test_rejects_bad_query_length(q_len):
    fmt, phys = _table({})
    with pytest.raises(ValueError, match="q_len"):
        plan_request(_slots(0, length=3), fmt, phys, PS, q_start=0, q_len=q_len)


def test_rejects_disagreeing_batch_fields():
    fmt, phys = _table({})
    with pytest.raises(ValueError, match="disagree"):
        plan_batch(torch.zeros(2, 8, dtype=torch.int32), [1], [3, 4], [1, 1], fmt, phys, PS)
