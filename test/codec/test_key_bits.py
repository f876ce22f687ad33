"""4-bit Stale keys (``TQ3PageLayout.key_bits == 4``): the layout's bytes and offsets, the one-byte
pair packing in MMA order, the 16-level codebook, the codec against the emulation that measured it
(benchmark/quality/stale_probe.py, mode k4), and the byte accounting."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_minima.codec.accounting import bytes_per_token_table, tq3_bits, tq3_bytes
from sglang_minima.codec.codebook import key_codebook, lloyd_max, tq3_codebook
from sglang_minima.codec.layout import (
    CHUNK_TOKENS,
    KEY,
    LANES,
    VALUE,
    TQ3PageLayout,
    key4_bit_index,
    key4_word,
    key4_word_codes,
    pair_coords,
)
from sglang_minima.codec.packing import key_pair_fields, pack_codes, unpack_codes
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import (
    decode_page_keys,
    decode_pages,
    encode_pages,
    page_fields,
    quantize_keys,
    to_original_space,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))
from stale_probe import MinimaEmulation  # noqa: E402


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_key4_word_builds_and_unpacks_the_packed_words(head_dim):
    # layout.key4_word / key4_word_codes are how the conversion kernels pack and unpack 4-bit keys: one
    # uint32 word at a time, lane and word symbolic. With every lane and word at once (the kernels'
    # threads) they give pack_codes' words, and the codes back.
    page_size = 32
    layout = TQ3PageLayout(1, page_size, head_dim, key_bits=4)
    codes = torch.randint(0, 16, (page_size, head_dim), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    words = pack_codes(codes, KEY, 4).view(torch.int32)
    words = words.view(page_size // CHUNK_TOKENS, LANES, layout.k_lane_words)  # chunk, lane, word
    lane = torch.arange(LANES).view(-1, 1)
    word = torch.arange(layout.k_lane_words).view(1, -1)
    for chunk in range(page_size // CHUNK_TOKENS):
        chunk_codes = codes[chunk * CHUNK_TOKENS : (chunk + 1) * CHUNK_TOKENS].to(torch.int64)
        got = key4_word(lane, word, lambda t, d: chunk_codes[t, d])
        assert torch.equal(got, words[chunk].to(torch.int64) & 0xFFFFFFFF), chunk
        back = torch.zeros_like(chunk_codes)
        for g, (low, high) in enumerate(key4_word_codes(words[chunk])):  # signed int32 words
            (t0, d0), (t1, d1) = pair_coords(KEY, lane.expand_as(got), 4 * word.expand_as(got) + g)
            back[t0, d0], back[t1, d1] = low.to(torch.int64), high.to(torch.int64)
        assert torch.equal(back, chunk_codes), chunk
    assert key4_word(7, 1, lambda t, d: int(codes[t, d])) == int(words[0, 7, 1]) & 0xFFFFFFFF


@pytest.mark.parametrize("h, p, d", [(1, 64, 64), (2, 64, 64), (3, 16, 128), (1, 64, 128), (2, 32, 256)])
def test_four_bit_key_block_is_half_a_byte_per_element(h, p, d):
    lay = TQ3PageLayout(h, p, d, key_bits=4)
    tq3 = TQ3PageLayout(h, p, d)
    meta = 2 * h * p
    assert lay.k_code_bytes == h * p * d // 2 and lay.k_head_code_bytes == p * d // 2
    assert lay.v_code_bytes == tq3.v_code_bytes == h * p * 3 * d // 8  # values unchanged
    assert lay.k_lane_words == d // 16 and lay.v_lane_words == 3 * d // 64
    assert lay.k_codes_offset == 0
    assert lay.v_codes_offset == h * p * d // 2
    assert lay.k_norm_offset == h * p * d // 2 + h * p * 3 * d // 8
    assert lay.v_scale_offset == lay.k_norm_offset + meta
    assert lay.v_zero_offset == lay.k_norm_offset + 2 * meta
    assert lay.page_bytes == lay.v_zero_offset + meta  # no padding: every field is a multiple of 16
    assert lay.page_bytes - tq3.page_bytes == h * p * d // 8  # +1 bit per key element


def test_three_bit_layout_is_unchanged():
    # the doc's example (D = 128, H = 1, P = 64) and the shared 3-bit block the kernels read
    lay = TQ3PageLayout(1, 64, 128)
    assert (lay.code_bytes, lay.head_code_bytes, lay.lane_words, lay.page_bytes) == (3072, 3072, 6, 6528)
    assert (lay.k_code_bytes, lay.v_code_bytes, lay.k_lane_words) == (3072, 3072, 6)
    assert (lay.v_codes_offset, lay.k_norm_offset, lay.v_scale_offset, lay.v_zero_offset) == (3072, 6144, 6272, 6400)
    assert TQ3PageLayout(1, 64, 128, key_bits=4).page_bytes == 4096 + 3072 + 3 * 128


def test_shared_code_sizes_refuse_four_bit_keys():
    lay = TQ3PageLayout(2, 16, 64, key_bits=4)
    for name in ("code_bytes", "head_code_bytes", "code_bytes_per_token", "lane_words"):
        with pytest.raises(ValueError, match=f"use k_{name} / v_{name}"):
            getattr(lay, name)
    with pytest.raises(ValueError, match="key codes are 3 or 4 bits wide, got key_bits=5"):
        TQ3PageLayout(2, 16, 64, key_bits=5)
    with pytest.raises(ValueError, match="got key_bits=2"):
        TQ3PageLayout(2, 16, 64, key_bits=2)


# ---------------------------------------------------------------- packing


def _rule_byte(token: int, dim: int, head_dim: int) -> tuple[int, int]:
    """(byte, nibble) of the 4-bit key code of (token, dim), straight from the prose of docs/TQ3P.md:
    lane 4r + t, pair 4*kb + g with token r + 8(g & 1), dims 16kb + 2t + 8(g >> 1) (low) and the
    next; a lane stream is D/4 bytes, one pair per byte, low code in the low nibble."""
    chunk, tc = divmod(token, CHUNK_TOKENS)
    kb, dd = divmod(dim, 16)
    r, g_lo = tc % 8, tc // 8
    t, g_hi, half = (dd % 8) // 2, dd // 8, dd % 2
    lane, pair = 4 * r + t, 4 * kb + g_lo + 2 * g_hi
    return (chunk * LANES + lane) * (head_dim // 4) + pair, half


def test_hand_made_codes_land_in_the_documented_nibbles():
    codes = torch.zeros(32, 64, dtype=torch.uint8)
    codes[9, 2], codes[9, 3] = 0x5, 0xA  # lane 5 (r 1, t 1), pair 1 (register 1 of block 0): byte 5*16 + 1
    codes[9, 58], codes[9, 59] = 0xF, 0x1  # block 3, register 3: pair 15 of lane 5, byte 95
    codes[17, 0] = 0x7  # chunk 1, lane 4, pair 0: byte (32 + 4) * 16
    codes[0, 1] = 0xC  # lane 0, pair 0, high nibble: byte 0
    codes[15, 63] = 0x3  # r 7, t 3 (lane 31), block 3, register 3: byte 31*16 + 15, high nibble
    packed = pack_codes(codes, KEY, bits=4)
    assert packed.shape == (32 * 64 // 2,)
    expected = torch.zeros_like(packed)
    expected[81], expected[95], expected[576], expected[0], expected[511] = 0xA5, 0x1F, 0x07, 0xC0, 0x30
    assert torch.equal(packed, expected)
    # as little-endian words: word 0 of lane 5 (bytes 80..83) holds registers 0..3 of block 0
    assert int(packed.view(torch.int32)[20]) == 0xA5 << 8


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
def test_every_code_follows_the_byte_rule(head_dim, page_size):
    g = torch.Generator().manual_seed(head_dim * page_size)
    codes = torch.randint(0, 16, (page_size, head_dim), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, KEY, bits=4)
    for token in range(0, page_size, 5):
        for dim in range(head_dim):
            byte, half = _rule_byte(token, dim, head_dim)
            assert (int(packed[byte]) >> (4 * half)) & 0xF == int(codes[token, dim])
            assert key4_bit_index(token, dim, 0, head_dim) == 8 * byte + 4 * half


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_follow_the_mma_pair_order(head_dim):
    """Byte ``pair`` of lane ``lane``'s stream holds the codes ``pair_coords`` gives that pair: the
    3-bit keys' fragment order, so a kernel reads 4-bit keys with the same lane / register mapping."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (CHUNK_TOKENS, head_dim), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, KEY, bits=4)
    for lane in range(LANES):
        for pair in range(head_dim // 4):
            (t0, d0), (t1, d1) = pair_coords(KEY, lane, pair)
            byte = int(packed[lane * head_dim // 4 + pair])
            assert (byte & 0xF, byte >> 4) == (int(codes[t0, d0]), int(codes[t1, d1]))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
def test_round_trip(head_dim, page_size):
    g = torch.Generator().manual_seed(head_dim + page_size)
    codes = torch.randint(0, 16, (2, 3, page_size, head_dim), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, KEY, bits=4)
    assert packed.shape == (2, 3, page_size * head_dim // 2)
    assert torch.equal(unpack_codes(packed, KEY, page_size, head_dim, bits=4), codes)


@settings(max_examples=50, deadline=None)
@given(data=st.binary(min_size=512, max_size=512))
def test_every_byte_string_round_trips(data):
    packed = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    codes = unpack_codes(packed, KEY, 16, 64, bits=4)
    assert int(codes.max()) < 16
    assert torch.equal(pack_codes(codes, KEY, bits=4), packed)


@settings(max_examples=20, deadline=None)
@given(
    page_size=st.sampled_from([16, 32, 64]),
    head_dim=st.sampled_from([64, 128, 256]),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_key_pair_fields_are_the_pair_bytes(page_size, head_dim, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (blocks, page_size, head_dim), generator=g, dtype=torch.uint8)
    words = pack_codes(codes, KEY, bits=4).view(torch.int32)
    fields = key_pair_fields(words, page_size, head_dim, key_bits=4)
    want = codes[..., 0::2].to(torch.int32) | (codes[..., 1::2].to(torch.int32) << 4)
    assert fields.dtype == torch.int32 and torch.equal(fields, want.reshape(blocks, -1))


def test_bad_inputs():
    with pytest.raises(ValueError, match="4-bit codes must be < 16, got max 16"):
        pack_codes(torch.full((16, 64), 16, dtype=torch.uint8), KEY, bits=4)
    with pytest.raises(ValueError, match="TQ3 value codes are 3 or 4 bits wide, got value_bits=5"):
        pack_codes(torch.zeros(16, 64, dtype=torch.uint8), VALUE, bits=5)
    with pytest.raises(ValueError, match=r"\(4-bit codes\) pack into 512 bytes, got last dim 384"):
        unpack_codes(torch.zeros(384, dtype=torch.uint8), KEY, 16, 64, bits=4)
    with pytest.raises(ValueError, match="need 128 words of 4-bit keys, got 96"):
        key_pair_fields(torch.zeros(96, dtype=torch.int32), 16, 64, key_bits=4)


# ---------------------------------------------------------------- codebook


def test_key_codebook():
    assert key_codebook(64, 3) is tq3_codebook(64)  # 3-bit keys: TQ3's codebook, the same bits
    book = key_codebook(128, 4)
    assert key_codebook(128, 4) is book  # cached
    assert book.levels == 16 and book.thresholds.numel() == 15
    assert book.centroids.dtype == book.thresholds.dtype == torch.float32
    assert bool((book.centroids.diff() > 0).all())
    assert torch.equal(book.centroids, -book.centroids.flip(0))  # symmetric density
    c, mse = lloyd_max(128, 16)  # deterministic: the same float64 iteration, rounded once
    assert torch.equal(book.centroids, c.to(torch.float32)) and book.mse == mse
    assert torch.equal(book.thresholds, (0.5 * (c[1:] + c[:-1])).to(torch.float32))
    assert book.mse < tq3_codebook(128).mse / 3  # about 0.0095 vs 0.0345 per unit variance
    with pytest.raises(ValueError, match="got bits=5"):
        key_codebook(64, 5)


# ---------------------------------------------------------------- codec


def _kv(n: int, h: int, p: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, p, d, generator=g) * 3, torch.randn(n, h, p, d, generator=g)


@pytest.mark.parametrize("d", [64, 128])
def test_four_bit_keys_beat_three_bit_keys_values_unchanged(d):
    k, v = _kv(3, 2, 64, d, seed=d)
    k[0, 0, 5] = 0  # a zero key: codes 0, norm 0 in both widths
    rot = LayerRotation(2, d, layer_id=1)
    k_rot = rot.rotate(k, head_axis=-3)
    err = {}
    fields = {}
    for bits in (3, 4):
        lay, book = TQ3PageLayout(2, 64, d, key_bits=bits), key_codebook(d, bits)
        pages = encode_pages(k, v, lay, rot, book)
        assert pages.shape == (3, lay.page_bytes)
        k_hat, v_hat = decode_pages(pages, lay, book)
        assert torch.equal(decode_page_keys(pages, lay, book), k_hat)
        assert float(k_hat[0, 0, 5].abs().max()) == 0.0
        # the norm correction keeps each key's norm (up to fp16 rounding) in both widths
        torch.testing.assert_close(k_hat.norm(dim=-1), k_rot.norm(dim=-1), rtol=1e-3, atol=1e-6)
        err[bits] = float(((k_hat - k_rot) ** 2).sum() / (k_rot**2).sum())
        fields[bits] = (page_fields(pages, lay), v_hat)
    assert err[4] < err[3] / 3, err
    (f3, v3), (f4, v4) = fields[3], fields[4]
    assert torch.equal(f3.v_codes, f4.v_codes) and torch.equal(f3.v_scale, f4.v_scale)
    assert torch.equal(f3.v_zero, f4.v_zero) and torch.equal(v3, v4)


@pytest.mark.parametrize("d", [64, 128])
def test_four_bit_keys_equal_the_emulations_finer_keys(d):
    """The served codec gives the keys stale_probe's ``k4`` mode measured (its ``_finer_keys``: the
    same recipe in plain torch ops), up to fp32 rounding."""
    k, v = _kv(4, 3, 64, d, seed=11 * d)
    rot = LayerRotation(3, d, layer_id=4, seed=9)
    lay, book = TQ3PageLayout(3, 64, d, key_bits=4), key_codebook(d, 4)
    got = decode_pages(encode_pages(k, v, lay, rot, book), lay, book)[0]
    k_rot = rot.rotate(k, head_axis=-3)
    want = MinimaEmulation._finer_keys(SimpleNamespace(head_dim=d), k_rot, 4)
    # A coordinate within fp32 rounding of a threshold may take the neighbouring code (the emulation
    # divides by a float64 sqrt(d) and torch's norm, the codec rounds each step as docs/TQ3P.md says);
    # such a flip moves that token's norm correction too. Every other token: the same keys.
    u = k_rot * (d**0.5 / k_rot.norm(dim=-1, keepdim=True))  # _finer_keys's coordinates
    flipped = quantize_keys(k_rot, book)[0] != torch.bucketize(u, book.thresholds)
    gap = (u[flipped].view(-1, 1) - book.thresholds.view(1, -1)).abs().amin(1)
    assert bool((gap < 1e-5).all()), gap
    assert int(flipped.sum()) <= 2  # rare: within a few ulps of one of 15 thresholds
    same = ~flipped.any(-1)
    torch.testing.assert_close(got[same], want[same], rtol=1e-3, atol=1e-6)  # fp16 norms one ulp apart at most


@pytest.mark.parametrize("d", [64, 128])
def test_emulated_lloyd_max_values_are_the_codec_benchmarks_tq3_lmv(d):
    """stale_probe's ``k4lmv`` values are benchmark/codec's ``tq3-lmv`` values (the variant #17 asks
    to measure): the same codes and fp16 least-squares scale per token, up to threshold ties; and
    they reconstruct with less error than TQ3's scale/zero values, as codec.md measured."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "codec"))
    from methods import _tq3_lloyd_values

    k, v = _kv(1, 3, 256, d, seed=5 * d)
    k, v = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()  # [tokens, heads, d]
    want = _tq3_lloyd_values(k, v, layer_id=2)[1]
    rot = LayerRotation(3, d, 2)
    got = rot.unrotate(MinimaEmulation._lloyd_max_values(SimpleNamespace(head_dim=d), rot.rotate(v)))
    close = torch.isclose(got, want, rtol=1e-3, atol=1e-5).all(-1)
    assert float(close.float().mean()) > 0.98, float(close.float().mean())  # a tie moves one token's scale
    # TQ3's values (scale/zero, 3 + 32/d bits) through real pages, against these (3 + 16/d bits)
    lay, book = TQ3PageLayout(3, 256, d), tq3_codebook(d)
    pages = v.permute(1, 0, 2).unsqueeze(0)  # [1, heads, tokens, d]
    tq3 = to_original_space(decode_pages(encode_pages(pages, pages, lay, rot, book), lay, book)[1], rot)
    rel = lambda x: float(((x - v) ** 2).sum() / (v**2).sum())  # noqa: E731
    assert rel(got) < 0.95 * rel(tq3[0].permute(1, 0, 2)), (rel(got), rel(tq3[0].permute(1, 0, 2)))


@pytest.mark.parametrize("d", [64, 128])
def test_emulated_4bit_values_are_the_value_grid_with_16_levels(d):
    """stale_probe's ``k4v4`` values: TQ3's per-token min/max grid with 16 levels, so every value lies
    within half a step of its token's 4-bit grid, the fp16 scale is (max - min) / 15, and the error
    falls to (7/15)^2 of the 3-bit grid's through real pages (the step is 7/15 of its step)."""
    _, v = _kv(1, 3, 256, d, seed=7 * d)
    rot = LayerRotation(3, d, 2)
    v_rot = rot.rotate(v, head_axis=-3)[0]  # [heads, tokens, d]
    got = MinimaEmulation._wider_values(v_rot, 4)
    lo, hi = v_rot.amin(-1, keepdim=True), v_rot.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).to(torch.float16).float()
    assert bool(((got - v_rot).abs() <= step / 2 + 1e-3 * step + 1e-6).all())
    levels = (got - lo.to(torch.float16).float()) / step
    assert float((levels - levels.round()).abs().max()) < 1e-3  # on the grid
    assert int(levels.round().max()) == 15 and int(levels.round().min()) == 0
    lay, book = TQ3PageLayout(3, 256, d), tq3_codebook(d)
    tq3 = decode_pages(encode_pages(v, v, lay, rot, book), lay, book)[1][0]  # rotated, [heads, tokens, d]
    rel = lambda x: float(((x - v_rot) ** 2).sum() / (v_rot**2).sum())  # noqa: E731
    assert 0.19 < rel(got) / rel(tq3) < 0.25, (rel(got), rel(tq3))  # (7/15)^2 = 0.218: the step ratio squared


@pytest.mark.parametrize("bits", [3, 4])
def test_emulated_centered_keys_are_the_codec_benchmarks(bits):
    """stale_probe's ``+center`` keys are the codec's page-centered keys (``key_center`` TQ3P pages, what
    benchmark/codec's ``tq3-center`` / ``tq3-k4-center`` measure), up to threshold ties; on keys sharing an offset per head, as post-RoPE
    keys do, they reconstruct with far less error than the plain code of the same width."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "codec"))
    from methods import _tq3_pages

    d = 64
    k, v = _kv(2, 3, 64, d, seed=13 + bits)
    k = k + 3 * k.std() * torch.randn(1, 3, 1, d, generator=torch.Generator().manual_seed(bits))  # an offset per head, 3x the spread
    k_tok, v_tok = k.transpose(1, 2).reshape(-1, 3, d), v.transpose(1, 2).reshape(-1, 3, d)  # [tokens, heads, d]
    want = _tq3_pages(bits, key_center=True)(k_tok, v_tok, layer_id=3)[0]
    rot = LayerRotation(3, d, 3)
    emu = SimpleNamespace(head_dim=d, _finer_keys=lambda x, b: MinimaEmulation._finer_keys(emu, x, b))
    got = rot.unrotate(MinimaEmulation._centered_keys(emu, rot.rotate(k, head_axis=-3), bits), head_axis=-3)
    got = got.transpose(1, 2).reshape(-1, 3, d)
    close = torch.isclose(got, want, rtol=1e-3, atol=1e-4).all(-1)
    assert float(close.float().mean()) > 0.98, float(close.float().mean())
    rel = lambda x: float(((x - k_tok) ** 2).sum() / (k_tok**2).sum())  # noqa: E731
    assert rel(want) < rel(_tq3_pages(bits)(k_tok, v_tok, layer_id=3)[0]) / 5


def test_codebook_must_match_the_layout():
    k, v = _kv(1, 1, 16, 64, seed=0)
    rot = LayerRotation(1, 64, layer_id=0)
    lay4, lay3 = TQ3PageLayout(1, 16, 64, key_bits=4), TQ3PageLayout(1, 16, 64)
    with pytest.raises(ValueError, match="encode_pages: the layout's keys are 4-bit"):
        encode_pages(k, v, lay4, rot, tq3_codebook(64))
    pages = encode_pages(k, v, lay3, rot, tq3_codebook(64))
    with pytest.raises(ValueError, match="the codebook has 16 levels"):
        decode_pages(pages, lay3, key_codebook(64, 4))


# ---------------------------------------------------------------- accounting


def test_accounting_of_four_bit_keys():
    assert tq3_bits(64, 4).key == 4 + 16 / 64 and tq3_bits(64, 4).value == tq3_bits(64).value == 3 + 32 / 64
    assert tq3_bits(128).key == 3 + 16 / 128
    lay = TQ3PageLayout(1, 64, 128, key_bits=4)
    pb = tq3_bytes(lay)
    assert (pb.payload, pb.metadata, pb.padding, pb.total) == (4096 + 3072, 384, 0, lay.page_bytes)
    rows = {r["head_dim"]: r for r in bytes_per_token_table(key_bits=4)}
    # bytes per token and head: D = 64: 54 -> 62, D = 128: 102 -> 118 (FP8: 128, 256)
    assert rows[64]["tq3_total"] == 62 and rows[128]["tq3_total"] == 118 and rows[128]["key_bits"] == 4
    assert rows[128]["tq3_payload"] == 112 and rows[128]["fp8_over_tq3"] == pytest.approx(256 / 118)
