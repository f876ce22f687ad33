"""Byte accounting: matches the layout, the bits-per-element formulas and real encoded pages."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.codec.accounting import PageBytes, bytes_per_token_table, fp8_bytes, tq3_bits, tq3_bytes
from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import encode_pages


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bits_per_element(d):
    layout = TQ3PageLayout(num_kv_heads=4, page_size=64, head_dim=d)
    b = tq3_bytes(layout)
    elems = 4 * 64 * d
    assert tq3_bits(d).key == 3 + 16 / d and tq3_bits(d).value == 3 + 32 / d
    assert 8 * (b.payload + b.metadata) == pytest.approx(elems * (tq3_bits(d).key + tq3_bits(d).value))
    assert b.padding == 0 and b.total == layout.page_bytes
    assert fp8_bytes(4, 64, d).total == 2 * elems


@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_page_centered_keys_cost_one_fp16_per_page_head_and_dimension(d, key_bits):
    plain = TQ3PageLayout(num_kv_heads=4, page_size=64, head_dim=d, key_bits=key_bits)
    centered = TQ3PageLayout(num_kv_heads=4, page_size=64, head_dim=d, key_bits=key_bits, key_center=True)
    b, c = tq3_bytes(plain), tq3_bytes(centered)
    assert c.payload == b.payload and c.metadata - b.metadata == 4 * d * 2
    bits = tq3_bits(d, key_bits, centered_page_size=64)
    assert bits.key == key_bits + 16 / d + 16 / 64 and bits.value == tq3_bits(d, key_bits).value
    assert 8 * (c.payload + c.metadata) == pytest.approx(4 * 64 * d * (bits.key + bits.value))


@pytest.mark.parametrize("h,p,d", [(1, 16, 64), (3, 16, 192), (1, 48, 64), (5, 32, 320)])
def test_valid_layouts_need_no_padding(h, p, d):
    # 16-token pages and head dims that are multiples of 64 make every field a multiple of 16 bytes
    # (codes 3*h*p*d/8, each fp16 field 2*h*p), so a page block needs no alignment padding.
    layout = TQ3PageLayout(num_kv_heads=h, page_size=p, head_dim=d)
    b = tq3_bytes(layout)
    assert (b.payload, b.metadata) == (2 * h * p * d * 3 // 8, 3 * 2 * h * p)
    assert b.padding == 0 and b.total == layout.page_bytes == b.payload + b.metadata


def test_padding_counts_toward_the_page():
    b = PageBytes(payload=18, metadata=18, padding=12, page_size=3)
    assert b.total == 48 and b.per_token == 16


def test_encoded_page_size_matches_accounting():
    layout = TQ3PageLayout(2, 16, 64)
    k = torch.randn(1, 2, 16, 64)
    pages = encode_pages(k, k, layout, LayerRotation(2, 64, 0), tq3_codebook(64))
    assert pages.shape[1] == tq3_bytes(layout).total


def test_table():
    rows = {r["head_dim"]: r for r in bytes_per_token_table()}
    assert rows[128]["fp8_total"] == 256 and rows[128]["tq3_payload"] == 96 and rows[128]["tq3_metadata"] == 6
    assert rows[64]["fp8_over_tq3"] == pytest.approx(128 / 54)
