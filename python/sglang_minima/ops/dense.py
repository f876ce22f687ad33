"""Softmax attention over one explicit set of keys, returning (out, base-2 LSE). GQA-aware."""

from __future__ import annotations

import math

import torch

from .scratch import note as note_scratch

LOG2E = 1.0 / math.log(2.0)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [N, H, D], v [N, H, Dv], mask bool [T, N] (True: key visible) or None
    -> out fp32 [T, Hq, Dv], lse fp32 [T, Hq] = log2 sum_j exp(sm_scale q·k_j).

    Query head i uses KV head i // (Hq // H). Rows with no visible key give (0, -inf).
    """
    t, hq, d = q.shape
    n, h, dk = k.shape
    if dk != d or v.shape[:2] != (n, h):
        raise ValueError(f"attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if hq % h != 0:
        raise ValueError(f"attend: num_q_heads={hq} is not a multiple of num_kv_heads={h}")
    qg = q.to(torch.float32).view(t, h, hq // h, d)
    # Base-2 logits: fold log2(e) into the scale, as FlashInfer does.
    s = torch.einsum("thgd,nhd->thgn", qg, k.to(torch.float32)) * (sm_scale * LOG2E)
    if mask is not None:
        if mask.shape != (t, n):
            raise ValueError(f"attend: mask must be [{t}, {n}], got {tuple(mask.shape)}")
        s = s.masked_fill(~mask.view(t, 1, 1, n), float("-inf"))
    m = s.amax(-1, keepdim=True) if n else s.new_full((t, h, hq // h, 1), float("-inf"))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m)
    note_scratch(s, p)
    denom = p.sum(-1)
    out = torch.einsum("thgn,nhd->thgd", p, v.to(torch.float32))
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    lse = m.squeeze(-1) + torch.log2(denom)
    return out.reshape(t, hq, v.shape[-1]), lse.reshape(t, hq)


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """bool [T, N]: key j is visible to query i iff k_positions[j] <= q_positions[i]."""
    return k_positions.view(1, -1) <= q_positions.view(-1, 1)
