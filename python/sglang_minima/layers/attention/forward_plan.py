"""The per-format page plan of one forward batch, built on the device by fixed-shape torch ops.

Where ``plan.py`` walks requests one by one on the host (the checked reference), ``plan_forward``
turns the whole batch and the page table into per-format CSR page lists at once: no host sync, no
data-dependent shape, so it can run inside a captured CUDA graph (SGLang 0.5.23's
``init_forward_metadata_in_graph``) as well as on the CPU. Every output has a fixed capacity,
``batch * max_pages`` entries, the live ones first: ``*_indptr[-1]`` says how many are live.

Per request ``i`` (its tokens at positions ``0 .. kv_lens[i] - 1``, its page ``j`` holding positions
``j * page_size ..``; SGLang's paged allocator keeps every page of a request one logical page):

- hot pages: physical ids ``hot_pages[hot_indptr[i]:hot_indptr[i+1]]`` and their page numbers
  within the request ``hot_page_index[...]``, in position order. Only a request's last page can be
  partial, and it is always hot while written: ``hot_last_page_len[i]`` is the fill of the request's
  last hot page (FlashInfer's paged layout; ``last_page_len`` / ``last_page_hot`` say the rest);
- TQ3 pages (always full): ``tq3_pages`` / ``tq3_page_index`` the same way;
- queries: rows ``q_indptr[i] .. q_indptr[i+1]`` at the last ``q_lens[i]`` positions.

Padding rows of a graph batch (request row 0, SGLang's padding row, whose slots are all 0) plan
one hot page, physical page 0 (padding), of ``min(kv_len, page_size)`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from sglang_minima.layers.attention.plan import (
    ExtendPlan,
    Tq3Prefix,
    check_tq3_before_queries,
    host_indptr,
    prefix_row_mask,
)
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.host_copy import to_device


@dataclass(frozen=True)
class FormatPages:
    """One format's pages of a batch, CSR over requests; entries past ``indptr[-1]`` are padding (0)."""

    indptr: torch.Tensor
    """int32 [batch + 1]"""
    pages: torch.Tensor
    """int32 [capacity]: physical page ids in this format's buffer."""
    page_index: torch.Tensor
    """int32 [capacity]: each page's number within its request (its first position / page_size)."""

    @property
    def counts(self) -> torch.Tensor:
        """int32 [batch]: pages of this format per request."""
        return self.indptr[1:] - self.indptr[:-1]


