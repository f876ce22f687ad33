"""attend: softmax attention with base-2 LSE, GQA, causal masks, empty rows."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_minima.ops.dense import attend, causal_mask, flash_attend


def _naive(q, k, v, sm_scale, mask=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q.double(), k) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v)
    return out, (torch.logsumexp(s, -1) / math.log(2)).T


@pytest.mark.parametrize("hq,h", [(4, 4), (8, 2), (6, 1)])
def test_matches_naive_softmax_gqa(hq, h):
    q, k, v = torch.randn(5, hq, 64), torch.randn(40, h, 64), torch.randn(40, h, 48)
    out, lse = attend(q, k, v, 0.1)
    want_out, want_lse = _naive(q, k, v, 0.1)
    assert out.shape == (5, hq, 48) and lse.shape == (5, hq)
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)


def test_causal_mask_and_fully_masked_rows():
    q, k, v = torch.randn(4, 2, 16), torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    mask = causal_mask(torch.tensor([-1, 0, 3, 9]), torch.arange(6))
    out, lse = attend(q, k, v, 0.25, mask)
    assert torch.count_nonzero(out[0]) == 0 and bool(torch.isneginf(lse[0]).all())
    want_out, want_lse = _naive(q[1:], k, v, 0.25, mask[1:])
    assert torch.allclose(out[1:].double(), want_out, atol=1e-5)
    assert torch.allclose(lse[1:].double(), want_lse, atol=1e-5)


def test_no_keys():
    out, lse = attend(torch.randn(3, 4, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), 1.0)
    assert torch.count_nonzero(out) == 0 and bool(torch.isneginf(lse).all())


def test_bad_shapes():
    with pytest.raises(ValueError, match="num_q_heads=3 is not a multiple of num_kv_heads=2"):
        attend(torch.randn(1, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        attend(
            torch.randn(1, 2, 8),
            torch.randn(4, 2, 8),
            torch.randn(4, 2, 8),
            1.0,
            torch.ones(1, 3, dtype=torch.bool),
        )


@pytest.mark.parametrize("hq,h", [(4, 4), (8, 2), (6, 1)])
def test_flash_attend_matches_naive_softmax_gqa(hq, h):
    q, k, v = torch.randn(5, hq, 64), torch.randn(40, h, 64), torch.randn(40, h, 64)
    out, lse = flash_attend(q, k, v, 0.1)
    want_out, want_lse = _naive(q, k, v, 0.1)
    assert out.shape == (5, hq, 64) and lse.shape == (5, hq)
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)


@pytest.mark.parametrize("hq,h", [(4, 4), (9, 3), (6, 1)])
def test_causal_flash_attend_matches_masked_softmax(hq, h):
    # a prompt's own tokens: query i sees keys 0..i (the GQA group as a batch, not stacked rows)
    t = 37
    q, k, v = torch.randn(t, hq, 64), torch.randn(t, h, 64), torch.randn(t, h, 64)
    out, lse = flash_attend(q, k, v, 0.1, causal=True)
    want_out, want_lse = _naive(q, k, v, 0.1, causal_mask(torch.arange(t), torch.arange(t)))
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)
    with pytest.raises(ValueError, match="causal: as many keys as queries"):
        flash_attend(q, k[:-1], v[:-1], 0.1, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_causal_flash_attend_on_cuda():
    # the kernel takes bf16 there, its GQA batch as contiguous copies
    t, hq, h = 300, 12, 4
    q, k, v = torch.randn(t, hq, 64), torch.randn(t, h, 64), torch.randn(t, h, 64)
    out, lse = flash_attend(q.cuda(), k.cuda(), v.cuda(), 0.1, causal=True)
    want_out, want_lse = _naive(q, k, v, 0.1, causal_mask(torch.arange(t), torch.arange(t)))
    assert torch.allclose(out.cpu().double(), want_out, atol=3e-2)
    assert torch.allclose(lse.cpu().double(), want_lse, atol=3e-2)


def test_flash_attend_bad_shapes():
    with pytest.raises(ValueError, match="flash_attend: q"):
        flash_attend(torch.randn(1, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), 1.0)
    with pytest.raises(ValueError, match="flash_attend: q"):
        flash_attend(torch.randn(1, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 16), 1.0)
