"""Batched page conversions in TileLang: FP8 -> TQ3 (retier) and TQ3 -> FP8 (promote); TQ3 -> bf16
attention operands (the prefill's bounded tile of a TQ3 prefix).

Both replicate the torch codec (``sglang_minima.codec``) bit for bit, one IEEE fp32 operation per
codec step and in the codec's order: the FWHT butterflies run stage h = 1, 2, 4, ... then one
multiply by fp32(1/sqrt(d)); squared norms are summed by the codec's fixed halving tree; divisions
and square roots are IEEE (no fast math) and the kernels are built with ``--fmad=false`` so that no
multiply-add is contracted. One CTA converts one kv head of one page.

FP8 pages are SGLang's layout: k/v ``[num_pages, page_size, num_kv_heads, head_dim]`` e4m3 (the
``[slots, H, D]`` pool viewed per page); TQ3 pages are TQ3P blocks ``[num_pages, page_bytes]``, codes
in the MMA order of ``sglang_minima.codec.layout``: packing builds each uint32 word of a lane stream
as the OR of its codes (``layout.lane_word``, through ``layout.pair_coords``), unpacking reads the
three words of a triple and splits them back into its 32 codes (``layout.triple_codes``). 4-bit keys
(``--minima-key-bits 4``: a 16-level key codebook, the kernels take its width from the number of
centroids) pack and unpack a word of four pair bytes at a time (``layout.key4_word``,
``layout.key4_word_codes``); values are 3-bit here (4-bit values, ``--minima-value-bits 4``, are
converted by the torch codec: ``TQ3PageLayout.kernel_unread``). Page-centered keys (``key_center``,
``--minima-key-center``): the encode sums each dim over the page's tokens by the codec's halving tree,
stores the fp16 mean (one IEEE division by the page size) and codes the keys minus it; the decodes
add it back after ``norm * centroid`` (two fp32 operations, as the codec).
"""

import functools
import math

import tilelang
import tilelang.language as T
import torch
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.fp8 import Scale
from sglang_minima.codec.layout import (
    CHUNK_TOKENS,
    KEY,
    LANES,
    NUM_CODES,
    PAIRS_PER_TRIPLE,
    TQ3_BITS,
    TRIPLE_WORDS,
    VALUE,
    TQ3PageLayout,
    key4_word,
    key4_word_codes,
    lane_word,
    pair_coords,
    triple_codes,
)
from sglang_minima.codec.rotation import LayerRotation, fp32_inv_sqrt, is_power_of_two

from .common import EXACT_FP32, key_bits_of, log2_int

FLT_MIN = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny: squared norms below it code as zero


