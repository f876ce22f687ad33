"""4-bit Stale values (``TQ3PageLayout.value_bits == 4``, ``--minima-value-bits 4``): the page's bytes,
the packing of value pairs (two nibbles 16 bits apart, four pairs a word), and the codec's recipes
with 16 levels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_minima.codec.accounting import tq3_bits
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.layout import LANES, VALUE, TQ3PageLayout, code4_bit_index, pair_coords
from sglang_minima.codec.packing import pack_codes, unpack_codes
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import (
    decode_pages,
    encode_pages,
    page_fields,
    quantize_keys,
    quantize_values,
    quantize_values_lloyd_max,
    value_codebook,
)

H, P = 2, 64


def _kv(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, P, d, generator=g) * 3, torch.randn(n, H, P, d, generator=g) + 0.5


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("value_code", ["uniform", "lloyd-max"])
def test_layout_gives_values_half_a_byte_per_element(d, key_bits, value_code):
    """Value codes take D/2 bytes a token and head instead of 3D/8; keys and metadata are unchanged,
    the metadata moves up by the D/8 bytes a token and head more."""
    lay = TQ3PageLayout(H, P, d, key_bits, value_code=value_code, value_bits=4)
    base = TQ3PageLayout(H, P, d, key_bits, value_code=value_code)
    assert lay.v_code_bytes_per_token == d // 2 and lay.v_head_code_bytes == P * d // 2
    assert lay.v_code_bytes - base.v_code_bytes == H * P * d // 8
    assert lay.v_lane_words == d // 16 and lay.k_lane_words == base.k_lane_words
    assert lay.k_code_bytes == base.k_code_bytes and lay.metadata_bytes == base.metadata_bytes
    assert lay.k_norm_offset == base.k_norm_offset + H * P * d // 8
    assert lay.kernel_unread == [f"{value_code} values (--minima-value-code {value_code})"] * (
        value_code != "uniform") + ["4-bit values (--minima-value-bits 4)"]
    with pytest.raises(ValueError, match="share only when both are 3-bit .*value_bits=4"):
        _ = lay.code_bytes


def test_the_default_pages_worked_bytes():
    # D = 64, 4-bit keys and values, uniform values: 32 + 32 code bytes + norm, scale, zero (2 B each)
    # = 70 bytes a token and head (3-bit values: 62; FP8: 128)
    lay = TQ3PageLayout(3, 64, 64, key_bits=4, value_bits=4)
    assert lay.page_bytes == 70 * 3 * 64 and TQ3PageLayout(3, 64, 64, key_bits=4).page_bytes == 62 * 3 * 64
    bits = tq3_bits(64, 4, value_bits=4)  # the accounting's bits per element: the same bytes
    assert (bits.key, bits.value) == (4 + 16 / 64, 4 + 32 / 64) and (bits.key + bits.value) * 64 / 8 == 70
    with pytest.raises(ValueError, match="TQ3 value codes are 3 or 4 bits wide, got value_bits=2"):
        TQ3PageLayout(3, 64, 64, value_bits=2)


def test_a_value_pair_is_two_nibbles_16_bits_apart_in_the_values_mma_order():
    """Pair ``p`` of lane ``l`` (tokens 2t, 2t + 1 of one dim: ``pair_coords``) is in word
    ``(32 chunk + l) D/16 + p // 4`` of the head's block: the even token's code in bits 4g..4g+3
    (g = p % 4), the odd token's 16 above, so ``(w >> 4g) & 0x000F000F`` holds the pair as an fp16x2's
    two mantissas (the decode's magic-number trick, as for 3-bit values)."""
    d = 64
    for lane in range(LANES):
        for pair in range(d // 4):
            (t0, d0), (t1, d1) = pair_coords(VALUE, lane, pair)
            assert (t1, d1) == (t0 + 1, d0)
            for chunk in (0, 3):
                word, g = (chunk * LANES + lane) * (d // 16) + pair // 4, pair % 4
                for b in range(4):
                    assert code4_bit_index(VALUE, 16 * chunk + t0, d0, b, d) == 32 * word + 4 * g + b
                    assert code4_bit_index(VALUE, 16 * chunk + t1, d1, b, d) == 32 * word + 16 + 4 * g + b
    # worked example: (token 3, dim 9) is lane 4*1 + 1 (r = 9 % 8, t = 3 // 2), register 1 of block 0
    # (dim 9 >= 8): pair 1 of word 5 * 4 = 20, slot 1, the odd token: bits 16 + 4 .. 16 + 7 of the
    # word, i.e. byte 4 * 20 + 2 = 82, its high nibble
    codes = torch.zeros(16, d, dtype=torch.uint8)
    codes[3, 9] = 0xB
    packed = pack_codes(codes, VALUE, bits=4)
    assert packed.numel() == 16 * d // 2 and packed.nonzero().flatten().tolist() == [82] and int(packed[82]) == 0xB0
    # the decode's view: every pair of a random block is one shift and one mask of its word
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, d), generator=g, dtype=torch.uint8)
    words = pack_codes(codes, VALUE, bits=4).view(torch.int32)
    for lane in (0, 5, 31):
        for pair in range(d // 4):
            (t0, d0), (t1, d1) = pair_coords(VALUE, lane, pair)
            w = int(words[lane * (d // 16) + pair // 4]) & 0xFFFFFFFF
            both = (w >> 4 * (pair % 4)) & 0x000F000F
            assert (both & 0xFFFF, both >> 16) == (int(codes[t0, d0]), int(codes[t1, d1]))


@settings(max_examples=25, deadline=None)
@given(page_size=st.sampled_from([16, 64]), d=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_value_codes_round_trip(page_size, d, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (3, page_size, d), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, VALUE, bits=4)
    assert packed.shape == (3, page_size * d // 2)
    assert torch.equal(unpack_codes(packed, VALUE, page_size, d, bits=4), codes)


@pytest.mark.parametrize("value_code", ["uniform", "lloyd-max"])
def test_the_recipes_with_16_levels(value_code):
    """Key fields bit for bit those of 3-bit-value pages; uniform values: codes and fp16 scale / zero of
    the min/max grid with 15 steps; lloyd-max values: the 4-bit key recipe's codes and the fp16
    least-squares scale; decode: scale * c + zero, or scale * centroids[c]."""
    d = 128
    lay = TQ3PageLayout(H, P, d, 4, value_code=value_code, value_bits=4)
    base = TQ3PageLayout(H, P, d, 4, value_code=value_code)
    rot, cb = LayerRotation(H, d, layer_id=2), key_codebook(d, 4)
    k, v = _kv(2, d, seed=11)
    v[1, 0, 5] = 0.0  # an all-zero value: codes 0, scale 0
    pages, ref = encode_pages(k, v, lay, rot, cb), encode_pages(k, v, base, rot, cb)
    f, g = page_fields(pages, lay), page_fields(ref, base)
    assert torch.equal(f.k_codes, g.k_codes) and torch.equal(f.k_norm, g.k_norm)
    v_rot = rot.rotate(v, head_axis=-3)
    codes = unpack_codes(f.v_codes, VALUE, P, d, bits=4)
    assert int(codes.max()) == 15 and int(codes[1, 0, 5].count_nonzero()) == 0 and float(f.v_scale[1, 0, 5]) == 0.0
    _, v_hat = decode_pages(pages, lay, cb)
    if value_code == "uniform":
        want_codes, scale, zero = quantize_values(v_rot, 4)
        lo, hi = v_rot.amin(-1), v_rot.amax(-1)
        assert torch.equal(scale, ((hi - lo) / 15).to(torch.float16)) and torch.equal(zero, lo.to(torch.float16))
        assert torch.equal(f.v_scale, scale) and torch.equal(f.v_zero, zero) and torch.equal(codes, want_codes)
        assert torch.equal(v_hat, scale.float().unsqueeze(-1) * codes.float() + zero.float().unsqueeze(-1))
    else:
        book = value_codebook(d, 4)
        assert book is key_codebook(d, 4) and f.v_zero is None
        assert torch.equal(codes, quantize_keys(v_rot, book)[0])
        c = book.centroids[codes.long()].double()
        ls = (v_rot.double() * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-300)
        assert torch.equal(f.v_scale, ls.to(torch.float16))
        assert torch.equal(quantize_values_lloyd_max(v_rot, book)[1], f.v_scale)
        assert torch.equal(v_hat, f.v_scale.float().unsqueeze(-1) * book.centroids[codes.long()])
    end = lay.payload_bytes + lay.metadata_bytes
    assert torch.count_nonzero(pages[:, end:]) == 0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_16_levels_cut_the_values_error(d):
    """What the bit buys on rotated values: the uniform grid's step is 7/15 of the 3-bit one's, so its
    squared error (7/15)^2 = 0.22 of it; the Lloyd-Max levels' error falls 3-4x (0.0095 against 0.034
    per unit variance on the sphere's density)."""
    rot, cb = LayerRotation(H, d, layer_id=1), key_codebook(d, 4)
    k, v = _kv(4, d, seed=d)
    v_rot = rot.rotate(v, head_axis=-3)

    def err(value_code: str, bits: int) -> float:
        lay = TQ3PageLayout(H, P, d, 4, value_code=value_code, value_bits=bits)
        v_hat = decode_pages(encode_pages(k, v, lay, rot, cb), lay, cb)[1]
        return float(((v_hat - v_rot) ** 2).sum() / (v_rot**2).sum())

    assert 0.19 < err("uniform", 4) / err("uniform", 3) < 0.25
    assert 0.25 < err("lloyd-max", 4) / err("lloyd-max", 3) < 0.3  # 0.27-0.28 at d = 64, 128, 256
