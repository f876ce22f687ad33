"""ops.scratch: live scratch follows the noted tensors' lifetimes; a decode over TQ3 pages needs one
tile of scratch however many pages it reads."""

from __future__ import annotations

import torch

from sglang_minima.layers.attention.forward_plan import plan_forward
from sglang_minima.ops import scratch
from sglang_minima.ops.batched_decode import tq3_batch_decode

from test_batched_decode import D, HKV, HQ, PS, _pool


def test_live_bytes_follow_the_tensors():
    a = torch.zeros(100, dtype=torch.float32)
    scratch.note(a)  # outside a measure(): nothing is counted
    with scratch.measure() as meter:
        a, b = torch.zeros(100, dtype=torch.float32), torch.zeros(10, dtype=torch.uint8)
        scratch.note(a, b, None)
        assert (meter.live_bytes, meter.peak_bytes) == (410, 410)
        del a
        assert meter.live_bytes == 10
        c = torch.zeros(50, dtype=torch.float32)
        scratch.note(c)
        assert (meter.live_bytes, meter.peak_bytes) == (210, 410)
    with scratch.measure() as outer:
        keep = torch.zeros(25, dtype=torch.float32)
        scratch.note(keep)
        with scratch.measure() as inner:
            scratch.note(torch.zeros(1000, dtype=torch.uint8))  # freed at once
        assert inner.peak_bytes == 1000 and inner.live_bytes == 0
        assert outer.peak_bytes == 100 + 1000


def _tq3_decode_scratch(num_pages: int, tile_pages: int) -> int:
    kv_len = num_pages * PS
    req_to_token, fmt, phys, _, _, tq3, layout, codebook, rotation = _pool([kv_len], stale=1.0, seed=num_pages)
    assert bool((fmt[1:] == 1).all())  # every page is TQ3
    plan = plan_forward(req_to_token, torch.tensor([0]), torch.tensor([kv_len]), torch.ones(1, dtype=torch.int64),
                        fmt, phys, PS, max_pages=num_pages)
    q = rotation.rotate(torch.randn(1, HQ, D), head_axis=-2)
    with scratch.measure() as meter:
        tq3_batch_decode(q, plan.tq3, plan.kv_lens, tq3, layout, codebook, D**-0.5, tile_pages=tile_pages)
    assert meter.live_bytes == 0  # nothing outlives the call
    return meter.peak_bytes


def test_tq3_decode_scratch_is_one_tile_not_the_cache():
    tile = 4
    one_tile = _tq3_decode_scratch(tile, tile)
    decoded_kv = 2 * tile * HKV * PS * D * 4  # the tile's K and V, fp32
    assert one_tile >= decoded_kv
    assert _tq3_decode_scratch(4 * tile, tile) == one_tile  # four times the pages, the same scratch
    assert _tq3_decode_scratch(1, tile) < one_tile
