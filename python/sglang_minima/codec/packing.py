"""3-bit code packing: 8 codes per 3 bytes (layout.py, "Codes")."""

from __future__ import annotations

import torch

from .layout import BYTES_PER_GROUP, CODES_PER_GROUP, NUM_CODES, TQ3_BITS


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 8) [..., D] -> uint8 [..., D*3/8]; codes c0..c7 of a group form the
    little-endian 24-bit word sum_j c_j << 3j."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes expects uint8 codes, got dtype={codes.dtype}")
    d = codes.shape[-1]
    if d % CODES_PER_GROUP != 0:
        raise ValueError(f"pack_codes needs a last dim that is a multiple of {CODES_PER_GROUP}, got {d}")
    if codes.numel() and int(codes.max()) >= NUM_CODES:
        raise ValueError(f"pack_codes: codes must be < {NUM_CODES}, got max {int(codes.max())}")
    groups = codes.reshape(*codes.shape[:-1], d // CODES_PER_GROUP, CODES_PER_GROUP).to(torch.int32)
    shifts = torch.arange(CODES_PER_GROUP, dtype=torch.int32, device=codes.device) * TQ3_BITS
    word = (groups << shifts).sum(-1, dtype=torch.int32)
    byte_shifts = torch.arange(BYTES_PER_GROUP, dtype=torch.int32, device=codes.device) * 8
    packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(*codes.shape[:-1], d * TQ3_BITS // 8)


def unpack_codes(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """uint8 [..., head_dim*3/8] -> uint8 codes [..., head_dim] (inverse of pack_codes)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes expects uint8 bytes, got dtype={packed.dtype}")
    if head_dim % CODES_PER_GROUP != 0:
        raise ValueError(f"unpack_codes needs head_dim to be a multiple of {CODES_PER_GROUP}, got {head_dim}")
    nbytes = head_dim * TQ3_BITS // 8
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"unpack_codes: head_dim={head_dim} packs into {nbytes} bytes, got last dim {packed.shape[-1]}"
        )
    b = packed.reshape(*packed.shape[:-1], head_dim // CODES_PER_GROUP, BYTES_PER_GROUP).to(torch.int32)
    byte_shifts = torch.arange(BYTES_PER_GROUP, dtype=torch.int32, device=packed.device) * 8
    word = (b << byte_shifts).sum(-1, dtype=torch.int32)
    shifts = torch.arange(CODES_PER_GROUP, dtype=torch.int32, device=packed.device) * TQ3_BITS
    codes = (word.unsqueeze(-1) >> shifts) & (NUM_CODES - 1)
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], head_dim)
