"""3-bit packing: exact round trips, the documented bit order, bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_minima.codec.packing import pack_codes, unpack_codes


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    groups=st.integers(1, 32),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip(lead, groups, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (*lead, groups * 8), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (*lead, groups * 3)
    assert torch.equal(unpack_codes(packed, groups * 8), codes)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(min_size=3, max_size=96).filter(lambda b: len(b) % 3 == 0))
def test_every_byte_string_round_trips(data):
    packed = torch.tensor(list(data), dtype=torch.uint8)
    d = len(data) * 8 // 3
    assert torch.equal(pack_codes(unpack_codes(packed, d)), packed)


def test_bit_order_is_little_endian_24_bit_word():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    w = sum(c << (3 * j) for j, c in enumerate(codes.tolist()))
    assert pack_codes(codes).tolist() == [w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF]
    one_hot = torch.zeros(8, dtype=torch.uint8)
    one_hot[7] = 7
    assert pack_codes(one_hot).tolist() == [0, 0, 0b11100000]


def test_bad_inputs():
    with pytest.raises(ValueError, match="got max 8"):
        pack_codes(torch.full((8,), 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        pack_codes(torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        pack_codes(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="packs into 24 bytes, got last dim 23"):
        unpack_codes(torch.zeros(23, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="got 60"):
        unpack_codes(torch.zeros(24, dtype=torch.uint8), 60)