def _select(table: tuple[float, ...], code):
    """table[code] for a log2(len(table))-bit code, as a select tree of fp32 constants."""
    level = [T.float32(v) for v in table]
    for bit in range(log2_int(len(table))):
        level = [
            T.if_then_else((code & (1 << bit)) != 0, level[2 * k + 1], level[2 * k]) for k in range(len(level) // 2)
        ]
    return level[0]


def _count_below(thresholds: tuple[float, ...], u):
    """#{k : thresholds[k] < u} (torch.bucketize(u, thresholds, right=False))."""
    count = T.Cast(T.int32, T.float32(thresholds[0]) < u)
    for t in thresholds[1:]:
        count = count + T.Cast(T.int32, T.float32(t) < u)
    return count


def _chunk_codes(code_s, chunk):
    """code(token, dim) of a 16-token chunk of the shared code tile, as uint32 (for layout.lane_word)."""
    return lambda t, d: T.Cast(T.uint32, code_s[chunk * CHUNK_TOKENS + t, d])


@T.macro
def _store_word(tq3, dst, base, word):
    """Store the uint32 ``word`` as 4 little-endian bytes at byte ``base`` of page ``dst``."""
    for b in T.unroll(4):
        tq3[dst, base + b] = T.Cast(T.uint8, (word >> (8 * b)) & 0xFF)


def _store_key4_word(code_s, chunk, lane, word, w):
    """Store the 8 codes of 4-bit key word ``word`` of ``lane``'s stream of chunk ``chunk`` (its
    uint32 ``w``, layout.key4_word_codes) into the shared code tile at layout.pair_coords."""
    for g, pair in enumerate(key4_word_codes(w)):
        for (t, d), code in zip(pair_coords(KEY, lane, 4 * word + g), pair):
            T.buffer_store(code_s, code, [chunk * CHUNK_TOKENS + t, d])


def _store_triple(code_s, chunk, lane, triple, kind: str, words):
    """Store the 32 codes of a triple of ``lane``'s stream of 16-token chunk ``chunk``, given its
    three words (layout.triple_codes), into the shared code tile at layout.pair_coords."""
    for q, pair in enumerate(triple_codes(kind, words)):
        for (t, d), code in zip(pair_coords(kind, lane, PAIRS_PER_TRIPLE * triple + q), pair):
            T.buffer_store(code_s, code, [chunk * CHUNK_TOKENS + t, d])


def _plus_zero(x):
    """fp32 x + 0.0 (-0.0 -> +0.0, anything else unchanged). An IEEE add that TVM's simplifier cannot
    fold away: it rewrites ``x + 0.0f`` to ``x``, which is not the same for x = -0.0."""
    return T.call_extern(T.float32, "__fadd_rn", x, T.float32(0))


@T.macro
def _fwht_rows(x_s, rows: int, dim: int, log_dim: int):
    """In-place unnormalized Walsh-Hadamard transform of each row, stages h = 1, 2, 4, ..."""
    for s in T.serial(log_dim):
        for i, j in T.Parallel(rows, dim // 2):
            h = T.shift_left(1, s)
            a = (j // h) * (2 * h) + j % h
            xa = x_s[i, a]
            xb = x_s[i, a + h]
            x_s[i, a] = xa + xb
            x_s[i, a + h] = xa - xb


@T.macro
def _halving_sum(s_s, rows: int, dim: int, log_dim: int):
    """s[i, 0] = the codec's fixed-order sum of s[i, :] (s[j] += s[j + half], half = dim/2, dim/4, ...)."""
    for s in T.serial(log_dim):
        for i, j in T.Parallel(rows, dim // 2):
            half = T.shift_right(dim // 2, s)
            if j < half:
                s_s[i, j] = s_s[i, j] + s_s[i, j + half]


@T.macro
def _token_halving_sum(s_s, rows: int, dim: int, log_rows: int):
    """s[0, d] = the codec's fixed-order sum of s[:, d] over the rows (``tq3.page_mean_keys``)."""
    for s in T.serial(log_rows):
        for i, j in T.Parallel(rows // 2, dim):
            half = T.shift_right(rows // 2, s)
            if i < half:
                s_s[i, j] = s_s[i, j] + s_s[i + half, j]


@tilelang.jit(pass_configs=EXACT_FP32)
def fp8_to_tq3_kernel(
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    centroids: tuple[float, ...],
    thresholds: tuple[float, ...],
    inv_sqrt_d: float,
    sqrt_d: float,
    *,
    key_center: bool = False,
    threads: int = 128,
):
    """FP8 pages -> TQ3P pages. Shapes (dynamic: n_fp8, n_tq3, n):
    k_fp8 / v_fp8 [n_fp8, P, H, D] e4m3, src_pages / dst_pages [n] int32, signs [H, D] fp32 (+-1),
    kv_scale [2] fp32 (per-layer k and v scale), tq3 [n_tq3, page_bytes] uint8 and the same storage
    as tq3_f16 [n_tq3, page_bytes/2] fp16 (written). ``centroids`` / ``thresholds``: the key
    codebook's (8 or 16 levels: 3- or 4-bit keys). ``key_center``: page-centered keys (the layout's
    ``k_mean`` field written, the codes of each key minus it)."""
    key_bits = key_bits_of(centroids)
    layout = TQ3PageLayout(num_kv_heads, page_size, head_dim, key_bits, key_center)
    H, P, D = num_kv_heads, page_size, head_dim
    if key_center and not is_power_of_two(P):  # (the codec zero-pads to the next power of two)
        raise ValueError(f"page_size={P}: the kernel sums a page's keys for their mean by halving, a power of two")
    log_d = log2_int(D)
    pad_offset = layout.payload_bytes + layout.metadata_bytes
    pad_bytes = layout.page_bytes - pad_offset
    squares = tuple(c * c for c in centroids)  # fp32 products of fp32 values: exact in float64, rounded below
    n_fp8, n_tq3, n = T.dynamic("n_fp8, n_tq3, n")

    @T.macro
    def load_rotated(src, x_s, h, cache, scale, signs):
        for t, d in T.Parallel(P, D):
            x_s[t, d] = T.Cast(T.float32, cache[src, t, h, d]) * scale * signs[h, d]
        _fwht_rows(x_s, P, D, log_d)
        for t, d in T.Parallel(P, D):
            x_s[t, d] = x_s[t, d] * T.float32(inv_sqrt_d)

    @T.macro
    def pack(code_s, dst, h, offset, kind, tq3):
        # one thread per 96-bit triple of a lane stream (MMA order): 3 uint32 words, 4 bytes each
        hb, lane_words = layout.v_head_code_bytes, layout.v_lane_words  # a 3-bit block's (3-bit keys: the same)
        for chunk, lane, triple in T.Parallel(P // CHUNK_TOKENS, LANES, lane_words // TRIPLE_WORDS):
            for j in T.unroll(TRIPLE_WORDS):
                word = lane_word(kind, lane, triple, j, _chunk_codes(code_s, chunk))
                base = offset + h * hb + 4 * ((chunk * LANES + lane) * lane_words + TRIPLE_WORDS * triple + j)
                _store_word(tq3, dst, base, word)

    @T.macro
    def pack_keys4(code_s, dst, h, tq3):
        # 4-bit keys: one thread per uint32 word of a lane stream (four pair bytes)
        hb, lane_words = layout.k_head_code_bytes, layout.k_lane_words
        for chunk, lane, k in T.Parallel(P // CHUNK_TOKENS, LANES, lane_words):
            word = key4_word(lane, k, _chunk_codes(code_s, chunk))
            base = layout.k_codes_offset + h * hb + 4 * ((chunk * LANES + lane) * lane_words + k)
            _store_word(tq3, dst, base, word)

    @T.macro
    def zero_padding(tq3, dst, h):
        if h == 0:
            for b in T.Parallel(max(pad_bytes, 1)):
                if b < pad_bytes:
                    tq3[dst, pad_offset + b] = T.uint8(0)

    @T.prim_func
    def fp8_to_tq3(
        k_fp8: T.Tensor([n_fp8, P, H, D], T.float8_e4m3fn),
        v_fp8: T.Tensor([n_fp8, P, H, D], T.float8_e4m3fn),
        src_pages: T.Tensor([n], T.int32),
        dst_pages: T.Tensor([n], T.int32),
        signs: T.Tensor([H, D], T.float32),
        kv_scale: T.Tensor([2], T.float32),
        tq3: T.Tensor([n_tq3, layout.page_bytes], T.uint8),
        tq3_f16: T.Tensor([n_tq3, layout.page_bytes // 2], T.float16),
    ):
        with T.Kernel(n, H, threads=threads) as (c, h):
            x_s = T.alloc_shared([P, D], T.float32)
            s_s = T.alloc_shared([P, D], T.float32)
            m_s = T.alloc_shared([P, D], T.float32)
            code_s = T.alloc_shared([P, D], T.uint8)
            norm_s = T.alloc_shared([P], T.float32)
            ratio_s = T.alloc_shared([P], T.float32)
            src = src_pages[c]
            dst = dst_pages[c]

            # keys: rotate, (center), norm, codes against the thresholds of sqrt(d) k'/n, fp16 norm correction
            load_rotated(src, x_s, h, k_fp8, kv_scale[0], signs)
            if key_center:  # the page's fp16 mean key (m_s row 0), subtracted from every key
                for t, d in T.Parallel(P, D):
                    s_s[t, d] = x_s[t, d]
                _token_halving_sum(s_s, P, D, log2_int(P))
                for d in T.Parallel(D):
                    mean16 = T.Cast(T.float16, T.ieee_fdiv(s_s[0, d], T.float32(P)))
                    tq3_f16[dst, layout.k_mean_offset // 2 + h * D + d] = mean16
                    m_s[0, d] = T.Cast(T.float32, mean16)
                for t, d in T.Parallel(P, D):
                    x_s[t, d] = x_s[t, d] - m_s[0, d]
            for t, d in T.Parallel(P, D):
                s_s[t, d] = x_s[t, d] * x_s[t, d]
            _halving_sum(s_s, P, D, log_d)
            for t in T.Parallel(P):
                norm_s[t] = T.sqrt(s_s[t, 0])
                ratio_s[t] = T.if_then_else(
                    s_s[t, 0] < T.float32(FLT_MIN), T.float32(0), T.float32(sqrt_d) / T.sqrt(s_s[t, 0])
                )
            for t, d in T.Parallel(P, D):
                code = _count_below(thresholds, x_s[t, d] * ratio_s[t])
                code_s[t, d] = T.Cast(T.uint8, T.if_then_else(ratio_s[t] == 0, 0, code))
            for t, d in T.Parallel(P, D):
                s_s[t, d] = _select(squares, T.Cast(T.int32, code_s[t, d]))
            _halving_sum(s_s, P, D, log_d)
            for t in T.Parallel(P):
                tq3_f16[dst, layout.k_norm_offset // 2 + h * P + t] = T.Cast(
                    T.float16, T.if_then_else(ratio_s[t] == 0, T.float32(0), norm_s[t] / T.sqrt(s_s[t, 0]))
                )
            if key_bits == TQ3_BITS:
                pack(code_s, dst, h, layout.k_codes_offset, KEY, tq3)
            else:
                pack_keys4(code_s, dst, h, tq3)

            # values: rotate, per-token min/max, fp16 zero and scale, round-half-even codes
            load_rotated(src, x_s, h, v_fp8, kv_scale[1], signs)
            for t, d in T.Parallel(P, D):
                s_s[t, d] = x_s[t, d]
                m_s[t, d] = x_s[t, d]
            for s in T.serial(log_d):
                for t, j in T.Parallel(P, D // 2):
                    half = T.shift_right(D // 2, s)
                    if j < half:
                        s_s[t, j] = T.min(s_s[t, j], s_s[t, j + half])
                        m_s[t, j] = T.max(m_s[t, j], m_s[t, j + half])
            for t in T.Parallel(P):
                # + 0.0: a zero min (max) is stored as +0.0 whatever the reduction order met first, as the codec does
                lo = _plus_zero(s_s[t, 0])
                hi = _plus_zero(m_s[t, 0])
                zero16 = T.Cast(T.float16, lo)
                scale16 = T.Cast(T.float16, (hi - lo) / T.float32(NUM_CODES - 1))
                tq3_f16[dst, layout.v_scale_offset // 2 + h * P + t] = scale16
                tq3_f16[dst, layout.v_zero_offset // 2 + h * P + t] = zero16
                norm_s[t] = T.Cast(T.float32, scale16)
                ratio_s[t] = T.Cast(T.float32, zero16)
            for t, d in T.Parallel(P, D):
                q = T.nearbyint((x_s[t, d] - ratio_s[t]) / norm_s[t])
                code_s[t, d] = T.Cast(
                    T.uint8,
                    T.if_then_else(
                        norm_s[t] == 0, T.float32(0), T.min(T.max(q, T.float32(0)), T.float32(NUM_CODES - 1))
                    ),
                )
            pack(code_s, dst, h, layout.v_codes_offset, VALUE, tq3)
            zero_padding(tq3, dst, h)

    return fp8_to_tq3


@tilelang.jit(pass_configs=EXACT_FP32)
def tq3_to_fp8_kernel(
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    centroids: tuple[float, ...],
    inv_sqrt_d: float,
    *,
    key_center: bool = False,
    threads: int = 128,
    output: str = "fp8_pages",
):
    """TQ3P pages -> FP8 pages (promotion): decode in the rotated space, un-rotate (R^T), divide by
    the per-layer scale (correctly rounded), cast to e4m3 (round to nearest even, saturating to
    +-448): the bytes of the torch codec's ``fp8_requantize``.
    Shapes: tq3_i32 [n_tq3, page_bytes/4] int32 and tq3_f16 [n_tq3, page_bytes/2] fp16 (views of the
    same uint8 storage), src_pages / dst_pages [n], signs [H, D], kv_scale [2] -> k_fp8 / v_fp8
    [n_fp8, P, H, D] e4m3 (written).

    ``output="bf16_heads"``: the decoded, un-rotated pages as bf16 keys and values for attention (the
    prefill's bounded TQ3 tile): tq3_i32, tq3_f16, src_pages [n], signs -> k_out / v_out [H, m, D]
    bf16 (m >= n * P), the c-th listed page in tokens c * P .. c * P + P - 1 of every head.
    ``centroids``: the key codebook's (8 or 16: 3- or 4-bit keys); ``key_center``: page-centered keys
    (each page's ``k_mean`` added back)."""
    if output not in ("fp8_pages", "bf16_heads"):
        raise ValueError(f"output={output!r}: 'fp8_pages' or 'bf16_heads'")
    key_bits = key_bits_of(centroids)
    layout = TQ3PageLayout(num_kv_heads, page_size, head_dim, key_bits, key_center)
    H, P, D = num_kv_heads, page_size, head_dim
    log_d = log2_int(D)
    n_fp8, n_tq3, n = T.dynamic("n_fp8, n_tq3, n")

    @T.macro
    def unpack(tq3_i32, src, h, offset, kind, code_s):
        # one thread per 96-bit triple of a lane stream (MMA order): 3 words in, 32 codes out
        hw, lane_words = layout.v_head_code_bytes // 4, layout.v_lane_words  # a 3-bit block's
        for chunk, lane, triple in T.Parallel(P // CHUNK_TOKENS, LANES, lane_words // TRIPLE_WORDS):
            base = offset // 4 + h * hw + (chunk * LANES + lane) * lane_words + TRIPLE_WORDS * triple
            w0 = tq3_i32[src, base]
            w1 = tq3_i32[src, base + 1]
            w2 = tq3_i32[src, base + 2]
            _store_triple(code_s, chunk, lane, triple, kind, (w0, w1, w2))

    @T.macro
    def unpack_keys4(tq3_i32, src, h, code_s):
        # 4-bit keys: one thread per uint32 word of a lane stream, 8 codes out
        hw, lane_words = layout.k_head_code_bytes // 4, layout.k_lane_words
        for chunk, lane, k in T.Parallel(P // CHUNK_TOKENS, LANES, lane_words):
            w = tq3_i32[src, layout.k_codes_offset // 4 + h * hw + (chunk * LANES + lane) * lane_words + k]
            _store_key4_word(code_s, chunk, lane, k, w)

    def decoded_key(tq3_f16, src, h, t, d, code):
        """The rotated key s * c[code] (+ m with page-centered keys: two roundings, no fma, as the codec's
        decode_pages)."""
        key = T.Cast(T.float32, tq3_f16[src, layout.k_norm_offset // 2 + h * P + t]) * _select(centroids, code)
        if key_center:
            key = key + T.Cast(T.float32, tq3_f16[src, layout.k_mean_offset // 2 + h * D + d])
        return key

    @T.macro
    def decode_keys(tq3_i32, tq3_f16, src, h, x_s, code_s):
        if key_bits == TQ3_BITS:
            unpack(tq3_i32, src, h, layout.k_codes_offset, KEY, code_s)
        else:
            unpack_keys4(tq3_i32, src, h, code_s)
        for t, d in T.Parallel(P, D):
            x_s[t, d] = decoded_key(tq3_f16, src, h, t, d, code_s[t, d])

    @T.macro
    def decode_values(tq3_i32, tq3_f16, src, h, x_s, code_s):
        unpack(tq3_i32, src, h, layout.v_codes_offset, VALUE, code_s)
        for t, d in T.Parallel(P, D):
            x_s[t, d] = T.Cast(T.float32, tq3_f16[src, layout.v_scale_offset // 2 + h * P + t]) * T.Cast(
                T.float32, code_s[t, d]
            ) + T.Cast(T.float32, tq3_f16[src, layout.v_zero_offset // 2 + h * P + t])

    @T.macro
    def store_unrotated(x_s, dst, h, cache, scale, signs):
        _fwht_rows(x_s, P, D, log_d)
        # x / scale correctly rounded, as the codec's fp8_requantize divides: a multiply by the fp32
        # reciprocal differs where x / scale lies on an e4m3 rounding tie (119 of 393,216 bytes at
        # head dim 256, scale 0.29)
        for t, d in T.Parallel(P, D):
            cache[dst, t, h, d] = T.Cast(
                T.float8_e4m3fn, T.ieee_fdiv(x_s[t, d] * T.float32(inv_sqrt_d) * signs[h, d], scale)
            )

    @T.prim_func
    def tq3_to_fp8(
        tq3_i32: T.Tensor([n_tq3, layout.page_bytes // 4], T.int32),
        tq3_f16: T.Tensor([n_tq3, layout.page_bytes // 2], T.float16),
        src_pages: T.Tensor([n], T.int32),
        dst_pages: T.Tensor([n], T.int32),
        signs: T.Tensor([H, D], T.float32),
        kv_scale: T.Tensor([2], T.float32),
        k_fp8: T.Tensor([n_fp8, P, H, D], T.float8_e4m3fn),
        v_fp8: T.Tensor([n_fp8, P, H, D], T.float8_e4m3fn),
    ):
        with T.Kernel(n, H, threads=threads) as (c, h):
            x_s = T.alloc_shared([P, D], T.float32)
            code_s = T.alloc_shared([P, D], T.int32)
            src = src_pages[c]
            dst = dst_pages[c]
            decode_keys(tq3_i32, tq3_f16, src, h, x_s, code_s)
            store_unrotated(x_s, dst, h, k_fp8, kv_scale[0], signs)
            decode_values(tq3_i32, tq3_f16, src, h, x_s, code_s)
            store_unrotated(x_s, dst, h, v_fp8, kv_scale[1], signs)

    m = T.dynamic("m")

    @T.macro
    def store_heads(x_s, c, h, out, signs):
        _fwht_rows(x_s, P, D, log_d)
        for t, d in T.Parallel(P, D):
            out[h, c * P + t, d] = T.Cast(T.bfloat16, x_s[t, d] * T.float32(inv_sqrt_d) * signs[h, d])

    @T.prim_func
    def tq3_to_bf16_heads(
        tq3_i32: T.Tensor([n_tq3, layout.page_bytes // 4], T.int32),
        tq3_f16: T.Tensor([n_tq3, layout.page_bytes // 2], T.float16),
        src_pages: T.Tensor([n], T.int32),
        signs: T.Tensor([H, D], T.float32),
        k_out: T.Tensor([H, m, D], T.bfloat16),
        v_out: T.Tensor([H, m, D], T.bfloat16),
    ):
        with T.Kernel(n, H, threads=threads) as (c, h):
            x_s = T.alloc_shared([P, D], T.float32)
            code_s = T.alloc_shared([P, D], T.int32)
            src = src_pages[c]
            decode_keys(tq3_i32, tq3_f16, src, h, x_s, code_s)
            store_heads(x_s, c, h, k_out, signs)
            decode_values(tq3_i32, tq3_f16, src, h, x_s, code_s)
            store_heads(x_s, c, h, v_out, signs)

    return tq3_to_fp8 if output == "fp8_pages" else tq3_to_bf16_heads


def _kernel_constants(head_dim: int, key_bits: int = TQ3_BITS) -> tuple[tuple[float, ...], tuple[float, ...], float, float]:
    if not is_power_of_two(head_dim):
        raise ValueError(f"the GPU conversion needs a power-of-two head_dim (Hadamard rotation), got {head_dim}")
    book = key_codebook(head_dim, key_bits)
    sqrt_d = float(torch.tensor(math.sqrt(head_dim), dtype=torch.float32))
    return (
        tuple(float(c) for c in book.centroids),
        tuple(float(t) for t in book.thresholds),
        fp32_inv_sqrt(head_dim),
        sqrt_d,
    )


def conversion_scales(k_scale: Scale, v_scale: Scale, device: torch.device | str) -> torch.Tensor:
    """fp32 [2] (k, v) on the device: the FP8 scales as both kernels read them."""
    return torch.tensor(
        [1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale)],
        dtype=torch.float32,
        device=device,
    )


def _as_fp8(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.float8_e4m3fn) if cache.dtype == torch.uint8 else cache


class PageConversions:
    """Both conversion kernels of one geometry (kv heads, page size, head dim), each built on first
    use and kept: the memory system converts every layer of a batch through one object, with page
    lists and scales already on the device (no JIT lookup or host copy per layer).

    FP8 caches are ``[n_fp8, P, H, D]`` (e4m3 or its uint8 bits), TQ3P pages ``[n_tq3, page_bytes]``
    uint8, page lists int32, ``signs`` the layer's ``LayerRotation.signs`` [H, D] and ``scales``
    ``conversion_scales(...)``. ``key_bits``: the TQ3 pages' key code width, 3 or 4; ``key_center``:
    page-centered keys (``TQ3PageLayout.key_center``).
    """

    def __init__(self, heads: int, page_size: int, head_dim: int, key_bits: int = TQ3_BITS, key_center: bool = False):
        TQ3PageLayout(heads, page_size, head_dim, key_bits, key_center)  # refuses what no page can hold
        self.heads, self.page_size, self.head_dim, self.key_bits = heads, page_size, head_dim, key_bits
        self.key_center = key_center
        self._constants = _kernel_constants(head_dim, key_bits)

    @functools.cached_property
    def encode_kernel(self):
        return fp8_to_tq3_kernel(self.heads, self.page_size, self.head_dim, *self._constants, key_center=self.key_center)

    @functools.cached_property
    def decode_kernel(self):
        centroids, _, inv_sqrt_d, _ = self._constants
        return tq3_to_fp8_kernel(self.heads, self.page_size, self.head_dim, centroids, inv_sqrt_d, key_center=self.key_center)

    @functools.cached_property
    def dequant_kernel(self):
        centroids, _, inv_sqrt_d, _ = self._constants
        return tq3_to_fp8_kernel(
            self.heads, self.page_size, self.head_dim, centroids, inv_sqrt_d, key_center=self.key_center, output="bf16_heads"
        )

    def tq3_to_bf16_heads(self, tq3_pages, src_pages, k_out, v_out, signs) -> None:
        """TQ3 pages ``src_pages`` (int32 [n]) decoded and un-rotated into k_out / v_out [H, m, D]
        bf16, the c-th page in tokens c * P .. c * P + P - 1 (m >= n * P): attention's operands."""
        self.dequant_kernel(tq3_pages.view(torch.int32), tq3_pages.view(torch.float16), src_pages, signs, k_out, v_out)

    def fp8_to_tq3(self, k_cache, v_cache, src_pages, dst_pages, tq3_pages, signs, scales) -> None:
        self.encode_kernel(
            _as_fp8(k_cache), _as_fp8(v_cache), src_pages, dst_pages, signs, scales,
            tq3_pages, tq3_pages.view(torch.float16),
        )

    def tq3_to_fp8(self, tq3_pages, src_pages, dst_pages, k_cache, v_cache, signs, scales) -> None:
        self.decode_kernel(
            tq3_pages.view(torch.int32), tq3_pages.view(torch.float16), src_pages, dst_pages, signs, scales,
            _as_fp8(k_cache), _as_fp8(v_cache),
        )


def fp8_to_tq3(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    tq3_pages: torch.Tensor,
    rotation: LayerRotation,
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
    key_bits: int = TQ3_BITS,
    key_center: bool = False,
) -> None:
    """Retier: FP8 pages ``src_pages`` of one layer (k/v ``[n_fp8, P, H, D]`` e4m3 or uint8) ->
    TQ3P pages ``dst_pages`` of ``tq3_pages`` ``[n_tq3, page_bytes]`` uint8, in place. The bytes equal
    ``encode_pages(k[src].transpose(1, 2), v[src].transpose(1, 2), ...)`` of the torch codec."""
    _, page_size, heads, dim = k_cache.shape
    PageConversions(heads, page_size, dim, key_bits, key_center).fp8_to_tq3(
        k_cache, v_cache, src_pages.to(torch.int32), dst_pages.to(torch.int32), tq3_pages,
        rotation.signs.to(k_cache.device), conversion_scales(k_scale, v_scale, k_cache.device),
    )


def tq3_to_fp8(
    tq3_pages: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rotation: LayerRotation,
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
    key_bits: int = TQ3_BITS,
    key_center: bool = False,
) -> None:
    """Promote: TQ3P pages ``src_pages`` -> FP8 pages ``dst_pages`` of k/v ``[n_fp8, P, H, D]``, in
    place; equals ``fp8_requantize(to_original_space(decode_pages(...)), scale)`` of the torch codec."""
    _, page_size, heads, dim = k_cache.shape
    PageConversions(heads, page_size, dim, key_bits, key_center).tq3_to_fp8(
        tq3_pages, src_pages.to(torch.int32), dst_pages.to(torch.int32), k_cache, v_cache,
        rotation.signs.to(k_cache.device), conversion_scales(k_scale, v_scale, k_cache.device),
    )
