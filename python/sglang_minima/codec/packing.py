"""3-bit code packing of one head of one page, in the MMA order of layout.py ("Codes are stored...")."""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from .layout import KEY, NUM_CODES, TQ3_BITS, VALUE, TQ3PageLayout, code_bit_index


@lru_cache(maxsize=32)
def _bit_index(kind: str, page_size: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """int64 [P, D, 3] on ``device``: the bit of a head's code block that holds each code bit
    (layout.code_bit_index). Cached per device, so encoding on a GPU does not re-upload it."""
    token = torch.arange(page_size).view(-1, 1, 1)
    dim = torch.arange(head_dim).view(1, -1, 1)
    bit = torch.arange(TQ3_BITS).view(1, 1, -1)
    index = code_bit_index(kind, token, dim, bit, head_dim, where=torch.where)
    return index.expand(page_size, head_dim, TQ3_BITS).contiguous().to(device)


def _check(kind: str, page_size: int, head_dim: int, device: torch.device) -> torch.Tensor:
    if kind not in (KEY, VALUE):
        raise ValueError(f"kind must be {KEY!r} or {VALUE!r}, got {kind!r}")
    TQ3PageLayout(1, page_size, head_dim)  # validates the page geometry
    return _bit_index(kind, page_size, head_dim, device)


def pack_codes(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 codes in [0, 8) [..., P, D] (one head of one page) -> uint8 [..., P*D*3/8] in MMA order."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes expects uint8 codes, got dtype={codes.dtype}")
    if codes.dim() < 2:
        raise ValueError(f"pack_codes expects codes [..., page_size, head_dim], got shape {tuple(codes.shape)}")
    p, d = codes.shape[-2:]
    index = _check(kind, p, d, codes.device)
    if codes.numel() and int(codes.max()) >= NUM_CODES:
        raise ValueError(f"pack_codes: codes must be < {NUM_CODES}, got max {int(codes.max())}")
    lead = codes.shape[:-2]
    bits = (codes.unsqueeze(-1) >> torch.arange(TQ3_BITS, device=codes.device, dtype=torch.uint8)) & 1
    flat = torch.zeros(*lead, p * d * TQ3_BITS, dtype=torch.uint8, device=codes.device)
    flat.index_copy_(-1, index.reshape(-1), bits.reshape(*lead, -1))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).view(1, 8)
    return (flat.view(*lead, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


@lru_cache(maxsize=32)
def _code_reads(kind: str, page_size: int, head_dim: int, device: torch.device):
    """How to read each code of a head's block as 32-bit little-endian words: (word, shift) [P*D]
    of its lowest bit, and, for the codes whose three bits are not adjacent in one word (the
    spread pair of each triple), their flat positions with (word, shift) [3, n] of each bit."""
    if sys.byteorder != "little":
        raise RuntimeError("unpack_codes reads the code blocks as little-endian 32-bit words")
    index = _bit_index(kind, page_size, head_dim, device).view(-1, TQ3_BITS)
    low = index[:, 0]
    adjacent = (index[:, 1] == low + 1) & (index[:, 2] == low + 2) & (low // 32 == (low + 2) // 32)
    spread = torch.nonzero(~adjacent).flatten()
    bits = index[spread].T  # [3, n]
    return low // 32, (low % 32).to(torch.int32), spread, bits // 32, (bits % 32).to(torch.int32)


def unpack_codes(packed: torch.Tensor, kind: str, page_size: int, head_dim: int) -> torch.Tensor:
    """uint8 [..., P*D*3/8] -> uint8 codes [..., P, D] (inverse of pack_codes)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes expects uint8 bytes, got dtype={packed.dtype}")
    _check(kind, page_size, head_dim, packed.device)
    nbytes = page_size * head_dim * TQ3_BITS // 8
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"unpack_codes: page_size={page_size}, head_dim={head_dim} pack into {nbytes} bytes, "
            f"got last dim {packed.shape[-1]}"
        )
    word, shift, spread, spread_word, spread_shift = _code_reads(kind, page_size, head_dim, packed.device)
    # Bit i of the block is bit i % 32 of little-endian word i // 32 (nbytes is a multiple of 4).
    words = packed.contiguous().view(torch.int32)
    codes = (words[..., word] >> shift) & 7  # most codes: three adjacent bits of one word
    if spread.numel():
        parts = [((words[..., spread_word[b]] >> spread_shift[b]) & 1) << b for b in range(TQ3_BITS)]
        codes[..., spread] = parts[0] | parts[1] | parts[2]
    return codes.to(torch.uint8).view(*packed.shape[:-1], page_size, head_dim)
