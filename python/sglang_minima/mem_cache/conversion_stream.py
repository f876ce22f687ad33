"""Where the store's page conversions run: a stream of their own, off the forward path.

``launch(copy)`` enqueues a conversion's copy (every layer) and returns a handle; ``done(handle)``
says, without waiting, whether the copy has finished; ``wait(handle)`` waits for it. The store
publishes a conversion's new (format, page) only once it is done (copy before publish), so the
pending/publish logic is one code path on every device:

- ``ConversionStream`` (CPU): the copy runs at once, so every conversion is done when launched;
- ``CudaConversionStream``: the copy runs on a side stream, behind the work already enqueued on the
  current stream (the forwards that wrote the source pages), and its event is the handle. Nothing
  here waits on the host; the forward path never calls it.

Tests hold conversions pending on CPU with a stream whose ``done`` they control (store_helpers.py).
"""

from __future__ import annotations

from typing import Callable

import torch


class ConversionStream:
    """The host: a copy is done when ``launch`` returns."""

    def launch(self, copy: Callable[[], None]) -> object:
        copy()
        return None

    def done(self, handle: object) -> bool:
        return True

    def wait(self, handle: object) -> None:
        pass


class CudaConversionStream(ConversionStream):
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def launch(self, copy: Callable[[], None]) -> torch.cuda.Event:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the source pages' bytes were written by work enqueued there
        try:
            with torch.cuda.stream(self.stream):
                copy()
        except BaseException:
            # The caller frees the destinations: what reuses them next (on the current stream)
            # must come after the layers' copies already enqueued here.
            current.wait_stream(self.stream)
            raise
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def done(self, handle: torch.cuda.Event) -> bool:
        return handle.query()

    def wait(self, handle: torch.cuda.Event) -> None:
        handle.synchronize()


def conversion_stream_for(device: torch.device) -> ConversionStream:
    return CudaConversionStream(device) if device.type == "cuda" else ConversionStream()
