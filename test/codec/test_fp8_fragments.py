"""The FP8 role of the mixed split decode, replayed lane by lane on the CPU.

``minima_kernels.device_source.fp8_device_source`` copies a 16-token chunk of an FP8 page into a warp's
ring (K rows with XOR-swizzled 32-byte groups, V rows padded) and builds the m16n8k16 operands from
it in permuted orders (keys: k = head dims in the order of 8-byte loads; values: rows = dims 4r .. 4r
+ 3 of 32-dim groups, k = tokens paired by byte permutes). These tests replay the same index
arithmetic with the documented fragment layouts of mma.sync.m16n8k16 and movmatrix, and check that:
every byte of the chunk lands once in the ring, every shared-memory load of a warp is free of bank
conflicts, and the two GEMMs compute K q^T and V^T p with the output dims where the kernel writes
them. (The kernel itself is checked against the torch reference on the GPU: test/gpu/test_kernels.py.)
"""

import numpy as np
import pytest
import torch

from sglang_minima.codec.layout import CHUNK_TOKENS, LANES

FP8_V_ROW_PAD = 16  # device_source.FP8_V_ROW_PAD (the kernels' package needs tilelang: not imported here)


def k_group_xor(row: int, d: int) -> int:
    return row & 3 if d >= 128 else (row >> 1) & 1


