"""Reader epochs: the physical pages an in-flight forward reads stay allocated until it is done.

The attention backend reports the pages a forward reads (``note``) once per forward; they are
tagged with the current epoch and retained in their pools. ``end_step`` runs once per scheduler
step, after the step's result is processed: the forward of that step has finished, so its epoch's
holds are released. With the overlap scheduler the *next* forward is already in flight when a
step's result is processed, so holds are released one epoch later (``lag=1``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from sglang_minima.mem_cache.physical_pool import PhysicalPagePool


@dataclass(frozen=True)
class _Hold:
    epoch: int
    hot: torch.Tensor
    tq3: torch.Tensor


class ReaderHolds:
    def __init__(self, hot_pool: PhysicalPagePool, tq3_pool: PhysicalPagePool, lag: int):
        self.hot_pool = hot_pool
        self.tq3_pool = tq3_pool
        self.lag = lag
        self.epoch = 0
        self._holds: deque[_Hold] = deque()

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def held_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hot and TQ3 physical pages of every epoch still held, one entry per reference (int64)."""
        empty = torch.empty(0, dtype=torch.int64)
        hot = [h.hot.to(torch.int64) for h in self._holds]
        tq3 = [h.tq3.to(torch.int64) for h in self._holds]
        return torch.cat([empty, *hot]), torch.cat([empty, *tq3])

    def note(self, hot_phys: torch.Tensor, tq3_phys: torch.Tensor) -> None:
        self.hot_pool.retain(hot_phys)
        self.tq3_pool.retain(tq3_phys)
        self._holds.append(_Hold(self.epoch, hot_phys.cpu(), tq3_phys.cpu()))

    def end_step(self) -> None:
        """The step's result is processed: release the epochs whose forwards are done."""
        self._release_through(self.epoch - self.lag)
        self.epoch += 1

    def drain(self) -> None:
        """Release every hold; the caller has synchronized the device first."""
        self._release_through(self.epoch)

    def _release_through(self, epoch: int) -> None:
        while self._holds and self._holds[0].epoch <= epoch:
            hold = self._holds.popleft()
            self.hot_pool.release(hold.hot)
            self.tq3_pool.release(hold.tq3)

    def reset(self) -> None:
        self._holds.clear()
