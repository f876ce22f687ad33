"""Attention mass per KV page (paper Eq. 6-9 input), from the queries and the merged base-2 LSE.

The attention ops return (out, LSE) only. Given a request's final LSE, the softmax weight of key j
for query t, head h is 2^(scale·log2(e)·q·k_j - lse[t, h]); summing it over queries and heads and
then over the keys of a page gives the page's attention mass. Keys are read again in the same tiles
as the ops read them (K only, never a dense copy of the cache). Used only when Anchors are chosen by
attention score.
"""

from __future__ import annotations

import torch

from sglang_minima.codec.codebook import Codebook
from sglang_minima.codec.fp8 import Scale, fp8_dequantize
from sglang_minima.codec.layout import KEY, TQ3PageLayout
from sglang_minima.codec.packing import unpack_codes
from sglang_minima.codec.tq3 import dequantize_keys, page_fields
from sglang_minima.ops.dense import LOG2E, causal_mask
from sglang_minima.ops.paged import DEFAULT_TILE_PAGES, DEFAULT_TILE_TOKENS


def _key_mass(
    q: torch.Tensor, k: torch.Tensor, sm_scale: float, lse: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [T, Hq, D], k [N, H, D], lse [T, Hq], mask [T, N] -> fp32 [N]: sum over t, h of the weights."""
    t, hq, d = q.shape
    h = k.shape[1]
    qg = q.to(torch.float32).view(t, h, hq // h, d)
    s = torch.einsum("thgd,nhd->thgn", qg, k.to(torch.float32)) * (sm_scale * LOG2E)
    p = torch.exp2(s - lse.to(torch.float32).view(t, h, hq // h, 1))
    p = p.masked_fill(~mask.view(t, 1, 1, -1), 0.0)
    return p.sum(dim=(0, 1, 2))


def hot_token_mass(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k_scale: Scale,
    sm_scale: float,
    lse: torch.Tensor,
    q_positions: torch.Tensor,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
) -> torch.Tensor:
    """Attention mass of each hot token (fp32 [n]); ``k_buffer`` uint8 e4m3 (with ``k_scale``) or float."""
    mass = torch.zeros(slots.numel(), dtype=torch.float32, device=q.device)
    for start in range(0, slots.numel(), tile_tokens):
        end = min(start + tile_tokens, slots.numel())
        k = k_buffer[slots[start:end]]
        k = fp8_dequantize(k, k_scale) if k.dtype == torch.uint8 else k
        mass[start:end] = _key_mass(q, k, sm_scale, lse, causal_mask(q_positions, positions[start:end]))
    return mass


def tq3_page_mass(
    q_rot: torch.Tensor,
    buffer: torch.Tensor,
    page_ids: torch.Tensor,
    page_starts: torch.Tensor,
    layout: TQ3PageLayout,
    codebook: Codebook,
    sm_scale: float,
    lse: torch.Tensor,
    q_positions: torch.Tensor,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> torch.Tensor:
    """Attention mass of each TQ3 page (fp32 [m]); ``q_rot`` is R q (scores are rotation-invariant)."""
    h, p, d = layout.num_kv_heads, layout.page_size, layout.head_dim
    offsets = torch.arange(p, device=page_starts.device)
    mass = torch.zeros(page_ids.numel(), dtype=torch.float32, device=q_rot.device)
    for start in range(0, page_ids.numel(), tile_pages):
        end = min(start + tile_pages, page_ids.numel())
        f = page_fields(buffer[page_ids[start:end]], layout)
        k = dequantize_keys(unpack_codes(f.k_codes, KEY, p, d), f.k_norm, codebook)  # [n, H, P, D]
        k = k.transpose(1, 2).reshape(-1, h, d)
        k_positions = (page_starts[start:end].view(-1, 1) + offsets).reshape(-1)
        token_mass = _key_mass(q_rot, k, sm_scale, lse, causal_mask(q_positions, k_positions))
        mass[start:end] = token_mass.view(end - start, p).sum(-1)
    return mass