@dataclass(frozen=True)
class ForwardPlan:
    """What both Minima attention ops read for one forward batch (all tensors on one device)."""

    page_size: int
    kv_lens: torch.Tensor
    """int32 [batch]"""
    q_indptr: torch.Tensor
    """int32 [batch + 1]"""
    hot: FormatPages
    tq3: FormatPages
    last_page_len: torch.Tensor
    """int32 [batch]: tokens in each request's last page."""
    last_page_hot: torch.Tensor
    """bool [batch]: whether that page is hot (always, while it is written)."""
    logical_pages: torch.Tensor
    """int64 [batch, max_pages]: the logical page of every page read, 0 past a request's end."""

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.numel())

    @property
    def max_pages(self) -> int:
        return int(self.logical_pages.shape[1])

    @property
    def hot_last_page_len(self) -> torch.Tensor:
        """int32 [batch]: tokens in each request's last hot page (FlashInfer's paged layout: every
        other hot page of a request is full)."""
        return torch.where(self.last_page_hot, self.last_page_len, torch.full_like(self.last_page_len, self.page_size))

    def read_pages(self) -> torch.Tensor:
        """int64: the logical pages each request reads, concatenated in batch and position order
        (a data-dependent shape: a host sync, for the route counters, not for a captured graph)."""
        return self.logical_pages[_live_pages(self.kv_lens, self.page_size, self.max_pages)[1]]

    def token_counts(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [2]: tokens attended in hot pages and in TQ3 pages, summed over the batch (over the
        requests where the bool [batch] ``rows`` is set: a graph batch's real ones)."""
        short = (self.page_size - self.last_page_len).to(torch.int64)  # the last page's empty slots
        tq3 = self.tq3.counts.to(torch.int64) * self.page_size - torch.where(self.last_page_hot, 0, short)
        hot = self.kv_lens.to(torch.int64) - tq3
        if rows is not None:
            hot, tq3 = hot * rows, tq3 * rows
        return torch.stack([hot.sum(), tq3.sum()])


def plan_forward(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    fmt: torch.Tensor,
    phys: torch.Tensor,
    page_size: int,
    max_pages: int,
) -> ForwardPlan:
    """Plan a batch: request ``i`` reads ``req_to_token[req_pool_indices[i], :kv_lens[i]]`` and its
    last ``q_lens[i]`` tokens are queries. ``fmt`` / ``phys`` are the page table (indexed by logical
    page). ``max_pages`` bounds every request's pages (the batch's, or the graph's, longest context
    in pages); requests longer than that are a caller error the shapes cannot show."""
    device = req_to_token.device
    batch = int(req_pool_indices.numel())
    kv_lens = kv_lens.to(device=device, dtype=torch.int32)
    num_pages, live = _live_pages(kv_lens, page_size, max_pages)
    j = torch.arange(max_pages, device=device, dtype=torch.int64)
    cols = (j * page_size).clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.to(device=device, dtype=torch.int64).unsqueeze(1), cols.unsqueeze(0)]
    logical = torch.where(live, torch.div(slots.to(torch.int64), page_size, rounding_mode="floor"), 0)
    tags = fmt[logical]
    page_phys = phys[logical]
    is_tq3 = live & (tags == FMT_TQ3)
    is_hot = live & (tags == FMT_HOT)
    hot = _csr(is_hot, page_phys, j)
    tq3 = _csr(is_tq3, page_phys, j)

    last = (num_pages - 1).clamp(min=0)
    last_page_hot = is_hot.gather(1, last.to(torch.int64).unsqueeze(1)).squeeze(1)
    last_page_len = kv_lens - last * page_size

    q_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    q_indptr[1:] = torch.cumsum(q_lens.to(device=device, dtype=torch.int32), 0)
    return ForwardPlan(page_size, kv_lens, q_indptr, hot, tq3, last_page_len, last_page_hot, logical)


def _live_pages(kv_lens: torch.Tensor, page_size: int, max_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages per request [batch], bool [batch, max_pages]: page j lies before the request's end)."""
    num_pages = torch.div(kv_lens + page_size - 1, page_size, rounding_mode="floor")
    j = torch.arange(max_pages, device=kv_lens.device)
    return num_pages, j.unsqueeze(0) < num_pages.unsqueeze(1)


def _csr(mask: torch.Tensor, page_phys: torch.Tensor, page_number: torch.Tensor) -> FormatPages:
    """Stable compaction of the ``mask``-ed pages of every row into one fixed-capacity list."""
    batch, max_pages = mask.shape
    capacity = batch * max_pages
    counts = mask.sum(dim=1, dtype=torch.int32)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=mask.device)
    indptr[1:] = torch.cumsum(counts, 0)
    rank = torch.cumsum(mask.to(torch.int32), dim=1) - 1
    # Masked-out entries go to one dump slot past the end: a scatter of fixed shape, no nonzero().
    dest = torch.where(mask, indptr[:-1].unsqueeze(1) + rank, capacity).to(torch.int64).flatten()
    pages = torch.zeros(capacity + 1, dtype=torch.int32, device=mask.device)
    index = torch.zeros(capacity + 1, dtype=torch.int32, device=mask.device)
    pages.scatter_(0, dest, page_phys.to(torch.int32).flatten())
    index.scatter_(0, dest, page_number.to(torch.int32).expand(batch, max_pages).flatten())
    return FormatPages(indptr, pages[:capacity], index[:capacity])


def split_extend(plan: ForwardPlan, q_lens: Sequence[int], kv_lens: Sequence[int], *, tq3_possible: bool = True) -> ExtendPlan:
    """``plan.plan_extend``'s split (new tokens, hot prefix, TQ3 pages) from the forward plan of an
    extend batch (``plan_forward`` with its extend lengths as ``q_lens``), with one host read for the
    whole batch: each request's TQ3 page count and its last TQ3 page, where the per-request planner
    reads the device several times per request; consecutive requests reading the same TQ3 pages (a
    shared prefix) share one ``Tq3Prefix`` over their rows, where ``plan_extend`` keeps one each.
    ``q_lens`` / ``kv_lens`` are SGLang's host lists.
    ``tq3_possible=False`` (the caller knows no page is TQ3: the pool holds none) skips the read, so
    the split waits for nothing on the device. Raises ValueError where plan_extend does (a TQ3 page
    not wholly before its request's queries)."""
    p, batch, device = plan.page_size, plan.batch_size, plan.kv_lens.device
    if tq3_possible:
        at = (plan.tq3.indptr[1:] - 1).clamp(min=0).to(torch.int64)
        # the one host read: each request's TQ3 page count, its last TQ3 page's number and physical id
        n_tq3, last_page, last_phys = torch.stack(
            [plan.tq3.counts, plan.tq3.page_index[at], plan.tq3.pages[at]]
        ).cpu().tolist()
    else:
        n_tq3 = last_page = last_phys = [0] * batch
    prefix_lens = []
    for n, page, kv_len, q_len in zip(n_tq3, last_page, kv_lens, q_lens):
        if n:
            check_tq3_before_queries(page * p, kv_len, q_len, p)
        prefix_lens.append(kv_len - q_len - n * p)  # TQ3 pages are full and all before the queries
    prefix_indptr = host_indptr(prefix_lens)
    total = int(prefix_indptr[-1])

    # The hot prefix's token slots in position order: hot page e (of request req, its k-th) holds the
    # prefix tokens req's list keeps at k * p + offset (only the page the queries start in is partial).
    cap = plan.hot.pages.numel()
    e = torch.arange(cap, device=device)
    hot_indptr = plan.hot.indptr.to(torch.int64)
    req = torch.searchsorted(hot_indptr[1:], e, right=True).clamp(max=batch - 1)
    live = e < hot_indptr[-1]
    offset = torch.arange(p, device=device)
    position = plan.hot.page_index.to(torch.int64).unsqueeze(1) * p + offset
    prefix_end = to_device([k - q for k, q in zip(kv_lens, q_lens)], torch.int64, device)
    keep = live.unsqueeze(1) & (position < prefix_end[req].unsqueeze(1))
    rank = (e - hot_indptr[req]).unsqueeze(1) * p + offset
    dest = torch.where(keep, to_device(prefix_indptr.tolist(), torch.int64, device)[req].unsqueeze(1) + rank, total)
    slots = torch.zeros(total + 1, dtype=torch.int32, device=device)
    slots.scatter_(0, dest.flatten(), (plan.hot.pages.to(torch.int32).unsqueeze(1) * p + offset.to(torch.int32)).flatten())

    qo_indptr = host_indptr(q_lens)
    q_starts, tq3_starts = qo_indptr.tolist(), host_indptr(n_tq3).tolist()
    # Consecutive requests whose last TQ3 page is the same physical page read the same TQ3 pages (a
    # page holds fixed positions of one radix prefix, so the pages before it are shared too, in the
    # same formats): one prefix over their query rows, whose tile the prefill decodes once.
    tq3: list[Tq3Prefix] = []
    for i in range(batch):
        if not n_tq3[i]:
            continue
        if i and (n_tq3[i - 1], last_phys[i - 1]) == (n_tq3[i], last_phys[i]):
            tq3[-1] = replace(tq3[-1], q_len=tq3[-1].q_len + int(q_lens[i]))
            continue
        tq3.append(Tq3Prefix(q_starts[i], int(q_lens[i]), plan.tq3.pages[tq3_starts[i] : tq3_starts[i + 1]].to(torch.int64)))
    return ExtendPlan(
        qo_indptr=qo_indptr, prefix_indptr=prefix_indptr, prefix_slots=slots[:total],
        prefix_rows=prefix_row_mask(prefix_lens, q_lens, device), tq3=tuple(tq3),
    )

