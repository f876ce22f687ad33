"""Route planning for Minima attention: logical KV slots + the page table -> per-format index arrays.

SGLang hands attention one row of *logical* slot ids per request (``req_to_token``); Minima's page
table maps each logical page (``slot // page_size``) to a format tag and a physical page. This module
turns one batch into what the attention ops read, per request:

- hot (FP8 e4m3, or the model dtype): physical token slots of the hot K/V buffers
  (``phys * page_size + slot % page_size``) and the position of each token in the sequence;
- TQ3: physical page ids of the TQ3 buffer (a TQ3 page is always read whole) and the position of
  each page's first token, so the op can mask tokens by position.

It has no sglang import (the page table's format tags come from mem_cache.page_table, which has
none either): the backend pulls plain tensors out of the ForwardBatch and calls
``plan_batch``; the tests build page tables by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.host_copy import to_device


@dataclass(frozen=True)
class RequestRoute:
    """Where one request's queries and KV live, split by format.

    The queries are rows ``q_start : q_start + q_len`` of the batch's query tensor and sit at
    positions ``kv_len - q_len .. kv_len - 1``; they attend every KV position up to their own.
    """

    q_start: int
    q_len: int
    kv_len: int
    hot_slots: torch.Tensor
    """int64 [n_hot]: physical token slots in the hot K/V buffers."""
    hot_positions: torch.Tensor
    """int64 [n_hot]: sequence position of each hot token."""
    tq3_pages: torch.Tensor
    """int64 [n_tq3_pages]: physical page ids in the TQ3 buffer."""
    tq3_page_starts: torch.Tensor
    """int64 [n_tq3_pages]: sequence position of token 0 of each TQ3 page."""
    logical_pages: torch.Tensor
    """int64 [n_pages]: the distinct logical pages read, in position order (for the route counters)."""
    num_hot_pages: int
    num_tq3_tokens: int
    own_tokens_hot: bool
    """Whether the queries' own tokens are the last ``q_len`` hot tokens (an extend writes its new
    tokens hot): the ops then attend them causally and everything before unmasked (``own_tail``)."""

    @property
    def q_positions(self) -> torch.Tensor:
        """int64 [q_len]: sequence positions of this request's queries."""
        return torch.arange(
            self.kv_len - self.q_len, self.kv_len, dtype=torch.int64, device=self.hot_slots.device
        )

    @property
    def num_hot_tokens(self) -> int:
        return int(self.hot_slots.numel())

    @property
    def num_tq3_pages(self) -> int:
        return int(self.tq3_pages.numel())


@dataclass(frozen=True)
class RouteCounts:
    """Pages and tokens attended per format in one forward step (summed over requests)."""

    hot_pages: int = 0
    hot_tokens: int = 0
    tq3_pages: int = 0
    tq3_tokens: int = 0

    def __add__(self, other: RouteCounts) -> RouteCounts:
        return RouteCounts(
            hot_pages=self.hot_pages + other.hot_pages,
            hot_tokens=self.hot_tokens + other.hot_tokens,
            tq3_pages=self.tq3_pages + other.tq3_pages,
            tq3_tokens=self.tq3_tokens + other.tq3_tokens,
        )


@dataclass(frozen=True)
class BatchRoute:
    """The routes of every request of one forward batch, in batch order."""

    requests: tuple[RequestRoute, ...]

    @property
    def logical_pages(self) -> torch.Tensor:
        """int64: the logical pages each request reads, concatenated (shared pages repeat)."""
        if not self.requests:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([r.logical_pages for r in self.requests])

    @property
    def counts(self) -> RouteCounts:
        return RouteCounts(
            hot_pages=sum(r.num_hot_pages for r in self.requests),
            hot_tokens=sum(r.num_hot_tokens for r in self.requests),
            tq3_pages=sum(r.num_tq3_pages for r in self.requests),
            tq3_tokens=sum(r.num_tq3_tokens for r in self.requests),
        )


