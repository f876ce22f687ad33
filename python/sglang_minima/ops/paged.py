"""Paged attention over FP8 (hot) and TQ3 (stale) pages, in tiles: the reference for every faster path.

Each op returns (out fp32 [T, Hq, Dv], lse fp32 [T, Hq], base 2) for one request's queries over the
pages it is given, reading one tile of pages at a time (never a dense copy of the whole cache) and
folding tiles together with merge_attention_states. Causal masking compares query positions with
key positions, so extend/prefill (new tokens attending causally) and decode share one path; where the
queries' own tokens are the last hot ones (``own_tail``, every extend in serving) no mask is needed and
torch's fused kernel attends instead of a score matrix per tile.

Spaces: the TQ3 op takes q already rotated (q' = R q, once per step) and returns out' in the rotated
space; ``mixed_paged_attention`` takes and returns the original space and un-rotates the TQ3 part
once before the merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Union

import torch

from ..codec.codebook import Codebook
from ..codec.fp8 import Scale, fp8_dequantize
from ..codec.layout import TQ3PageLayout
from ..codec.rotation import LayerRotation
from ..codec.tq3 import decode_page_keys, decode_pages
from .dense import attend, causal_mask, flash_attend
from .merge import merge_attention_states
from .scratch import note as note_scratch

DEFAULT_TILE_TOKENS = 256
DEFAULT_TILE_PAGES = 4
FLASH_TILE_TOKENS = 4096
"""Keys a tile holds where the fused kernel attends (``own_tail``): no score matrix, only the
tile's K and V (4,096 tokens of 3 heads of 64: 6 MiB in fp32)."""


