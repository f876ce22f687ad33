"""One format's physical pages: a free list and a reference count per page.

A physical page's count covers the logical page mapping it (1), each in-flight reader epoch that
read it, and each in-flight conversion that copies from or into it. The page goes back to the free
list when its count reaches 0. Page 0 is padding and never handed out.
"""

from __future__ import annotations

import torch


class PhysicalPagePool:
    def __init__(self, num_pages: int, name: str):
        self.num_pages = num_pages
        self.name = name
        self.refcount = torch.zeros(num_pages + 1, dtype=torch.int32)
        # A stack popping the lowest ids first keeps used pages dense at the start of the buffer.
        self._free: list[int] = list(range(num_pages, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Pages not on the free list (mapped, read or converting)."""
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` pages with count 1 (int64), or None when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
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

    def release(self, pages: torch.Tensor) -> None:
        """Drop one reference per occurrence; pages reaching 0 return to the free list."""
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64).cpu()
        self.refcount.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
        touched = torch.unique(pages)
        counts = self.refcount[touched]
        if bool((counts < 0).any()):
            raise RuntimeError(f"{self.name}: physical page released more times than referenced")
        self._free.extend(touched[counts == 0].tolist())

    def mismatches(self, expected: torch.Tensor) -> int:
        """Pages whose count is not ``expected`` (int [num_pages + 1], what their owners hold), or
        whose place on the free list disagrees with a count of 0, or that are listed free twice."""
        on_free_list = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        on_free_list[self._free] = True
        wrong = self.refcount != expected.to(self.refcount.dtype)
        wrong[1:] |= on_free_list[1:] != (self.refcount[1:] == 0)
        return int(wrong.sum()) + len(self._free) - len(set(self._free))

    def reset(self) -> None:
        self.refcount.zero_()
        self._free = list(range(self.num_pages, 0, -1))
