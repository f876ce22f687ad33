"""The Minima page table: logical page -> (format, physical page), plus per-page lifecycle facts.

SGLang's slot ids stay logical; ``slot // page_size`` is a logical page. Logical page 0 is SGLang's
padding page (dummy writes land there); it maps to hot physical page 0, which is padding too.
Every tensor is indexed by logical page id, ``[num_logical_pages + 1]``.
"""

from __future__ import annotations

import torch

FMT_HOT = 0
"""Recent/Anchor pages: FP8 e4m3 (or the model dtype with ``hot_dtype=auto``)."""
FMT_TQ3 = 1
"""Stale pages: TQ3P packed."""

TIER_NONE = 0
"""Not held by a live request (cached prefix only) or not classified yet."""
TIER_STALE = 1
TIER_ANCHOR = 2
TIER_RECENT = 3
TIER_NAMES = {TIER_NONE: "cached", TIER_STALE: "stale", TIER_ANCHOR: "anchor", TIER_RECENT: "recent"}

UNMAPPED = 0
"""``phys`` of a logical page with no physical page (free, or the padding page)."""


class PageTable:
    """Logical page -> (fmt, phys), and what the controller needs to know about each page.

    ``fmt`` / ``phys`` are the read interface of attention backends. The rest is lifecycle state:
    ``fill`` (tokens written; a page with ``fill == page_size`` is sealed: full and immutable; kept
    per physical hot page, ``hot_fill``), ``tier`` (the controller's last classification), ``birth`` (the step the page was mapped, for
    age order), ``score`` (EWMA of the page's globally normalized attention mass) and ``window_mass``
    (the attention mass of the last observation window that read the page: ``anchor_window``).
    """

    def __init__(self, num_logical_pages: int, page_size: int, device: torch.device | str = "cpu",
                 num_hot_pages: int | None = None):
        n = num_logical_pages + 1
        self.num_logical_pages = num_logical_pages
        self.page_size = page_size
        self.fmt = torch.full((n,), FMT_HOT, dtype=torch.int8, device=device)
        self.phys = torch.zeros(n, dtype=torch.int32, device=device)
        # Tokens written into each physical hot page (page 0: padding), by the forward that wrote them.
        # Per physical page, not logical: under SGLang's overlap scheduler a forward still in flight may
        # find its logical page freed and mapped again (a chunked request's duplicate pages, an abort);
        # its late write then raises the fill of the physical page it wrote, which the release quarantine
        # keeps from any new owner, never the fill of the new owner's page.
        hot = num_logical_pages if num_hot_pages is None else num_hot_pages
        self.hot_fill = torch.zeros(hot + 1, dtype=torch.int32, device=device)
        self.tier = torch.zeros(n, dtype=torch.int8, device=device)
        self.birth = torch.zeros(n, dtype=torch.int64, device=device)
        self.score = torch.zeros(n, dtype=torch.float32, device=device)
        self.window_mass = torch.zeros(n, dtype=torch.float32, device=device)

    @property
    def mapped(self) -> torch.Tensor:
        """bool [n]: logical pages backed by a physical page."""
        return self.phys != UNMAPPED

    @property
    def fill(self) -> torch.Tensor:
        """int32 [n]: tokens written per logical page (a TQ3 page is full, an unmapped one empty)."""
        hot = self.hot_fill[torch.where(self.fmt == FMT_HOT, self.phys, 0).long()]
        return torch.where(self.mapped, torch.where(self.fmt == FMT_HOT, hot, self.page_size), 0)

    @property
    def sealed(self) -> torch.Tensor:
        """bool [n]: mapped pages whose every slot has been written."""
        return self.fill == self.page_size

    def map(self, pages: torch.Tensor, fmt: int, phys: torch.Tensor, step: int) -> None:
        """Bind freshly allocated logical pages to physical pages (nothing written yet). The physical
        pages come from a free list, past the release quarantine: no forward in flight writes them."""
        self.fmt[pages] = fmt
        self.phys[pages] = phys.to(torch.int32)
        if fmt == FMT_HOT:
            self.hot_fill[phys.long()] = 0
        self.tier[pages] = TIER_RECENT
        self.birth[pages] = step
        self.score[pages] = 0.0
        self.window_mass[pages] = 0.0

    def publish(self, pages: torch.Tensor, fmt: int, phys: torch.Tensor) -> None:
        """Point already-mapped logical pages at a new (format, physical page): one conversion's commit
        (only sealed pages convert: a promoted page is full)."""
        self.fmt[pages] = fmt
        self.phys[pages] = phys.to(torch.int32)
        if fmt == FMT_HOT:
            self.hot_fill[phys.long()] = self.page_size

    def unmap(self, pages: torch.Tensor) -> None:
        self.fmt[pages] = FMT_HOT
        self.phys[pages] = UNMAPPED  # its physical page's fill is reset when the page is mapped again
        self.tier[pages] = TIER_NONE
        self.score[pages] = 0.0
        self.window_mass[pages] = 0.0

    def format_counts(self, logical_pages: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [2]: the mapped pages among ``logical_pages`` (any shape; where the bool ``keep``,
        broadcast to it, is set) that are hot and TQ3: a route's pages by format. Fixed shapes."""
        mapped = self.phys[logical_pages] != UNMAPPED
        if keep is not None:
            mapped = mapped & keep
        fmt = self.fmt[logical_pages]
        return torch.stack([(mapped & (fmt == FMT_HOT)).sum(), (mapped & (fmt == FMT_TQ3)).sum()])

    def note_written(self, hot_slots: torch.Tensor) -> None:
        """Record writes to physical hot slots (``hot_slots``' translation of the written logical slots;
        pages fill in order, so fill = max offset + 1). The pool calls it after the last layer's write
        of the slots, so ``sealed`` implies every layer."""
        pages = torch.div(hot_slots, self.page_size, rounding_mode="floor")
        ends = (hot_slots - pages * self.page_size + 1).to(torch.int32)
        self.hot_fill.scatter_reduce_(0, pages, ends, reduce="amax")

    def hot_slots(self, logical_slots: torch.Tensor) -> torch.Tensor:
        """Physical slots in the hot buffers of logical slots on hot pages (int64)."""
        slots = logical_slots.to(torch.int64)
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        return self.phys[pages].to(torch.int64) * self.page_size + (slots - pages * self.page_size)
