"""Merge two partial attention states (out, base-2 LSE) into one: the stable online-softmax merge.

For the same queries over disjoint key sets A and B:
    lse = log2(2^lse_a + 2^lse_b),  out = (2^(lse_a - lse) out_a + 2^(lse_b - lse) out_b).
An empty state has lse = -inf (its out is ignored, even if NaN); two empty states merge to (0, -inf).
SGLang's merge_state kernels use base e: multiply a base-2 LSE by ln 2 before handing it to them.
"""

from __future__ import annotations

import torch


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [..., Dv] and lse [...] (base 2) of two key sets -> (out fp32, lse fp32) of their union."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states: shapes out_a={tuple(out_a.shape)} lse_a={tuple(lse_a.shape)} "
            f"out_b={tuple(out_b.shape)} lse_b={tuple(lse_b.shape)} do not match"
        )
    lse_a, lse_b = lse_a.to(torch.float32), lse_b.to(torch.float32)
    m = torch.maximum(lse_a, lse_b)
    # Both empty: m = -inf; shift by 0 instead so the weights are exp2(-inf) = 0, not NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return _weighted(out_a, w_a * inv) + _weighted(out_b, w_b * inv), m + torch.log2(total)


def _weighted(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # An empty side may carry garbage (a kernel never wrote it): select, don't multiply by 0.
    w = w.unsqueeze(-1)
    return torch.where(
        w > 0, out.to(torch.float32) * w, torch.zeros((), dtype=torch.float32, device=out.device)
    )
