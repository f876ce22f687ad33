"""Host lists onto the device without waiting for it.

A copy from pageable host memory with ``non_blocking=False`` (what ``torch.tensor(values,
device=...)`` does) synchronizes the stream: every plan and mask built from SGLang's host lists
would wait for the forward in flight. Through pinned memory the copy is queued behind it instead.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without a stream sync: through pinned memory, copied asynchronously
    on CUDA (the caching host allocator keeps the pinned buffer until the copy is done)."""
    host = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
