"""Route counters kept on the device, for forwards that cannot read anything back: CUDA graphs.

An eager step counts the pages and tokens it reads on the host (``TieredPageStore.note_read``). A
captured decode step runs no Python at replay, so its plan adds its counts to one device tensor
inside the graph (``count``), cumulative since start. ``fold`` brings them into ``MinimaStats``
without stalling the forward stream: it copies the totals to pinned memory behind an event and adds
what the previous copy saw once that event has completed (the counters lag a step or two); with
``wait`` (idle scheduler, /server_info) it syncs the device and reads them exactly.
"""

from __future__ import annotations

import torch

from sglang_minima.mem_cache.page_table import PageTable
from sglang_minima.mem_cache.stats import MinimaStats

_FIELDS = ("route_hot_pages", "route_hot_tokens", "route_tq3_pages", "route_tq3_tokens")


class DeviceRouteCounter:
    def __init__(self, device: torch.device):
        self.device = device
        self.totals = torch.zeros(len(_FIELDS), dtype=torch.int64, device=device)
        self._pinned = device.type == "cuda"
        self._host = torch.zeros(len(_FIELDS), dtype=torch.int64, pin_memory=self._pinned)
        self._event = None  # the pending copy's
        self._seen = [0] * len(_FIELDS)  # the totals already in the stats
        self._dirty = False  # a counting step ran since the last copy

    def count(self, page_table: PageTable, logical_pages: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Add a step's routes (graph-recordable: fixed shapes, no host read). ``logical_pages``
        int64 [batch, max_pages] (0 past a request's end), ``tokens`` int64 [2] (hot, TQ3 tokens),
        ``rows`` bool [batch]: the real requests (a graph batch's padding rows read page 0)."""
        pages = page_table.format_counts(logical_pages, rows.unsqueeze(1))
        self.totals += torch.stack([pages[0], tokens[0], pages[1], tokens[1]])

    def mark_step(self) -> None:
        """A counting step was launched (called on the host before each replay)."""
        self._dirty = True

    def fold(self, stats: MinimaStats, *, wait: bool = False) -> None:
        """Add the counts not yet in ``stats``: those of the last completed copy (then start a new
        one), or with ``wait`` all of them, after a device sync."""
        if wait:
            if self._dirty or self._event is not None:
                torch.get_device_module(self.device).synchronize()
                self._take(stats, self.totals.tolist())
                self._event, self._dirty = None, False
            return
        if self._event is not None:
            if not self._event.query():
                return
            self._take(stats, self._host.tolist())
            self._event = None
        if self._dirty and self._pinned:
            self._host.copy_(self.totals, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._dirty = False

    def _take(self, stats: MinimaStats, totals: list[int]) -> None:
        for i, (name, total) in enumerate(zip(_FIELDS, totals)):
            if total > self._seen[i]:  # cumulative: a later snapshot never says less
                setattr(stats, name, getattr(stats, name) + total - self._seen[i])
                self._seen[i] = total