@dataclass(frozen=True)
class HotPagedKV:
    """One request's hot (Recent/Anchor) tokens: FP8 e4m3 stored as uint8 with per-layer scales,
    as SGLang's MHATokenToKVPool keeps them, or the model dtype (scales then None)."""

    k_buffer: torch.Tensor  # [num_slots, H, D], uint8 (FP8) or bf16/fp16/fp32
    v_buffer: torch.Tensor  # [num_slots, H, Dv]
    slots: torch.Tensor  # int64 [n]: token slots into the buffers
    positions: torch.Tensor | None = None  # int64 [n]: sequence position of each token (causal)
    k_scale: Scale = None
    v_scale: Scale = None

    @property
    def num_items(self) -> int:
        """What a tile counts here: tokens."""
        return self.slots.numel()

    def load(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.slots[start:end]
        return dequantize_hot(self.k_buffer[idx], self.k_scale), dequantize_hot(self.v_buffer[idx], self.v_scale)

    def load_keys(self, start: int, end: int) -> torch.Tensor:
        return dequantize_hot(self.k_buffer[self.slots[start:end]], self.k_scale)

    def key_positions(self, start: int, end: int) -> torch.Tensor:
        return self.positions[start:end]


def dequantize_hot(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """Hot-page rows as fp32: e4m3 bits (uint8) times the layer's scale, or the model dtype."""
    if x.dtype == torch.uint8:
        return fp8_dequantize(x, scale)
    x = x.to(torch.float32)
    return x if scale is None else x * scale


@dataclass(frozen=True)
class Tq3PagedKV:
    """One request's Stale pages in a TQ3P buffer; pages are always full."""

    buffer: torch.Tensor  # uint8 [num_physical_pages, layout.page_bytes]
    page_ids: torch.Tensor  # int64 [m]: physical page ids
    layout: TQ3PageLayout
    codebook: Codebook
    page_starts: torch.Tensor | None = None  # int64 [m]: position of token 0 of each page (causal)

    @property
    def num_items(self) -> int:
        """What a tile counts here: pages."""
        return self.page_ids.numel()

    def load(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded rotated K, V of pages [start, end) as [tokens, H, D] fp32."""
        k, v = decode_pages(self.buffer[self.page_ids[start:end]], self.layout, self.codebook)
        return self._tokens(k), self._tokens(v)

    def load_keys(self, start: int, end: int) -> torch.Tensor:
        """Decoded rotated K alone of pages [start, end) as [tokens, H, D] fp32."""
        return self._tokens(decode_page_keys(self.buffer[self.page_ids[start:end]], self.layout, self.codebook))

    def key_positions(self, start: int, end: int) -> torch.Tensor:
        offs = torch.arange(self.layout.page_size, device=self.page_starts.device)
        return (self.page_starts[start:end].view(-1, 1) + offs).reshape(-1)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[pages, H, P, D] -> [pages * P, H, D]."""
        return x.transpose(1, 2).reshape(-1, self.layout.num_kv_heads, self.layout.head_dim)


PagedKV = Union[HotPagedKV, Tq3PagedKV]


class KVTile(NamedTuple):
    start: int
    end: int
    k: torch.Tensor  # [tokens, H, D] fp32
    v: torch.Tensor | None  # [tokens, H, Dv] fp32, None when only keys were loaded
    mask: torch.Tensor | None  # bool [T, tokens]: causal mask, None without positions


def kv_tiles(
    kv: PagedKV, tile: int, q_positions: torch.Tensor | None = None, *, values: bool = True, stop: int | None = None
) -> Iterator[KVTile]:
    """The one tile loop: items [start, end) of ``tile`` tokens (hot) or pages (TQ3) at a time, their
    K (and V) and the causal mask against ``q_positions``, up to item ``stop`` (all: None). Ops and
    page mass both read through it."""
    n = kv.num_items if stop is None else stop
    for start in range(0, n, tile):
        end = min(start + tile, n)
        k, v = kv.load(start, end) if values else (kv.load_keys(start, end), None)
        mask = None if q_positions is None else causal_mask(q_positions, kv.key_positions(start, end))
        note_scratch(k, v, mask)
        yield KVTile(start, end, k, v, mask)


def _empty_state(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, _ = q.shape
    out = torch.zeros(t, hq, dv, dtype=torch.float32, device=q.device)
    return out, torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)


def _check_causal(q_positions: torch.Tensor | None, kv_positions: torch.Tensor | None, what: str) -> None:
    if (q_positions is None) != (kv_positions is None):
        raise ValueError(f"{what}: causal masking needs both q_positions and key positions, or neither")


def hot_paged_attention(
    q: torch.Tensor,
    kv: HotPagedKV,
    sm_scale: float,
    q_positions: torch.Tensor | None = None,
    tile_tokens: int | None = None,
    *,
    own_tail: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] (original space) over hot tokens -> (out fp32 [T, Hq, Dv], lse base 2 [T, Hq]).

    ``own_tail``: the last T hot tokens are the queries' own, in order (an extend writes its new
    tokens hot: ``RequestRoute.own_tokens_hot``), so no positions are needed: the own tokens are
    attended causally and the tokens before them, visible to every query, in tiles, both by the fused
    kernel (``flash_attend``) instead of a masked score matrix per tile.
    """
    if own_tail:
        return _hot_own_tail(q, kv, sm_scale, q_positions, tile_tokens or FLASH_TILE_TOKENS)
    _check_causal(q_positions, kv.positions, "hot_paged_attention")
    out, lse = _empty_state(q, kv.v_buffer.shape[-1])
    for t in kv_tiles(kv, tile_tokens or DEFAULT_TILE_TOKENS, q_positions):
        out, lse = merge_attention_states(out, lse, *attend(q, t.k, t.v, sm_scale, t.mask))
    return out, lse


def _hot_own_tail(
    q: torch.Tensor, kv: HotPagedKV, sm_scale: float, q_positions: torch.Tensor | None, tile_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    t, n = q.shape[0], kv.num_items
    if q_positions is not None or n < t:
        raise ValueError(f"hot_paged_attention(own_tail=True): no q_positions, and at least the queries' "
                         f"{t} own tokens among the {n} hot ones")
    k, v = kv.load(n - t, n)
    note_scratch(k, v)
    out, lse = flash_attend(q, k, v, sm_scale, causal=True)
    for tile in kv_tiles(kv, tile_tokens, stop=n - t):
        out, lse = merge_attention_states(out, lse, *flash_attend(q, tile.k, tile.v, sm_scale))
    return out, lse


def tq3_paged_attention(
    q_rot: torch.Tensor,
    kv: Tq3PagedKV,
    sm_scale: float,
    q_positions: torch.Tensor | None = None,
    tile_pages: int = DEFAULT_TILE_PAGES,
    *,
    flash: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q' = R q [T, Hq, D] (ROTATED, see LayerRotation.rotate) over TQ3 pages
    -> (out' fp32 [T, Hq, D] in the ROTATED space, lse base 2 [T, Hq]).

    ``flash``: every query sees every page (a prompt over the Stale pages before it), attended per
    tile by the fused kernel (``flash_attend``) instead of an explicit score matrix.
    """
    if flash and q_positions is not None:
        raise ValueError("tq3_paged_attention: flash attends without a mask; pass no q_positions")
    if not flash:  # (flash: every page visible, whatever positions the pages carry)
        _check_causal(q_positions, kv.page_starts, "tq3_paged_attention")
    out, lse = _empty_state(q_rot, kv.layout.head_dim)
    for t in kv_tiles(kv, tile_pages, q_positions):
        part = flash_attend(q_rot, t.k, t.v, sm_scale) if flash else attend(q_rot, t.k, t.v, sm_scale, t.mask)
        out, lse = merge_attention_states(out, lse, *part)
    return out, lse


def mixed_paged_attention(
    q: torch.Tensor,
    hot: HotPagedKV | None,
    tq3: Tq3PagedKV | None,
    rotation: LayerRotation,
    sm_scale: float,
    q_positions: torch.Tensor | None = None,
    *,
    own_tail: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] (original space) over hot + TQ3 pages -> (out fp32 original space, lse base 2).

    ``own_tail``: the queries' own tokens are the last T hot ones (``hot_paged_attention``); every TQ3
    page then precedes them (a page converts once sealed), so it is attended unmasked by the fused
    kernel too.
    """
    if own_tail and (q_positions is not None or hot is None or hot.num_items < q.shape[0]):
        raise ValueError("mixed_paged_attention(own_tail=True): no q_positions, and the queries' own tokens "
                         "among the hot ones")
    out, lse = _empty_state(q, q.shape[-1] if hot is None else hot.v_buffer.shape[-1])
    if tq3 is not None and tq3.page_ids.numel():
        q_rot = rotation.rotate(q, head_axis=-2)
        if own_tail:
            tile_pages = max(1, FLASH_TILE_TOKENS // tq3.layout.page_size)
            out_rot, lse = tq3_paged_attention(q_rot, tq3, sm_scale, tile_pages=tile_pages, flash=True)
        else:
            out_rot, lse = tq3_paged_attention(q_rot, tq3, sm_scale, q_positions)
        out = rotation.unrotate(out_rot, head_axis=-2)
    if hot is not None and hot.slots.numel():
        out, lse = merge_attention_states(out, lse, *hot_paged_attention(q, hot, sm_scale, q_positions, own_tail=own_tail))
    return out, lse
