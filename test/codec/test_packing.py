"""3-bit packing in the MMA order of layout.py: exact round trips, the documented bit placement, bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_minima.codec.layout import (
    CHUNK_TOKENS,
    KEY,
    LANES,
    VALUE,
    TQ3PageLayout,
    code_bit_index,
    lane_word,
    pair_coords,
    triple_codes,
)
from sglang_minima.codec.packing import (
    code_ints,
    key_pair_fields,
    pack_codes,
    unpack_codes,
)

KINDS = [KEY, VALUE]


def _rule_bits(kind: str, chunk: int, lane: int, pair: int, half: int, head_dim: int) -> list[int]:
    """Bits 0..2 of the low (half 0) or high (half 1) code of a lane's pair, straight from the prose
    of layout.py / docs/TQ3P.md: lane streams of 3D/64 words, triples of 3 words holding 16 pairs,
    pair q < 15 in word q // 5, pair 15 spread over words 0, 1, 2. Values: slot i = q % 5 at bit
    1 + 3i (+16 for the high code), pair 15 at bits 0 / 16. Keys: slot i a 6-bit field at bit 0, 7,
    13, 19, 26 (+3 for the high code), pair 15 at bits 6 / 25."""
    lane_words = 3 * head_dim // 64
    triple, q = divmod(pair, 16)
    base = (chunk * LANES + lane) * lane_words + 3 * triple
    if kind == KEY:
        low, high, spare = (0, 7, 13, 19, 26)[q % 5] if q < 15 else None, 3, (6, 25)
    else:
        low, high, spare = 1 + 3 * (q % 5), 16, (0, 16)
    if q < 15:
        return [(base + q // 5) * 32 + low + high * half + b for b in range(3)]
    return [(base + b) * 32 + spare[half] for b in range(3)]


def _bits_set(packed: torch.Tensor) -> list[int]:
    bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return torch.nonzero(bits.reshape(-1)).flatten().tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
def test_round_trip(kind, head_dim, page_size):
    g = torch.Generator().manual_seed(head_dim + page_size)
    codes = torch.randint(0, 8, (2, 3, page_size, head_dim), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, kind)
    assert packed.shape == (2, 3, page_size * head_dim * 3 // 8) and packed.dtype == torch.uint8
    assert packed.shape[-1] == TQ3PageLayout(1, page_size, head_dim).head_code_bytes
    assert torch.equal(unpack_codes(packed, kind, page_size, head_dim), codes)
    # Each leading index packs on its own.
    assert torch.equal(packed[1, 2], pack_codes(codes[1, 2], kind))


@settings(max_examples=20, deadline=None)
@given(data=st.binary(min_size=384, max_size=384), kind=st.sampled_from(KINDS))
def test_every_byte_string_round_trips(data, kind):
    packed = torch.tensor(list(data), dtype=torch.uint8)  # one head of a 16 x 64 page
    assert torch.equal(pack_codes(unpack_codes(packed, kind, 16, 64), kind), packed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 64), (256, 32)])
def test_code_bit_index_is_a_bijection(kind, head_dim, page_size):
    token = torch.arange(page_size).view(-1, 1, 1)
    dim = torch.arange(head_dim).view(1, -1, 1)
    bit = torch.arange(3).view(1, 1, -1)
    index = code_bit_index(kind, token, dim, bit, head_dim, where=torch.where)
    assert torch.equal(index.flatten().sort().values, torch.arange(page_size * head_dim * 3))
    # The Python-int path (default ``where``) gives the same indices as the tensor path.
    for t, d in [(0, 0), (page_size - 1, head_dim - 1), (7, 56), (8, 57), (page_size // 2 + 3, head_dim // 2 + 5)]:
        assert [code_bit_index(kind, t, d, b, head_dim) for b in range(3)] == index[t, d].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pair_coords_agree_with_code_bit_index(kind, head_dim):
    seen = set()
    for chunk in range(2):
        for lane in range(LANES):
            for pair in range(head_dim // 4):
                for half, (t, d) in enumerate(pair_coords(kind, lane, pair)):
                    want = _rule_bits(kind, chunk, lane, pair, half, head_dim)
                    got = [code_bit_index(kind, chunk * CHUNK_TOKENS + t, d, b, head_dim) for b in range(3)]
                    assert got == want, (kind, chunk, lane, pair, half)
                    seen.add((chunk * CHUNK_TOKENS + t, d))
    assert len(seen) == 2 * CHUNK_TOKENS * head_dim  # every code of two chunks, once


def _one_code(kind: str, page_size: int, head_dim: int, token: int, dim: int, code: int = 0b101) -> list[int]:
    codes = torch.zeros(page_size, head_dim, dtype=torch.uint8)
    codes[token, dim] = code
    packed = pack_codes(codes, kind)
    assert torch.equal(unpack_codes(packed, kind, page_size, head_dim), codes)
    return packed.tolist()


@pytest.mark.parametrize(
    "kind, page_size, head_dim, token, dim, byte, value",
    [
        # keys: lane 4r+t holds token r (+8), dims 2t, 2t+1 (+8) of each 16-wide block; a pair is
        # one 6-bit field, low code first
        (KEY, 16, 64, 0, 0, 0, 0b101),  # lane 0, pair 0, low code: word 0 bits 0..2
        (KEY, 16, 64, 0, 1, 0, 0b101 << 3),  # ... its high code: bits 3..5
        (KEY, 16, 64, 9, 2, 60, 0b101 << 7),  # token 9 = r 1 + 8: lane 5, register 1 -> pair 1, word 15 bits 7..9
        (KEY, 16, 64, 0, 8, 1, 0b101 << 5),  # dim 8: register 2 -> pair 2, bits 13..15 (byte 1 bits 5..7)
        (KEY, 16, 64, 0, 16, 3, 0b101 << 2),  # block 1 -> pair 4: bits 26..28 (byte 3 bits 2..4)
        (KEY, 16, 64, 0, 17, 3, 0b101 << 5),  # ... its high code: bits 29..31
        (KEY, 16, 64, 0, 20, 27, 0b101 << 2),  # dim 20 = 16 + 2*2: lane 2, pair 4: word 6 bits 26..28
        (KEY, 32, 64, 17, 0, 432, 0b101),  # chunk 1, lane 4: word (32 + 4) * 3 = 108
        (KEY, 16, 128, 0, 64, 12, 0b101),  # block 4 -> pair 16: second triple, word 3
        # values: lane 4r+t holds dim r (+8) of each block, tokens 2t, 2t+1 (+8)
        (VALUE, 16, 64, 0, 0, 0, 0b101 << 1),  # lane 0, pair 0, low code
        (VALUE, 16, 64, 1, 0, 2, 0b101 << 1),  # the next token is the high code
        (VALUE, 16, 64, 3, 5, 254, 0b101 << 1),  # lane 4*5 + 1 = 21, pair 0, high: word 63 bits 17..19
        (VALUE, 16, 64, 8, 0, 0, 0b101 << 7),  # token 8: register 2 -> pair 2, bits 7..9
    ],
)
def test_single_code_lands_on_the_documented_bits(kind, page_size, head_dim, token, dim, byte, value):
    packed = _one_code(kind, page_size, head_dim, token, dim)
    want = [0] * len(packed)
    for i in range(4):  # the code may straddle a byte boundary: spread the little-endian value
        if byte + i < len(want):
            want[byte + i] = (value >> (8 * i)) & 0xFF
    assert packed == want


@pytest.mark.parametrize("kind", KINDS)
def test_pair_15_is_spread_over_the_spare_bits(kind):
    # pair 15 of lane 0 (block 3, register 3): bit b of its low / high code is one spare bit of word
    # b (values: bits 0 / 16, keys: bits 6 / 25); words 0..2 of lane 0 are bytes 0..11
    (t0, d0), (t1, d1) = pair_coords(kind, 0, 15)
    assert ((t0, d0), (t1, d1)) == (((8, 56), (8, 57)) if kind == KEY else ((8, 56), (9, 56)))
    low_bit, high_bit = (6, 25) if kind == KEY else (0, 16)
    lo = _one_code(kind, 16, 64, t0, d0)  # 0b101: bits 0 and 2 -> words 0 and 2
    assert _bits_set(torch.tensor(lo, dtype=torch.uint8)) == [low_bit, 64 + low_bit]
    hi = _one_code(kind, 16, 64, t1, d1, code=0b010)  # bit 1 only: word 1
    assert _bits_set(torch.tensor(hi, dtype=torch.uint8)) == [32 + high_bit]
    all_bits = _bits_set(torch.tensor(_one_code(kind, 16, 64, t1, d1, code=0b111), dtype=torch.uint8))
    assert all_bits == [high_bit, 32 + high_bit, 64 + high_bit]


def test_worked_example_of_the_doc():
    # docs/TQ3P.md: lane 5 of chunk 0 is words 15..17 (bytes 60..71) for D = 64; pair 15 of lane 5 is
    # keys (9, 58) / (9, 59): code 0b101 at (9, 58) sets bit 6 of words 15 and 17
    assert pair_coords(KEY, 5, 15) == ((9, 58), (9, 59))
    packed = _one_code(KEY, 16, 64, 9, 58)
    assert [(i, x) for i, x in enumerate(packed) if x] == [(60, 0x40), (68, 0x40)]
    packed = _one_code(KEY, 16, 64, 9, 2)  # pair 1: bits 7..9 of word 15
    assert [(i, x) for i, x in enumerate(packed) if x] == [(60, 0x80), (61, 0x02)]
    assert [pair_coords(VALUE, 5, p) for p in (0, 4, 15)] == [((2, 1), (3, 1)), ((2, 17), (3, 17)), ((10, 57), (11, 57))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 32), (256, 16)])
def test_random_single_codes_follow_the_rule(kind, head_dim, page_size):
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        token = int(torch.randint(0, page_size, (1,), generator=g))
        dim = int(torch.randint(0, head_dim, (1,), generator=g))
        chunk, tc = divmod(token, CHUNK_TOKENS)
        lane, pair, half = next(
            (lane, pair, half)
            for lane in range(LANES)
            for pair in range(head_dim // 4)
            for half, coord in enumerate(pair_coords(kind, lane, pair))
            if coord == (tc, dim)
        )
        bits = _rule_bits(kind, chunk, lane, pair, half, head_dim)
        packed = torch.tensor(_one_code(kind, page_size, head_dim, token, dim), dtype=torch.uint8)
        assert _bits_set(packed) == [bits[0], bits[2]]  # 0b101


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lane_word_builds_the_packed_words(kind, head_dim):
    # layout.lane_word is how the FP8 -> TQ3 kernel packs: one uint32 word at a time, OR of its codes,
    # with lane and triple symbolic. Evaluated here with lane and triple as tensors (every lane and
    # triple at once, as the kernel's threads do) and the codes as int64, it gives pack_codes' words.
    page_size = 32
    layout = TQ3PageLayout(1, page_size, head_dim)
    codes = torch.randint(0, 8, (page_size, head_dim), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    words = pack_codes(codes, kind).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.view(page_size // CHUNK_TOKENS, LANES, layout.lane_words // 3, 3)  # chunk, lane, triple, word
    lane = torch.arange(LANES).view(-1, 1)
    triple = torch.arange(layout.lane_words // 3).view(1, -1)
    for chunk in range(page_size // CHUNK_TOKENS):
        chunk_codes = codes[chunk * CHUNK_TOKENS : (chunk + 1) * CHUNK_TOKENS].to(torch.int64)
        for j in range(3):
            got = lane_word(kind, lane, triple, j, lambda t, d: chunk_codes[t, d])
            assert torch.equal(got, words[chunk, :, :, j]), (chunk, j)
    # and with plain ints, one word
    assert lane_word(kind, 5, 0, 2, lambda t, d: int(codes[t, d])) == int(words[0, 5, 0, 2])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_triple_codes_unpacks_the_packed_words(kind, head_dim):
    # layout.triple_codes is how the TQ3 -> FP8 kernel unpacks: one thread per (chunk, lane, triple)
    # reads words (chunk * 32 + lane) * lane_words + 3 * triple + 0..2 of the head's block (the page
    # viewed as int32) and stores the 32 codes at pair_coords. Replayed with chunk, lane and triple as
    # tensors and the words signed, it gives back every code.
    page_size = 32
    layout = TQ3PageLayout(1, page_size, head_dim)
    codes = torch.randint(0, 8, (page_size, head_dim), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    words = pack_codes(codes, kind).view(torch.int32).to(torch.int64)
    chunk = torch.arange(page_size // CHUNK_TOKENS).view(-1, 1, 1)
    lane = torch.arange(LANES).view(1, -1, 1)
    triple = torch.arange(layout.lane_words // 3).view(1, 1, -1)
    word0 = (chunk * LANES + lane) * layout.lane_words + 3 * triple
    got = torch.full((page_size, head_dim), 8, dtype=torch.int64)  # 8: no code
    for q, pair in enumerate(triple_codes(kind, [words[word0 + j] for j in range(3)])):
        for (t, d), code in zip(pair_coords(kind, lane, 16 * triple + q), pair):
            # the words the thread reads are those code_bit_index puts this code in
            index = code_bit_index(kind, chunk * CHUNK_TOKENS + t, d, 0, head_dim, where=torch.where)
            assert torch.equal(index // 32, word0 + (0 if q == 15 else q // 5)), (q, t, d)
            got[chunk * CHUNK_TOKENS + t, d] = code
    assert torch.equal(got, codes.to(torch.int64))


@pytest.mark.parametrize("kind", KINDS)
def test_triple_codes_is_the_inverse_of_lane_word(kind):
    # plain ints: the words of one triple (lane 5, triple 1, D = 128), unsigned or signed, give back
    # the codes lane_word packed into them ...
    codes = torch.randint(0, 8, (16, 128), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    words = [lane_word(kind, 5, 1, j, lambda t, d: int(codes[t, d])) for j in range(3)]
    want = [tuple(int(codes[t, d]) for t, d in pair_coords(kind, 5, 16 + q)) for q in range(16)]
    assert triple_codes(kind, words) == want
    assert triple_codes(kind, [w - (1 << 32) if w >> 31 else w for w in words]) == want
    # ... and lane_word packs any 96 bits back from the codes triple_codes reads out of them
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        words = [int(w) for w in torch.randint(0, 1 << 32, (3,), generator=g, dtype=torch.int64)]
        code = {}
        for q, pair in enumerate(triple_codes(kind, words)):
            code.update(zip(pair_coords(kind, 5, 16 + q), pair))
        assert [lane_word(kind, 5, 1, j, lambda t, d, code=code: code[t, d]) for j in range(3)] == words


@pytest.mark.parametrize("kind", KINDS)
def test_byte_reads_of_code_bit_index_unpack(kind):
    # code_bit_index read bit by bit: 3 byte loads per (token, dim) at index // 8, bit index % 8
    page_size, head_dim = 32, 128
    codes = torch.randint(0, 8, (page_size, head_dim), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    packed = pack_codes(codes, kind).to(torch.int64)
    t = torch.arange(page_size).view(-1, 1)
    d = torch.arange(head_dim).view(1, -1)
    got = torch.zeros(page_size, head_dim, dtype=torch.int64)
    for bit in range(3):
        index = code_bit_index(kind, t, d, bit, head_dim, where=torch.where)
        got |= ((packed[index // 8] >> (index % 8)) & 1) << bit
    assert torch.equal(got, codes.to(torch.int64))


def test_bad_inputs():
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kind must be 'k' or 'v', got 'q'"):
        pack_codes(codes, "q")
    with pytest.raises(ValueError, match="kind must be 'k' or 'v', got 'q'"):
        unpack_codes(torch.zeros(384, dtype=torch.uint8), "q", 16, 64)
    with pytest.raises(ValueError, match="kind must be 'k' or 'v', got 'q'"):
        pair_coords("q", 0, 0)
    with pytest.raises(ValueError, match="kind must be 'k' or 'v', got 'q'"):
        code_bit_index("q", 0, 0, 0, 64)
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        pack_codes(codes.long(), KEY)
    with pytest.raises(TypeError, match="dtype=torch.int8"):
        unpack_codes(torch.zeros(384, dtype=torch.int8), KEY, 16, 64)
    with pytest.raises(ValueError, match="got max 8"):
        pack_codes(torch.full((16, 64), 8, dtype=torch.uint8), VALUE)
    with pytest.raises(ValueError, match=r"page_size, head_dim\], got shape \(64,\)"):
        pack_codes(torch.zeros(64, dtype=torch.uint8), KEY)
    with pytest.raises(ValueError, match="pack into 384 bytes, got last dim 383"):
        unpack_codes(torch.zeros(383, dtype=torch.uint8), KEY, 16, 64)
    with pytest.raises(ValueError, match="head_dim to be a positive multiple of 64, got 96"):
        pack_codes(torch.zeros(16, 96, dtype=torch.uint8), KEY)
    with pytest.raises(ValueError, match="head_dim to be a positive multiple of 64, got 96"):
        unpack_codes(torch.zeros(576, dtype=torch.uint8), VALUE, 16, 96)
    with pytest.raises(ValueError, match="page_size to be a positive multiple of 16, got 8"):
        pack_codes(torch.zeros(8, 64, dtype=torch.uint8), VALUE)
    with pytest.raises(ValueError, match="page_size to be a positive multiple of 16, got 8"):
        unpack_codes(torch.zeros(192, dtype=torch.uint8), KEY, 8, 64)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    page_size=st.sampled_from([16, 32, 64]),
    head_dim=st.sampled_from([64, 128, 192, 256]),
    blocks=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_code_ints_reads_the_codes_of_unpack_codes(kind, page_size, head_dim, blocks, seed):
    """The fast path's word reads (code_ints) give exactly unpack_codes' codes, any bytes, any geometry."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (blocks, 2, page_size * head_dim * 3 // 8), dtype=torch.uint8, generator=g)
    want = unpack_codes(packed, kind, page_size, head_dim).to(torch.int32)
    got = code_ints(packed.view(torch.int32), kind, page_size, head_dim)
    assert got.dtype == torch.int32
    assert torch.equal(got.view(blocks, 2, page_size, head_dim), want)


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([16, 32, 64]),
    head_dim=st.sampled_from([64, 128, 256]),
    blocks=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_key_pair_fields_join_the_codes_of_adjacent_dims(page_size, head_dim, blocks, seed):
    """key_pair_fields[t, j] = code(t, 2j) | code(t, 2j + 1) << 3, the spare pair included."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (blocks, page_size * head_dim * 3 // 8), dtype=torch.uint8, generator=g)
    codes = unpack_codes(packed, KEY, page_size, head_dim).to(torch.int32).view(blocks, page_size, head_dim // 2, 2)
    got = key_pair_fields(packed.view(torch.int32), page_size, head_dim)
    assert torch.equal(got.view(blocks, page_size, head_dim // 2), codes[..., 0] | (codes[..., 1] << 3))


def test_code_ints_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="int32"):
        code_ints(torch.zeros(96, dtype=torch.uint8), KEY, 16, 64)
    with pytest.raises(ValueError, match="need 96 words"):
        code_ints(torch.zeros(95, dtype=torch.int32), KEY, 16, 64)
    with pytest.raises(ValueError, match="need 96 words"):
        key_pair_fields(torch.zeros(97, dtype=torch.int32), 16, 64)