def plan_request(
    logical_slots: torch.Tensor,
    fmt: torch.Tensor,
    phys: torch.Tensor,
    page_size: int,
    *,
    q_start: int,
    q_len: int,
) -> RequestRoute:
    """Split one request's logical slots (positions ``0 .. len-1``) into hot slots and TQ3 pages.

    ``fmt`` (int8) and ``phys`` (int32) are the page table, indexed by logical page.
    """
    kv_len = int(logical_slots.numel())
    if not 0 < q_len <= kv_len:
        raise ValueError(f"need 0 < q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    slots = logical_slots.to(torch.int64)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    tags = fmt[pages]
    is_hot = tags == FMT_HOT
    is_tq3 = tags == FMT_TQ3
    if not bool((is_hot | is_tq3).all()):
        bad = torch.unique(tags[~(is_hot | is_tq3)]).tolist()
        raise ValueError(f"page table holds unknown format tags {bad}")
    positions = torch.arange(kv_len, dtype=torch.int64, device=slots.device)
    page_start = torch.ones_like(pages, dtype=torch.bool)
    page_start[1:] = pages[1:] != pages[:-1]

    hot_slots = phys[pages[is_hot]].to(torch.int64) * page_size + offsets[is_hot]

    # A TQ3 page is read whole by physical id, so token j of the page must sit at position start + j:
    # SGLang's paged allocator keeps slot % page_size == position % page_size.
    tq3_offsets = offsets[is_tq3]
    tq3_positions = positions[is_tq3]
    if not torch.equal(tq3_offsets, tq3_positions % page_size):
        raise ValueError("a TQ3 page's slots are not page-aligned with the request's positions")
    first = page_start[is_tq3]
    tq3_pages = phys[pages[is_tq3][first]].to(torch.int64)
    tq3_page_starts = tq3_positions[first] - tq3_offsets[first]

    return RequestRoute(
        q_start=q_start,
        q_len=q_len,
        kv_len=kv_len,
        hot_slots=hot_slots,
        hot_positions=positions[is_hot],
        tq3_pages=tq3_pages,
        tq3_page_starts=tq3_page_starts,
        logical_pages=pages[page_start],
        num_hot_pages=int((page_start & is_hot).sum()),
        num_tq3_tokens=int(tq3_positions.numel()),
        own_tokens_hot=bool(is_hot[kv_len - q_len:].all()),
    )


def plan_batch(
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    fmt: torch.Tensor,
    phys: torch.Tensor,
    page_size: int,
) -> BatchRoute:
    """Plan every request of a batch; queries are packed in batch order (SGLang's layout).

    ``req_to_token[req_pool_indices[i], :kv_lens[i]]`` are request i's logical slots and its last
    ``q_lens[i]`` tokens are its queries (1 in decode, the extend length in extend/prefill).
    """
    if not len(req_pool_indices) == len(kv_lens) == len(q_lens):
        raise ValueError(
            f"batch fields disagree: {len(req_pool_indices)} rows, {len(kv_lens)} kv_lens, {len(q_lens)} q_lens"
        )
    routes = []
    q_start = 0
    for row, kv_len, q_len in zip(req_pool_indices, kv_lens, q_lens):
        routes.append(
            plan_request(
                req_to_token[int(row), : int(kv_len)], fmt, phys, page_size,
                q_start=q_start, q_len=int(q_len),
            )
        )
        q_start += int(q_len)
    return BatchRoute(requests=tuple(routes))


@dataclass(frozen=True)
class Tq3Prefix:
    """One request's TQ3 pages and the query rows that attend them (all of its queries), or those of
    consecutive requests that read the same TQ3 pages (a shared prefix: ``forward_plan.split_extend``)."""

    q_start: int
    q_len: int
    pages: torch.Tensor
    """int64 [n]: physical TQ3 page ids, on the pool's device."""


@dataclass(frozen=True)
class ExtendPlan:
    """An extend, chunked-prefill or mixed batch as the GPU prefill reads it (``plan_extend``).

    Three disjoint key sets per request, each attended by every one of its queries as noted, then
    merged by LSE: its new tokens (causal, the forward's own K/V, as SGLang's flashinfer backend
    attends them), the hot tokens before them (all visible: one token per "page", the hot buffers'
    physical slots) and its TQ3 pages (all visible: a TQ3 page is sealed, so it precedes every
    query of the request).
    """

    qo_indptr: torch.Tensor
    """int32 [B + 1] on the host: query rows (= new tokens) per request."""
    prefix_indptr: torch.Tensor
    """int32 [B + 1] on the host: hot prefix tokens per request."""
    prefix_slots: torch.Tensor
    """int32 [prefix_indptr[-1]], on the pool's device: their physical slots, in position order."""
    prefix_rows: torch.Tensor | None
    """bool [T] on the device: the query rows whose request has a hot prefix; None when all do."""
    tq3: tuple[Tq3Prefix, ...]
    """The requests that read TQ3 pages, in batch order (``split_extend``: consecutive ones reading the
    same pages as one)."""

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.prefix_indptr[-1])


