"""TQ3P: the packed byte layout of one Stale (TQ3) page, defined once.

The torch codec, the TileLang kernels and the byte accounting all import these constants and
``TQ3PageLayout``; docs/TQ3P.md describes the same layout in prose with byte offsets.

One TQ3 page holds ``page_size`` tokens of one layer, all KV heads. It is one contiguous uint8 block:

    offset 0                       k_codes  uint8 [num_kv_heads, page_size, head_dim*3/8]
    + code_bytes                   v_codes  uint8 [num_kv_heads, page_size, head_dim*3/8]
    + 2*code_bytes                 k_norm   fp16  [num_kv_heads, page_size]   key norm correction
    + 2*code_bytes + meta          v_scale  fp16  [num_kv_heads, page_size]
    + 2*code_bytes + 2*meta        v_zero   fp16  [num_kv_heads, page_size]

(code_bytes = H*P*D*3/8, meta = H*P*2.) Head-major inside the page so that one CTA working on one
KV head reads one contiguous run of codes and one of metadata per page (coalesced loads).

Codes: 3 bits each, 8 codes per 3 bytes. Codes c0..c7 of coordinates 8g..8g+7 form the little-endian
24-bit word w = sum_j c_j << (3*j), stored as bytes (w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF)
at byte offset 3g of the token's code row.

LSE convention for every Minima attention op (torch and GPU): base 2, as FlashInfer returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

TQ3_BITS = 3
CODES_PER_GROUP = 8  # codes packed per group
BYTES_PER_GROUP = 3  # 8 codes * 3 bits = 24 bits
NUM_CODES = 1 << TQ3_BITS
META_DTYPE_BYTES = 2  # fp16 norm / scale / zero
K_META_FIELDS = 1  # k_norm
V_META_FIELDS = 2  # v_scale, v_zero
FP8_BYTES = 1  # e4m3
PAGE_ALIGN = 16  # page blocks start on 16-byte boundaries (vectorized loads)

LSE_BASE = 2.0


@dataclass(frozen=True)
class TQ3PageLayout:
    """Byte offsets of one TQ3P page for a given (num_kv_heads, page_size, head_dim)."""

    num_kv_heads: int
    page_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % CODES_PER_GROUP != 0:
            raise ValueError(
                f"TQ3 needs head_dim to be a positive multiple of {CODES_PER_GROUP}, got {self.head_dim}"
            )
        if self.page_size <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"TQ3 needs positive page_size and num_kv_heads, got {self.page_size}, {self.num_kv_heads}"
            )

    @property
    def code_bytes_per_token(self) -> int:
        """Packed code bytes of one token of one head (K or V)."""
        return self.head_dim * TQ3_BITS // 8

    @property
    def code_bytes(self) -> int:
        """Packed code bytes of one page, K or V."""
        return self.num_kv_heads * self.page_size * self.code_bytes_per_token

    @property
    def meta_bytes(self) -> int:
        """Bytes of one fp16 metadata field over one page."""
        return self.num_kv_heads * self.page_size * META_DTYPE_BYTES

    @property
    def k_codes_offset(self) -> int:
        return 0

    @property
    def v_codes_offset(self) -> int:
        return self.code_bytes

    @property
    def k_norm_offset(self) -> int:
        return 2 * self.code_bytes

    @property
    def v_scale_offset(self) -> int:
        return 2 * self.code_bytes + self.meta_bytes

    @property
    def v_zero_offset(self) -> int:
        return 2 * self.code_bytes + 2 * self.meta_bytes

    @property
    def payload_bytes(self) -> int:
        """Code bytes of one page (K and V)."""
        return 2 * self.code_bytes

    @property
    def metadata_bytes(self) -> int:
        """Norm / scale / zero bytes of one page."""
        return (K_META_FIELDS + V_META_FIELDS) * self.meta_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page block including alignment padding."""
        raw = self.payload_bytes + self.metadata_bytes
        return (raw + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN


def fp8_page_bytes(num_kv_heads: int, page_size: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """Bytes of one FP8 page of one layer (K and V, no metadata: scales are per layer)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return num_kv_heads * page_size * (head_dim + v_head_dim) * FP8_BYTES
