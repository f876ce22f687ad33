"""Byte accounting of FP8 and TQ3 pages, from layout.py's constants only."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import (
    FP8_BYTES,
    K_META_FIELDS,
    META_DTYPE_BYTES,
    TQ3_BITS,
    UNIFORM_VALUES,
    TQ3PageLayout,
    fp8_page_bytes,
    value_meta_fields,
)


@dataclass(frozen=True)
class PageBytes:
    """Bytes of one page of one layer (all KV heads, K and V)."""

    payload: int  # element bytes (FP8 values or packed codes)
    metadata: int  # per-token fp16 norm / scale / zero (FP8: none, its scales are per layer)
    padding: int  # alignment bytes at the end of a page block
    page_size: int

    @property
    def total(self) -> int:
        return self.payload + self.metadata + self.padding

    @property
    def per_token(self) -> float:
        """Bytes per token of one layer, padding included."""
        return self.total / self.page_size


def fp8_bytes(num_kv_heads: int, page_size: int, head_dim: int) -> PageBytes:
    return PageBytes(fp8_page_bytes(num_kv_heads, page_size, head_dim), 0, 0, page_size)


def tq3_bytes(layout: TQ3PageLayout) -> PageBytes:
    raw = layout.payload_bytes + layout.metadata_bytes
    return PageBytes(layout.payload_bytes, layout.metadata_bytes, layout.page_bytes - raw, layout.page_size)


@dataclass(frozen=True)
class BitsPerElement:
    key: float
    value: float

    @property
    def mean(self) -> float:
        return (self.key + self.value) / 2


def fp8_bits(head_dim: int) -> BitsPerElement:
    return BitsPerElement(8.0 * FP8_BYTES, 8.0 * FP8_BYTES)


def tq3_bits(
    head_dim: int,
    key_bits: int = TQ3_BITS,
    centered_page_size: int | None = None,
    value_code: str = UNIFORM_VALUES,
    value_bits: int = TQ3_BITS,
) -> BitsPerElement:
    """Keys key_bits + 16/d (3 or 4), values value_bits + 32/d (3 or 4; ``lloyd-max`` values: + 16/d;
    metadata included, page padding excluded); page-centered keys (``TQ3PageLayout.key_center``, pages of
    ``centered_page_size`` tokens) add 16/page_size to the keys: one fp16 mean per page, head and
    dimension."""
    meta_bits = 8 * META_DTYPE_BYTES
    center = meta_bits / centered_page_size if centered_page_size else 0.0
    return BitsPerElement(
        key_bits + K_META_FIELDS * meta_bits / head_dim + center,
        value_bits + value_meta_fields(value_code) * meta_bits / head_dim,
    )


def bytes_per_token_table(
    head_dims: tuple[int, ...] = (64, 128, 256), num_kv_heads: int = 1, page_size: int = 64, key_bits: int = TQ3_BITS
) -> list[dict[str, float | int]]:
    """Per layer, per token: FP8 vs TQ3 bytes (keys of ``key_bits`` bits), payload and metadata
    separately, and the ratio."""
    rows = []
    for d in head_dims:
        f = fp8_bytes(num_kv_heads, page_size, d)
        t = tq3_bytes(TQ3PageLayout(num_kv_heads, page_size, d, key_bits))
        rows.append(
            {
                "head_dim": d,
                "key_bits": key_bits,
                "num_kv_heads": num_kv_heads,
                "page_size": page_size,
                "fp8_payload": f.payload / page_size,
                "fp8_metadata": f.metadata / page_size,
                "fp8_total": f.per_token,
                "tq3_payload": t.payload / page_size,
                "tq3_metadata": t.metadata / page_size,
                "tq3_padding": t.padding / page_size,
                "tq3_total": t.per_token,
                "tq3_bits_k": tq3_bits(d, key_bits).key,
                "tq3_bits_v": tq3_bits(d, key_bits).value,
                "fp8_over_tq3": f.per_token / t.per_token,
            }
        )
    return rows
