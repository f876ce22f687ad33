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


def flash_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, *, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` through torch's fused flash-attention kernel (no [T, N] score matrix, so a long
    prompt's queries can meet a large tile of keys): same shapes and result up to rounding. Without
    ``causal`` every query sees every key; with it T == N and query i sees keys 0..i (a prompt's own
    tokens). On CUDA the operands go in as bf16 (the kernel's input dtype), on CPU as fp32.
    """
    t, hq, d = q.shape
    n, h, dk = k.shape
    if dk != d or v.shape != k.shape or hq % h != 0 or (causal and n != t):
        raise ValueError(f"flash_attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit"
                         + (" (causal: as many keys as queries)" if causal else ""))
    dtype = torch.bfloat16 if q.device.type == "cuda" else torch.float32
    ks = k.to(dtype).transpose(0, 1).unsqueeze(0).contiguous()
    vs = v.to(dtype).transpose(0, 1).unsqueeze(0).contiguous()
    note_scratch(ks, vs)
    return _flash(q, ks, vs, sm_scale, causal)


def _flash(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, sm_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] against ks / vs [1, H, N, D] -> (out fp32 [T, Hq, D], lse base 2 [T, Hq])."""
    t, hq, d = q.shape
    h = ks.shape[1]
    g = hq // h
    if causal:
        # A GQA group's queries as a batch of g against the same K/V (a stride-0 batch: no copy on
        # CPU); stacked along the sequence axis (below) they would break the causal diagonal.
        qs = q.to(ks.dtype).view(t, h, g, d).permute(2, 1, 0, 3).contiguous()
        ks, vs = ks.expand(g, -1, -1, -1), vs.expand(g, -1, -1, -1)
        if q.device.type == "cuda":
            ks, vs = ks.contiguous(), vs.contiguous()
    else:
        # With nothing masked every query row is independent, so a GQA group's queries can stack along
        # the sequence axis of their KV head: [1, H, T*g, D] against [1, H, N, D], no K/V expansion.
        qs = q.to(ks.dtype).view(t, h, g, d).transpose(0, 1).reshape(1, h, t * g, d)
    note_scratch(qs)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qs, ks, vs, 0.0, causal, False, scale=sm_scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, causal, scale=sm_scale)
    if causal:  # [g, H, T, D], lse [g, H, T]
        out = out.permute(2, 1, 0, 3).reshape(t, hq, d).to(torch.float32)
        lse = lse.permute(2, 1, 0).reshape(t, hq).to(torch.float32) * LOG2E
        return out, lse
    out = out.view(h, t, g, d).transpose(0, 1).reshape(t, hq, d).to(torch.float32)
    lse = lse.view(h, t, g).transpose(0, 1).reshape(t, hq).to(torch.float32) * LOG2E  # natural log -> base 2
    return out, lse