def e4m3(byte_values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(byte_values.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def ring_of_chunk(k: np.ndarray, v: np.ndarray, d: int) -> np.ndarray:
    """The ring bytes ``copy_fp8_chunk`` writes for one chunk (K [16, D], V [16, D] uint8)."""
    v_row = d + FP8_V_ROW_PAD
    ring = np.full(CHUNK_TOKENS * (2 * d + FP8_V_ROW_PAD), -1, dtype=np.int64)
    pieces, rows = d // 16, 32 // (d // 16)
    for lane in range(LANES):
        row0, p = lane // pieces, lane % pieces
        for j in range(d // 32):
            row = row0 + j * rows
            dst_k = row * d + ((((p >> 1) ^ k_group_xor(row, d)) << 5) | ((p & 1) << 4))
            dst_v = CHUNK_TOKENS * d + row * v_row + p * 16
            for dst, src in ((dst_k, k), (dst_v, v)):
                assert (ring[dst : dst + 16] == -1).all(), "a ring byte written twice"
                ring[dst : dst + 16] = src[row, 16 * p : 16 * p + 16]
    return ring


def assert_conflict_free(addresses: list[int], width: int) -> None:
    """One warp-wide ld.shared of ``width`` bytes per lane: 32-bit loads are one phase of 32 lanes,
    64-bit loads two phases of 16; in a phase no two lanes may touch the same bank at different words."""
    phase = 32 if width == 4 else 16
    for start in range(0, LANES, phase):
        banks: dict[int, int] = {}
        for a in addresses[start : start + phase]:
            assert a % width == 0
            for word in range(a // 4, (a + width) // 4):
                assert banks.setdefault(word % 32, word) == word, f"bank conflict at {addresses}"


def word(ring: np.ndarray, at: int) -> np.ndarray:
    return ring[at : at + 4]


def half2(byte_pair: np.ndarray) -> tuple[float, float]:
    """cvt.rn.f16x2.e4m3x2: the low byte is the low half (exact: e4m3 fits fp16)."""
    lo, hi = e4m3(byte_pair)
    return float(lo), float(hi)


def key_operands(ring: np.ndarray, d: int, lane: int, tr: int) -> list[tuple[float, float]]:
    """``fp8_keys``: 16 registers (k-blocks 4tr .. 4tr + 3, a0..a3 each) of one lane, and its loads."""
    r, t = lane // 4, lane % 4
    out: list = [None] * 16
    for b in range(2):
        off = (((2 * tr + b) ^ k_group_xor(r, d)) << 5) + 8 * t
        w = ring[r * d + off : r * d + off + 8]
        u = ring[(r + 8) * d + off : (r + 8) * d + off + 8]
        out[8 * b + 0], out[8 * b + 2] = half2(w[0:2]), half2(w[2:4])
        out[8 * b + 1], out[8 * b + 3] = half2(u[0:2]), half2(u[2:4])
        out[8 * b + 4], out[8 * b + 6] = half2(w[4:6]), half2(w[6:8])
        out[8 * b + 5], out[8 * b + 7] = half2(u[4:6]), half2(u[6:8])
    return out


def key_load_addresses(d: int, tr: int, b: int, high_row: bool) -> list[int]:
    return [
        ((lane // 4) + 8 * high_row) * d + (((2 * tr + b) ^ k_group_xor(lane // 4, d)) << 5) + 8 * (lane % 4)
        for lane in range(LANES)
    ]


def prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    both = np.concatenate([a, b])
    return np.array([both[(selector >> (4 * i)) & 0xF] for i in range(4)])


def value_load_addresses(d: int, tr: int, b: int, token_offset: int) -> list[int]:
    v_row = d + FP8_V_ROW_PAD
    return [
        CHUNK_TOKENS * d + (2 * (lane % 4) + token_offset) * v_row + 4 * (lane // 4) + ((2 * tr + b) << 5)
        for lane in range(LANES)
    ]


def value_operands(ring: np.ndarray, d: int, lane: int, tr: int) -> list[tuple[float, float]]:
    """``fp8_values``: 16 registers (m-blocks 4tr .. 4tr + 3, a0..a3 each) of one lane."""
    v_row = d + FP8_V_ROW_PAD
    r, t = lane // 4, lane % 4
    v = CHUNK_TOKENS * d + 2 * t * v_row + 4 * r
    out: list = [None] * 16
    for b in range(2):
        at = v + ((2 * tr + b) << 5)
        wa, wb, wc, wd = (word(ring, at + k * v_row) for k in (0, 1, 8, 9))
        x_ab, x_cd, y_ab, y_cd = prmt(wa, wb, 0x5140), prmt(wc, wd, 0x5140), prmt(wa, wb, 0x7362), prmt(wc, wd, 0x7362)
        out[8 * b + 0], out[8 * b + 1] = half2(x_ab[0:2]), half2(x_ab[2:4])
        out[8 * b + 2], out[8 * b + 3] = half2(x_cd[0:2]), half2(x_cd[2:4])
        out[8 * b + 4], out[8 * b + 5] = half2(y_ab[0:2]), half2(y_ab[2:4])
        out[8 * b + 6], out[8 * b + 7] = half2(y_cd[0:2]), half2(y_cd[2:4])
    return out


def mma_a(regs: list[list[tuple[float, float]]]) -> np.ndarray:
    """The 16x16 A matrix of m16n8k16 from each lane's a0..a3 (PTX fragment layout)."""
    a = np.zeros((16, 16))
    for lane in range(LANES):
        r, t = lane // 4, lane % 4
        for g, (row, col) in enumerate(((r, 2 * t), (r + 8, 2 * t), (r, 2 * t + 8), (r + 8, 2 * t + 8))):
            a[row, col : col + 2] = regs[lane][g]
    return a


def mma_b(regs: list[list[tuple[float, float]]]) -> np.ndarray:
    """The 16x8 B matrix from each lane's b0, b1."""
    b = np.zeros((16, 8))
    for lane in range(LANES):
        r, t = lane // 4, lane % 4
        b[2 * t : 2 * t + 2, r] = regs[lane][0]
        b[2 * t + 8 : 2 * t + 10, r] = regs[lane][1]
    return b


@pytest.mark.parametrize("d", [64, 128, 256])
def test_chunk_copy_covers_the_ring_once(d: int) -> None:
    gen = np.random.default_rng(d)
    k, v = gen.integers(0, 256, (2, CHUNK_TOKENS, d))
    ring = ring_of_chunk(k, v, d)
    # the K rows' groups are a permutation within their row; V rows are padded
    for row in range(CHUNK_TOKENS):
        assert sorted(ring[row * d : (row + 1) * d].tolist()) == sorted(k[row].tolist())
    v_row = d + FP8_V_ROW_PAD
    for row in range(CHUNK_TOKENS):
        at = CHUNK_TOKENS * d + row * v_row
        assert (ring[at : at + d] == v[row]).all() and (ring[at + d : at + v_row] == -1).all()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fragment_loads_are_free_of_bank_conflicts(d: int) -> None:
    for tr in range(d // 64):
        for b in range(2):
            for high_row in (False, True):
                assert_conflict_free(key_load_addresses(d, tr, b, high_row), 8)
            for token_offset in (0, 1, 8, 9):
                assert_conflict_free(value_load_addresses(d, tr, b, token_offset), 4)


def finite_e4m3_bytes(gen: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = gen.integers(0, 256, shape)
    return np.where((x & 0x7F) == 0x7F, 0x3C, x)  # no NaN


@pytest.mark.parametrize("d", [64, 128, 256])
def test_key_gemm_computes_scores(d: int) -> None:
    gen = np.random.default_rng(d + 1)
    k = finite_e4m3_bytes(gen, (CHUNK_TOKENS, d))
    v = finite_e4m3_bytes(gen, (CHUNK_TOKENS, d))
    q = gen.standard_normal((8, d)).astype(np.float16).astype(np.float64)  # 8 heads of a tile
    ring = ring_of_chunk(k, v, d)
    scores = np.zeros((16, 8))
    for tr in range(d // 64):
        ops = [key_operands(ring, d, lane, tr) for lane in range(LANES)]
        for kk in range(4):
            kb = 4 * tr + kk
            a = mma_a([o[4 * kk : 4 * kk + 4] for o in ops])
            # q_frag j of k-block kb: q words 16 (kb // 2) + 4t + 2 (kb % 2) + j of head r (split_decode.query_word)
            b_regs = []
            for lane in range(LANES):
                r, t = lane // 4, lane % 4
                words = [16 * (kb // 2) + 4 * t + 2 * (kb % 2) + j for j in range(2)]
                b_regs.append([(q[r, 2 * w], q[r, 2 * w + 1]) for w in words])
            scores += a @ mma_b(b_regs)
    ref = e4m3(k) @ q.T
    np.testing.assert_allclose(scores, ref, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_value_gemm_computes_the_output(d: int) -> None:
    gen = np.random.default_rng(d + 2)
    k = finite_e4m3_bytes(gen, (CHUNK_TOKENS, d))
    v = finite_e4m3_bytes(gen, (CHUNK_TOKENS, d))
    p = gen.random((CHUNK_TOKENS, 8)).astype(np.float16).astype(np.float64)  # probabilities [token, head]
    ring = ring_of_chunk(k, v, d)
    # the p operand: scores' accumulator layout (lane r, t: tokens r, r + 8 of heads 2t, 2t + 1) packed to
    # fp16x2 and transposed by movmatrix: lane (r, t) then holds head r, tokens 2t, 2t + 1 (+ 8)
    p_regs = [[(p[2 * (l % 4), l // 4], p[2 * (l % 4) + 1, l // 4]), (p[2 * (l % 4) + 8, l // 4], p[2 * (l % 4) + 9, l // 4])] for l in range(LANES)]
    b = mma_b(p_regs)
    np.testing.assert_array_equal(b, p)
    out = np.full((d, 8), np.nan)
    for tr in range(d // 64):
        ops = [value_operands(ring, d, lane, tr) for lane in range(LANES)]
        for kk in range(4):
            mb = 4 * tr + kk
            c = mma_a([o[4 * kk : 4 * kk + 4] for o in ops]) @ b  # [16 rows, 8 heads]
            for lane in range(LANES):
                r, t = lane // 4, lane % 4
                for i in range(4):  # accumulator i: row r + 8 (i // 2), head 2t + i % 2 -> the kernel's dim
                    dim = 32 * (mb // 2) + 4 * r + 2 * (mb % 2) + i // 2
                    assert np.isnan(out[dim, 2 * t + i % 2])
                    out[dim, 2 * t + i % 2] = c[r + 8 * (i // 2), 2 * t + i % 2]
    ref = e4m3(v).T @ p
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-9)
