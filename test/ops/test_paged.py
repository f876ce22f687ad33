"""Paged FP8 / TQ3 / mixed attention == dense softmax attention over the dequantized K/V."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages
from sglang_minima.ops.dense import attend, causal_mask
from sglang_minima.ops.paged import (
    HotPagedKV,
    Tq3PagedKV,
    hot_paged_attention,
    mixed_paged_attention,
    tq3_paged_attention,
)

H, HQ, D, PS = 2, 8, 64, 16
SM = D**-0.5
ATOL = 2e-5


def _close(a, b):
    assert torch.allclose(a[0], b[0], atol=ATOL), float((a[0] - b[0]).abs().max())
    assert torch.allclose(a[1], b[1], atol=ATOL), float((a[1] - b[1]).abs().max())


def _hot(n_slots: int, slots: torch.Tensor, fp8: bool = True, positions=None):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(n_slots, H, D, generator=g) * 2, torch.randn(n_slots, H, D, generator=g)
    if fp8:
        return HotPagedKV(fp8_quantize(k, 0.5), fp8_quantize(v, 0.25), slots, positions, 0.5, 0.25)
    return HotPagedKV(k.to(torch.bfloat16), v.to(torch.bfloat16), slots, positions)


def _hot_dense(kv: HotPagedKV):
    if kv.k_buffer.dtype == torch.uint8:
        return fp8_dequantize(kv.k_buffer[kv.slots], kv.k_scale), fp8_dequantize(
            kv.v_buffer[kv.slots], kv.v_scale
        )
    return kv.k_buffer[kv.slots].float(), kv.v_buffer[kv.slots].float()


def _tq3(n_phys: int, page_ids: torch.Tensor, page_starts=None, key_bits: int = 3):
    layout, rot, cb = TQ3PageLayout(H, PS, D, key_bits), LayerRotation(H, D, layer_id=2), key_codebook(D, key_bits)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(n_phys, H, PS, D, generator=g) * 2, torch.randn(n_phys, H, PS, D, generator=g)
    return Tq3PagedKV(encode_pages(k, v, layout, rot, cb), page_ids, layout, cb, page_starts), rot


def _tq3_dense_rot(kv: Tq3PagedKV):
    k, v = decode_pages(kv.buffer[kv.page_ids], kv.layout, kv.codebook)
    return k.transpose(1, 2).reshape(-1, H, D), v.transpose(1, 2).reshape(-1, H, D)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
def test_hot_equals_dense(fp8, tile):
    slots = torch.randperm(120)[:75]
    kv = _hot(120, slots, fp8)
    q = torch.randn(3, HQ, D)
    _close(hot_paged_attention(q, kv, SM, tile_tokens=tile), attend(q, *_hot_dense(kv), SM))


def test_hot_causal():
    slots = torch.arange(40)
    kv = _hot(40, slots, positions=torch.arange(40))
    q, qpos = torch.randn(5, HQ, D), torch.arange(35, 40)
    got = hot_paged_attention(q, kv, SM, q_positions=qpos, tile_tokens=16)
    _close(got, attend(q, *_hot_dense(kv), SM, causal_mask(qpos, torch.arange(40))))


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("prefix,new,tile", [(0, 40, None), (45, 7, 16), (45, 7, 1000), (60, 1, 7), (3, 33, 2)])
def test_hot_own_tail_equals_the_masked_path(fp8, prefix, new, tile):
    # an extend: hot tokens in position order, the queries' own last; the prefix unmasked in tiles
    # and the own tokens causally by the fused kernel give the masked tiles' result
    n = prefix + new
    kv = _hot(n + 20, torch.randperm(n + 20)[:n], fp8, positions=torch.arange(n))
    q = torch.randn(new, HQ, D)
    want = hot_paged_attention(q, kv, SM, q_positions=torch.arange(prefix, n), tile_tokens=16)
    _close(hot_paged_attention(q, kv, SM, tile_tokens=tile, own_tail=True), want)


def test_hot_own_tail_rejects_what_it_cannot_attend():
    kv = _hot(10, torch.arange(10), positions=torch.arange(10))
    with pytest.raises(ValueError, match="own_tail=True"):
        hot_paged_attention(torch.randn(11, HQ, D), kv, SM, own_tail=True)  # more queries than hot tokens
    with pytest.raises(ValueError, match="own_tail=True"):
        hot_paged_attention(torch.randn(2, HQ, D), kv, SM, q_positions=torch.arange(8, 10), own_tail=True)


@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("tile", [1, 3, 16])
def test_tq3_equals_dense_in_rotated_space(tile, key_bits):
    kv, rot = _tq3(10, torch.tensor([7, 2, 9, 0, 4]), key_bits=key_bits)
    q_rot = rot.rotate(torch.randn(2, HQ, D))
    _close(tq3_paged_attention(q_rot, kv, SM, tile_pages=tile), attend(q_rot, *_tq3_dense_rot(kv), SM))


@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("tile", [1, 3, 16])
def test_tq3_flash_equals_dense_in_rotated_space(tile, key_bits):
    # the prefill's path over the Stale pages before a prompt: no mask, the fused kernel per tile
    kv, rot = _tq3(10, torch.tensor([7, 2, 9, 0, 4]), key_bits=key_bits)
    q_rot = rot.rotate(torch.randn(9, HQ, D))
    got = tq3_paged_attention(q_rot, kv, SM, tile_pages=tile, flash=True)
    _close(got, attend(q_rot, *_tq3_dense_rot(kv), SM))


def test_tq3_flash_refuses_a_mask():
    kv, rot = _tq3(4, torch.tensor([1, 2]), torch.arange(2) * PS)
    with pytest.raises(ValueError, match="flash attends without a mask"):
        tq3_paged_attention(torch.randn(1, HQ, D), kv, SM, q_positions=torch.tensor([40]), flash=True)


def test_tq3_causal_prefill_over_pages():
    starts = torch.arange(4) * PS
    kv, rot = _tq3(6, torch.tensor([5, 1, 3, 0]), starts)
    qpos = torch.arange(20, 64, 3)  # queries inside the pages: partially visible pages
    q_rot = rot.rotate(torch.randn(qpos.numel(), HQ, D))
    got = tq3_paged_attention(q_rot, kv, SM, q_positions=qpos, tile_pages=2)
    _close(got, attend(q_rot, *_tq3_dense_rot(kv), SM, causal_mask(qpos, torch.arange(4 * PS))))


def test_mixed_equals_dense_over_both_formats():
    tq3, rot = _tq3(8, torch.tensor([3, 6, 1]), torch.arange(3) * PS)
    hot_pos = torch.arange(3 * PS, 3 * PS + 37)
    hot = _hot(100, torch.randperm(100)[:37], positions=hot_pos)
    qpos = torch.arange(3 * PS + 30, 3 * PS + 37)  # an extend: 7 new tokens, causal
    q = torch.randn(qpos.numel(), HQ, D)
    got = mixed_paged_attention(q, hot, tq3, rot, SM, q_positions=qpos)

    k3, v3 = _tq3_dense_rot(tq3)
    k8, v8 = _hot_dense(hot)
    k = torch.cat((rot.unrotate(k3), k8))
    v = torch.cat((rot.unrotate(v3), v8))
    kpos = torch.cat((torch.arange(3 * PS), hot_pos))
    _close(got, attend(q, k, v, SM, causal_mask(qpos, kpos)))


def test_mixed_own_tail_equals_the_masked_path():
    # a later prefill chunk over Stale pages and a hot sink / Recent tail: TQ3 pages unmasked (they
    # precede every query), hot prefix unmasked, own tokens causal
    tq3, rot = _tq3(8, torch.tensor([3, 6, 1]), torch.arange(1, 4) * PS)
    hot_pos = torch.cat((torch.arange(PS), torch.arange(4 * PS, 4 * PS + 29)))
    hot = _hot(100, torch.randperm(100)[:hot_pos.numel()], positions=hot_pos)
    qpos = torch.arange(4 * PS + 9, 4 * PS + 29)
    q = torch.randn(qpos.numel(), HQ, D)
    _close(mixed_paged_attention(q, hot, tq3, rot, SM, own_tail=True),
           mixed_paged_attention(q, hot, tq3, rot, SM, q_positions=qpos))
    # the own tokens must be there to attend: no hot side, or positions beside own_tail, is refused
    for bad in (dict(hot=None), dict(q_positions=qpos)):
        with pytest.raises(ValueError, match="own_tail=True"):
            kw = dict(hot=hot, q_positions=None) | bad
            mixed_paged_attention(q, kw["hot"], tq3, rot, SM, kw["q_positions"], own_tail=True)


def test_mixed_with_one_side_empty():
    tq3, rot = _tq3(4, torch.tensor([2, 0]))
    hot = _hot(30, torch.arange(30))
    q = torch.randn(2, HQ, D)
    empty_tq3 = Tq3PagedKV(tq3.buffer, torch.zeros(0, dtype=torch.int64), tq3.layout, tq3.codebook)
    empty_hot = HotPagedKV(hot.k_buffer, hot.v_buffer, torch.zeros(0, dtype=torch.int64))
    _close(mixed_paged_attention(q, hot, empty_tq3, rot, SM), hot_paged_attention(q, hot, SM))
    k3, v3 = _tq3_dense_rot(tq3)
    _close(
        mixed_paged_attention(q, empty_hot, tq3, rot, SM), attend(q, rot.unrotate(k3), rot.unrotate(v3), SM)
    )
    out, lse = mixed_paged_attention(q, None, None, rot, SM)
    assert torch.count_nonzero(out) == 0 and bool(torch.isneginf(lse).all())


def test_causal_needs_both_positions():
    kv = _hot(10, torch.arange(10))
    with pytest.raises(ValueError, match="both q_positions and key positions"):
        hot_paged_attention(torch.randn(1, HQ, D), kv, SM, q_positions=torch.tensor([3]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_on_gpu_matches_cpu():
    tq3, rot = _tq3(8, torch.tensor([3, 6, 1]), torch.arange(3) * PS)
    hot = _hot(100, torch.randperm(100)[:37], positions=torch.arange(3 * PS, 3 * PS + 37))
    qpos = torch.arange(3 * PS + 30, 3 * PS + 37)
    q = torch.randn(qpos.numel(), HQ, D)
    cpu = mixed_paged_attention(q, hot, tq3, rot, SM, q_positions=qpos)

    def cuda(kv):
        return type(kv)(
            **{
                f: (getattr(kv, f).cuda() if isinstance(getattr(kv, f), torch.Tensor) else getattr(kv, f))
                for f in kv.__dataclass_fields__
            }
        )

    gpu_rot = LayerRotation(H, D, layer_id=2, device="cuda")
    gpu = mixed_paged_attention(q.cuda(), cuda(hot), cuda(tq3), gpu_rot, SM, q_positions=qpos.cuda())
    assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-5) and torch.allclose(gpu[1].cpu(), cpu[1], atol=1e-5)
