"""One format's physical pages: a free list, a reference count per page and the release quarantine.

A physical page's count covers the logical page mapping it (1) and each in-flight conversion that
copies from or into it. Page 0 is padding and never handed out.

The release quarantine: a page whose count reaches 0 returns to the free list two ``end_step``
calls later, not at once. ``end_step`` runs once per scheduler step, after a step's result is
processed. A forward reads the pages its plan named when it was launched; under SGLang's overlap
scheduler one forward is in flight while the previous result is processed, which is where SGLang
frees finished requests' pages and the controller converts pages. A page freed between two
``end_step`` calls may still be read by the forward in flight then, and that forward is done by
the next ``end_step`` (its own result has been processed). Nothing tracks reads: the forward path
takes no reference, so it needs no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Callable

import torch


class PhysicalPagePool:
    def __init__(self, num_pages: int, name: str, on_free: Callable[[list[int]], None] | None = None):
        self.num_pages = num_pages
        self.name = name
        self.on_free = on_free  # called with the pages each time some return to the free list (a debug poison)
        self.refcount = torch.zeros(num_pages + 1, dtype=torch.int32)
        # A stack popping the lowest ids first keeps used pages dense at the start of the buffer.
        self._free: list[int] = list(range(num_pages, 0, -1))
        self._freed: list[int] = []  # count 0 since the last end_step: the forward in flight may read them
        self._cooling: list[int] = []  # count 0 since the end_step before: free at the next one
        self.peak_held = 0
        """The most pages held at once since start (quarantined ones included: they take memory):
        what a workload needed of this format, against ``num_pages`` (--minima-fp8-page-fraction)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Pages not on the free list (mapped, converting or quarantined)."""
        return self.num_pages - len(self._free)

    @property
    def num_quarantined(self) -> int:
        """Pages with count 0 not yet back on the free list."""
        return len(self._freed) + len(self._cooling)

    def end_step(self) -> None:
        """A step's result is processed: the pages freed before the previous call are free."""
        self._to_free(sorted(self._cooling, reverse=True))
        self._cooling, self._freed = self._freed, []

    def drain(self) -> None:
        """Every quarantined page is free; the caller has synchronized the device first."""
        self._to_free(sorted(self._cooling + self._freed, reverse=True))
        self._cooling, self._freed = [], []

    def _to_free(self, pages: list[int]) -> None:
        if pages and self.on_free is not None:
            self.on_free(pages)
        self._free.extend(pages)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` pages with count 1 (int64), or None when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self.peak_held = max(self.peak_held, self.num_held)
        pages = torch.tensor(taken, dtype=torch.int64)
        self.refcount[pages] = 1
        return pages

    def retain(self, pages: torch.Tensor) -> None:
        """Add one reference per occurrence (a page may appear several times)."""
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64).cpu()
        if bool((self.refcount[pages] <= 0).any()):
            raise RuntimeError(f"{self.name}: retain of a free physical page")
        self.refcount.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))

    def release(self, pages: torch.Tensor, *, unread: bool = False) -> None:
        """Drop one reference per occurrence; pages reaching 0 go to the quarantine, or with
        ``unread`` (pages no forward can have read: a failed conversion's destinations) straight
        back to the free list."""
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64).cpu()
        self.refcount.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
        touched = torch.unique(pages)
        counts = self.refcount[touched]
        if bool((counts < 0).any()):
            raise RuntimeError(f"{self.name}: physical page released more times than referenced")
        released = touched[counts == 0].tolist()
        if unread:
            self._to_free(released)
        else:
            self._freed.extend(released)

    def mismatches(self, expected: torch.Tensor) -> int:
        """Pages whose count is not ``expected`` (int [num_pages + 1], what their owners hold), or
        whose place on the free list or in the quarantine disagrees with a count of 0, or that
        are listed there twice."""
        unreferenced = self._free + self._freed + self._cooling
        listed = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        listed[unreferenced] = True
        wrong = self.refcount != expected.to(self.refcount.dtype)
        wrong[1:] |= listed[1:] != (self.refcount[1:] == 0)
        return int(wrong.sum()) + len(unreferenced) - len(set(unreferenced))

    def reset(self) -> None:
        self.refcount.zero_()
        self._free, self._freed, self._cooling = [], [], []
        self._to_free(list(range(self.num_pages, 0, -1)))
