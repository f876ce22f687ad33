"""Attention mass per KV page (the input of the page score, docs/ARCHITECTURE.md, Tiers), from the
queries and the merged base-2 LSE.

The attention ops return (out, LSE) only. Given a request's final LSE, the softmax weight of key j
for query t, head h is 2^(scale·log2(e)·q·k_j - lse[t, h]); summing it over queries and heads and
then over the keys of a page gives the page's attention mass. Keys are read again in the same tiles
as the ops read them (``ops.paged.kv_tiles``, K only, never a dense copy of the cache). Used only when Anchors are chosen by
attention score.
"""

from __future__ import annotations

import torch

from sglang_minima.ops.dense import LOG2E
from sglang_minima.ops.paged import DEFAULT_TILE_PAGES, DEFAULT_TILE_TOKENS, HotPagedKV, Tq3PagedKV, kv_tiles


def key_mass(
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
    hot: HotPagedKV,
    sm_scale: float,
    lse: torch.Tensor,
    q_positions: torch.Tensor,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
) -> torch.Tensor:
    """Attention mass of each of ``hot``'s tokens (fp32 [n])."""
    mass = torch.zeros(hot.num_items, dtype=torch.float32, device=q.device)
    for t in kv_tiles(hot, tile_tokens, q_positions, values=False):
        mass[t.start : t.end] = key_mass(q, t.k, sm_scale, lse, t.mask)
    return mass


def tq3_page_mass(
    q_rot: torch.Tensor,
    tq3: Tq3PagedKV,
    sm_scale: float,
    lse: torch.Tensor,
    q_positions: torch.Tensor,
    tile_pages: int = DEFAULT_TILE_PAGES,
) -> torch.Tensor:
    """Attention mass of each of ``tq3``'s pages (fp32 [m]); ``q_rot`` is R q (scores are rotation-invariant)."""
    mass = torch.zeros(tq3.num_items, dtype=torch.float32, device=q_rot.device)
    for t in kv_tiles(tq3, tile_pages, q_positions, values=False):
        token_mass = key_mass(q_rot, t.k, sm_scale, lse, t.mask)
        mass[t.start : t.end] = token_mass.view(t.end - t.start, tq3.layout.page_size).sum(-1)
    return mass
