"""merge_attention_states: split any key set in two, merge == whole; empty states."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.ops.dense import attend
from sglang_minima.ops.merge import merge_attention_states

NEG_INF = float("-inf")


@pytest.mark.parametrize("seed", range(5))
def test_split_and_merge_equals_whole(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(3, 8, 64, generator=g),
        torch.randn(50, 2, 64, generator=g),
        torch.randn(50, 2, 32, generator=g),
    )
    perm = torch.randperm(50, generator=g)
    a, b = perm[: 1 + seed * 7], perm[1 + seed * 7 :]
    whole = attend(q, k, v, 0.125)
    merged = merge_attention_states(*attend(q, k[a], v[a], 0.125), *attend(q, k[b], v[b], 0.125))
    assert torch.allclose(merged[0], whole[0], atol=1e-5)
    assert torch.allclose(merged[1], whole[1], atol=1e-5)


def test_merge_is_symmetric_and_handles_large_lse():
    out_a, out_b = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    lse_a, lse_b = torch.full((4, 2), 1000.0), torch.full((4, 2), 999.0)
    o1, l1 = merge_attention_states(out_a, lse_a, out_b, lse_b)
    o2, l2 = merge_attention_states(out_b, lse_b, out_a, lse_a)
    assert torch.allclose(o1, o2) and torch.equal(l1, l2)
    assert torch.allclose(o1, (2 * out_a + out_b) / 3, atol=1e-6)
    assert torch.allclose(l1, torch.full_like(l1, 1000.0 + torch.log2(torch.tensor(1.5)).item()))


def test_empty_sides():
    out, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    empty_out, empty_lse = torch.full((2, 3, 8), float("nan")), torch.full((2, 3), NEG_INF)
    o, lse_m = merge_attention_states(out, lse, empty_out, empty_lse)
    assert torch.equal(o, out) and torch.equal(lse_m, lse)
    o, lse_m = merge_attention_states(empty_out, empty_lse, out, lse)
    assert torch.equal(o, out) and torch.equal(lse_m, lse)
    o, lse_m = merge_attention_states(empty_out, empty_lse, empty_out.clone(), empty_lse.clone())
    assert torch.count_nonzero(o) == 0 and bool(torch.isneginf(lse_m).all())


def test_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        merge_attention_states(
            torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(2, 3)
        )
