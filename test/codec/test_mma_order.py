"""The MMA-order code layout, read the way the decode kernel reads it.

The GPU kernel (minima_kernels/split_decode.py, device_source.py) never calls unpack_codes: each lane loads its words of a
16-token chunk and gets fp16x2 operands with bit operations: values through ``lop3`` masks into fp16
1024.0 (one shift per word), keys as byte offsets into the lane's column of a 64-entry table of
centroid pairs. These tests replay those bit operations on pages packed by the codec and check that
every lane's operand registers hold the (token, dim) codes the m16n8k16 fragment layout wants.
"""

import numpy as np
import pytest
import torch
from sglang_minima.codec.layout import CHUNK_TOKENS, KEY, LANES, VALUE, TQ3PageLayout, pair_coords
from sglang_minima.codec.packing import pack_codes

MAGIC = 0x6400  # fp16 1024.0: OR-ing a code at bit s of the mantissa gives 1024 + c * 2^s


def _kernel_key_pairs(words: list[int], lane: int) -> list[tuple[int, int]]:
    """(low, high) codes of the 16 key pairs of a triple, through the kernel's table offsets: entry e
    of lane l's column sits at byte 128 e + 4 l, entry e = low | high << 3 (device_source.tq3_keys)."""
    lane4 = 4 * lane
    offsets = []
    for w in words:
        offsets += [((w << 7) & 0x1F80) | lane4, (w & 0x1F80) | lane4, ((w >> 6) & 0x1F80) | lane4]
        offsets += [((w >> 12) & 0x1F80) | lane4, ((w >> 19) & 0x1F80) | lane4]
    c = ((words[0] & 0x02000040) << 1) + ((words[1] & 0x02000040) << 2) + ((words[2] & 0x02000040) << 3)
    offsets.append((c & 0x380) | ((c >> 16) & 0x1C00) | lane4)
    out = []
    for off in offsets:
        assert off % 128 == lane4 and off < 64 * 128  # this lane's column, a valid entry
        entry = off // 128
        out.append((entry & 7, entry >> 3))
    return out


def _kernel_value_pairs(words: list[int]) -> list[tuple[int, int]]:
    """(low, high) codes of the 16 value pairs of a triple, through the kernel's fp16 magic-number path."""
    magic = []
    for w in words:
        shifted = w >> 9  # pairs 3 and 4 of the word move to s = 1 and 4
        for src, s in ((w, 1), (w, 4), (w, 7), (shifted, 1), (shifted, 4)):
            magic.append(((src & (0x00070007 << s)) | 0x64006400, s))
    spread = ((words[0] & 0x10001) << 1) | ((words[1] & 0x10001) << 2) | ((words[2] & 0x10001) << 3) | 0x64006400
    magic.append((spread, 1))
    out = []
    for m, s in magic:
        halves = np.array([m & 0xFFFF, m >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)
        codes = (halves - 1024.0) / 2.0**s  # the kernel's fma: x * 2^-s - 2^(10-s), exact in fp16
        assert np.all(codes == np.round(codes)) and np.all((codes >= 0) & (codes < 8))
        out.append((int(codes[0]), int(codes[1])))
    return out


@pytest.mark.parametrize("kind", [KEY, VALUE])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 32), (256, 16)])
def test_lane_registers_hold_the_fragment_codes(kind: str, head_dim: int, page_size: int) -> None:
    layout = TQ3PageLayout(1, page_size, head_dim)
    codes = torch.randint(0, 8, (page_size, head_dim), generator=torch.Generator().manual_seed(head_dim))
    packed = pack_codes(codes.to(torch.uint8), kind)
    words = packed.numpy().view("<u4").astype(np.int64)
    per_lane = layout.lane_words
    for chunk in range(page_size // CHUNK_TOKENS):
        for lane in range(LANES):
            base = (chunk * LANES + lane) * per_lane
            stream = [int(w) for w in words[base : base + per_lane]]
            for triple in range(per_lane // 3):
                triple_words = stream[3 * triple : 3 * triple + 3]
                got = _kernel_key_pairs(triple_words, lane) if kind == KEY else _kernel_value_pairs(triple_words)
                for q, (lo, hi) in enumerate(got):
                    (t0, d0), (t1, d1) = pair_coords(kind, lane, 16 * triple + q)
                    tok = chunk * CHUNK_TOKENS
                    assert (lo, hi) == (int(codes[tok + t0, d0]), int(codes[tok + t1, d1])), (chunk, lane, q)


def test_fragment_coords_cover_the_chunk_once() -> None:
    # keys and values: the 32 lanes x D/4 pairs x 2 codes of a chunk are its 16 x D codes, each once
    d = 128
    for kind in (KEY, VALUE):
        seen = set()
        for lane in range(LANES):
            for pair in range(d // 4):
                seen.update(pair_coords(kind, lane, pair))
        assert seen == {(t, x) for t in range(CHUNK_TOKENS) for x in range(d)}


def test_key_pairs_are_adjacent_dims_value_pairs_adjacent_tokens() -> None:
    # the fp16x2 halves of an A-operand register are neighbours along the MMA's K dimension:
    # the head dim for the key GEMM, the token for the value GEMM
    (t0, d0), (t1, d1) = pair_coords(KEY, 4 * 3 + 2, 6)  # lane r=3, t=2; block 1, register 2
    assert (t0, d0, t1, d1) == (3, 16 + 4 + 8, 3, 16 + 4 + 9)
    (t0, d0), (t1, d1) = pair_coords(VALUE, 4 * 3 + 2, 6)
    assert (t0, d0, t1, d1) == (4 + 8, 16 + 3, 4 + 9, 16 + 3)