def plan_extend(route: BatchRoute, page_size: int) -> ExtendPlan:
    """Split each request's keys into new tokens, hot prefix and TQ3 pages (see ExtendPlan).

    The new tokens are the last ``q_len`` hot tokens: SGLang writes them to pages the allocator
    maps hot, and a page being filled is never converted. Raises ValueError where a TQ3 page does
    not lie wholly before the request's queries (then this plan would let queries see their future).
    """
    requests = route.requests
    device = requests[0].hot_slots.device if requests else torch.device("cpu")
    q_lens = [r.q_len for r in requests]
    prefix_lens = [r.num_hot_tokens - r.q_len for r in requests]
    for r, n in zip(requests, prefix_lens):
        if n < 0:
            raise ValueError(f"an extend's {r.q_len} new tokens are not all on hot pages ({r.num_hot_tokens} hot tokens)")
    tq3 = tuple(r for r in requests if r.num_tq3_pages)
    if tq3:  # one host read for the batch: where each request's last TQ3 page ends
        ends = torch.stack([r.tq3_page_starts[-1] for r in tq3]).tolist()
        for r, start in zip(tq3, ends):
            check_tq3_before_queries(start, r.kv_len, r.q_len, page_size)
    prefix_slots = [r.hot_slots[:n] for r, n in zip(requests, prefix_lens)]
    return ExtendPlan(
        qo_indptr=host_indptr(q_lens),
        prefix_indptr=host_indptr(prefix_lens),
        prefix_slots=(torch.cat(prefix_slots) if prefix_slots else torch.zeros(0, dtype=torch.int64, device=device)).to(
            torch.int32
        ),
        prefix_rows=prefix_row_mask(prefix_lens, q_lens, device),
        tq3=tuple(Tq3Prefix(r.q_start, r.q_len, r.tq3_pages) for r in tq3),
    )


def check_tq3_before_queries(last_page_start: int, kv_len: int, q_len: int, page_size: int) -> None:
    """Raise ValueError where a request's last TQ3 page (its first position given) is not wholly
    before its queries: the split would let queries see their future."""
    if last_page_start + page_size > kv_len - q_len:
        raise ValueError(
            f"a TQ3 page (positions {last_page_start}..{last_page_start + page_size - 1}) overlaps the new "
            f"tokens of a request at {kv_len - q_len}..{kv_len - 1}"
        )


def host_indptr(lengths: Sequence[int]) -> torch.Tensor:
    """int32 [len + 1] on the host: the running sum of ``lengths``, from 0."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
    return out


def prefix_row_mask(prefix_lens: Sequence[int], q_lens: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """ExtendPlan.prefix_rows: bool [T], each query row's request has a hot prefix; None when all
    or none do (then no row needs masking)."""
    if not (any(n == 0 for n in prefix_lens) and any(prefix_lens)):
        return None
    return to_device([n > 0 for n, q in zip(prefix_lens, q_lens) for _ in range(q)], torch.bool, device)

