"""Transient scratch: the tensors an attention op or a conversion allocates beside the KV cache
(decoded K/V tiles, a tile's scores, conversion staging), measured while they are alive.

An op calls ``note(*tensors)`` with the tensors it just allocated for a tile. Inside a ``measure()``
block each noted tensor counts as live from then until Python frees it (``weakref.finalize``), and
the meter keeps the high-water mark of the live bytes; outside one, ``note`` does nothing. Tensors
that live only inside one expression (a gather fed straight to a cast) or inside one codec call
(encode/decode internals) are not noted. The figure says how
much memory a step needs besides the cache, and that it is one tile, not a dense copy of the cache.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class ScratchMeter:
    live_bytes: int = 0
    peak_bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


_meter: ContextVar[ScratchMeter | None] = ContextVar("minima_scratch_meter", default=None)


def note(*tensors: torch.Tensor | None) -> None:
    """Count freshly allocated tensors (None is skipped) as live scratch until each is freed."""
    meter = _meter.get()
    if meter is None:
        return
    for t in tensors:
        if t is not None:
            nbytes = t.numel() * t.element_size()
            meter.add(nbytes)
            weakref.finalize(t, meter.free, nbytes)


@contextmanager
def measure() -> Iterator[ScratchMeter]:
    """Meter the scratch noted inside the block; an enclosing meter sees the same high-water mark."""
    meter = ScratchMeter()
    token = _meter.set(meter)
    try:
        yield meter
    finally:
        _meter.reset(token)
        outer = _meter.get()
        if outer is not None:
            outer.peak_bytes = max(outer.peak_bytes, outer.live_bytes + meter.peak_bytes)
