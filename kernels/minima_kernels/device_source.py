"""The CUDA the TQ3 and mixed decodes import (``T.import_source``), written from the codec's layout.

``tq3_device_source``: the triple decode (keys through the per-lane key table, values by the
magic-number trick), mma.sync m16n8k16, movmatrix, half2 packing. ``fp8_device_source``: the FP8
role's chunk copy and fragment loads. Only the text is built here; the kernels that use it are
``split_decode.split_decode`` (``tq3_decode_kernel``, ``mixed_decode_kernel``).
"""

import numpy as np
from sglang_minima.codec.layout import CHUNK_TOKENS, KEY, NUM_CODES, PAIRS_PER_WORD, TQ3_BITS, VALUE, WORD_BITS

# fp16x2 constants of the value decode (bit patterns). A pair's codes sit at bits s..s+2 of each half
# (s = 1, 4, 7, layout.py); OR-ing them into 1024.0 gives 1024 + c * 2^s, exact in fp16.
_MAGIC = 0x64006400
_SHIFTS = (1, 4, 7)
# The key table: entry e = low | high << 3 of lane l at byte offset e << 7 | l << 2
KEY_TABLE_ENTRIES = NUM_CODES * NUM_CODES
_ENTRY_SHIFT = 7
_ENTRY_MASK = (KEY_TABLE_ENTRIES - 1) << _ENTRY_SHIFT
assert WORD_BITS[VALUE].low == (1, 4, 7, 10, 13) and WORD_BITS[VALUE].spare == (0, 16)  # the magic path's shifts


def _half2(x: float) -> int:
    h = int(np.float16(x).view(np.uint16))
    return h | h << 16


def _shift_expr(x: str, left: int, shift_by_imad: bool) -> str:
    """C++ for x shifted left by ``left`` bits (right when negative). With ``shift_by_imad`` the right
    shifts are written as high halves of products (IMAD.HI, FMA pipe) to leave the ALU pipe, which
    the lop3s fill, to them; left shifts become IMAD.SHL either way."""
    if left >= 0:
        return f"({x} << {left})"
    if shift_by_imad:
        return f"__umulhi({x}, {1 << (32 + left)}u)"
    return f"({x} >> {-left})"


def _key_table_source(centroids: tuple[float, ...], shift_by_imad: bool) -> str:
    """CUDA for the key table: ``key_pair(e)`` (entry e's fp16x2 centroids, to fill the table) and
    ``tq3_keys`` (a triple's 16 pairs through the table), from layout.WORD_BITS[KEY]."""
    bits = WORD_BITS[KEY]
    if len(centroids) != NUM_CODES or bits.high_offset != TQ3_BITS:
        raise ValueError(f"the key table wants {NUM_CODES} centroids and 6-bit pair fields, got {len(centroids)}")
    half_bits = [int(np.float16(c).view(np.uint16)) for c in centroids]
    centroid = " : ".join(f"c == {i} ? 0x{h:04x}u" for i, h in enumerate(half_bits[:-1])) + f" : 0x{half_bits[-1]:04x}u"
    lookups = []
    for i, low in enumerate(bits.low):
        field = "x" if low == _ENTRY_SHIFT else _shift_expr("x", _ENTRY_SHIFT - low, shift_by_imad)
        lookups.append(f"    out[{PAIRS_PER_WORD} * k + {i}] = table_at(entry_offset({field}, lane4));")
    # pair 15: bit b of its low / high code is bit spare[0] / spare[1] of word b. One shift by 1 + b
    # puts the low bits at entry bits 0..2 (offset bits 7..9); the high ones land 16 above bits 10..12.
    lo_spare, hi_spare = bits.spare
    assert lo_spare + 1 == _ENTRY_SHIFT and hi_spare + 1 == _ENTRY_SHIFT + TQ3_BITS + 16
    spare_mask = (1 << lo_spare) | (1 << hi_spare)
    return f"""
__device__ __forceinline__ uint32_t key_centroid(uint32_t c) {{ return {centroid}; }}
// entry e of the key table: fp16x2 (centroid of the low code e & 7, of the high code e >> 3)
__device__ __forceinline__ uint32_t key_pair(uint32_t e) {{ return key_centroid(e & 7u) | key_centroid(e >> 3) << 16; }}
// (x & entry bits) | lane4 in one lop3 (written out: the compiler would split it in two)
__device__ __forceinline__ uint32_t entry_offset(uint32_t x, uint32_t lane4) {{
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "n"(0x{_ENTRY_MASK:x}u), "r"(lane4));
  return d;
}}
// The table lives in a static __shared__ array, one per CTA, filled before the main loop, at an
// address aligned to its size (8 KB) so that a lane's column address (table_lane) ORs with an entry
// offset: each lookup is one lop3 and one ld.shared with no add for the table's base. (__align__ on
// a __shared__ array is not honoured beyond 1 KB on sm_90, hence the padding.)
__device__ __forceinline__ uint32_t* key_table() {{
  constexpr uintptr_t kBytes = {KEY_TABLE_ENTRIES * 128};
  __shared__ __align__(16) uint32_t padded[2 * kBytes / 4];
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(padded) + kBytes - 1) & ~(kBytes - 1));
}}
// Lane l computes entries l and l + 32 once; each warp then writes its rows of the table, every
// row one entry broadcast to the 32 columns.
__device__ __forceinline__ void fill_key_table(int warp, int warps, int lane) {{
  static_assert({KEY_TABLE_ENTRIES} == 64, "two entries per lane");
  const uint32_t low = key_pair(lane), high = key_pair(lane + 32);
  for (int e = warp; e < {KEY_TABLE_ENTRIES}; e += warps)
    key_table()[e * 32 + lane] = __shfl_sync(0xffffffffu, e < 32 ? low : high, e & 31);
}}
// shared-memory address of entry 0 of this lane's column
__device__ __forceinline__ uint32_t table_lane(int lane) {{
  return static_cast<uint32_t>(__cvta_generic_to_shared(key_table())) | (lane << 2);
}}
__device__ __forceinline__ uint32_t table_at(uint32_t address) {{
  uint32_t d;
  asm("ld.shared.b32 %0, [%1];" : "=r"(d) : "r"(address));
  return d;
}}
// keys: the 16 pairs of a triple as fp16x2 centroids, one table load each (lane4 = table_lane(lane))
__device__ __forceinline__ void tq3_keys(const uint32_t* w, uint32_t lane4, uint32_t* out) {{
#pragma unroll
  for (int k = 0; k < 3; ++k) {{
    uint32_t x = w[k];
{chr(10).join(lookups)}
  }}
  uint32_t c = ((w[0] & 0x{spare_mask:08x}u) << 1) + ((w[1] & 0x{spare_mask:08x}u) << 2) + ((w[2] & 0x{spare_mask:08x}u) << 3);
  out[15] = table_at((c & 0x{0x7 << _ENTRY_SHIFT:x}u) | ((c >> 16) & 0x{0x38 << _ENTRY_SHIFT:x}u) | lane4);
}}
"""


KEY4_CODES = 16
KEY4_TABLE_ENTRIES = KEY4_CODES * KEY4_CODES


def _key4_table_source(centroids: tuple[float, ...]) -> str:
    """CUDA for 4-bit keys (docs/TQ3P.md, "4-bit keys"): a lane stream's byte p is pair p, the index
    ``low | high << 4`` of a 256-entry table of fp16x2 centroid pairs, one column per lane as the
    3-bit table (entry e of lane l at byte 128 e + 4 l: a warp's 32 lookups never share a bank), 32 KB.
    ``k4_keys`` turns 4 words (64 dims: 16 pairs, one block's A operand per word) into 16 operands,
    each one shift-and-mask and one table load."""
    if len(centroids) != KEY4_CODES:
        raise ValueError(f"the 4-bit key table wants {KEY4_CODES} centroids, got {len(centroids)}")
    half_bits = [int(np.float16(c).view(np.uint16)) for c in centroids]
    centroid = " : ".join(f"c == {i} ? 0x{h:04x}u" for i, h in enumerate(half_bits[:-1])) + f" : 0x{half_bits[-1]:04x}u"
    return f"""
__device__ __forceinline__ uint32_t key_centroid(uint32_t c) {{ return {centroid}; }}
__device__ __forceinline__ uint32_t* key_table() {{
  __shared__ __align__(16) uint32_t table[{KEY4_TABLE_ENTRIES * 32}];
  return table;
}}
// each warp writes its rows of the table, every row one entry broadcast to the 32 columns
__device__ __forceinline__ void fill_key_table(int warp, int warps, int lane) {{
  for (int e = warp; e < {KEY4_TABLE_ENTRIES}; e += warps)
    key_table()[e * 32 + lane] = key_centroid(e & 15u) | key_centroid(static_cast<uint32_t>(e) >> 4) << 16;
}}
// shared-memory address of entry 0 of this lane's column
__device__ __forceinline__ uint32_t table_lane(int lane) {{
  return static_cast<uint32_t>(__cvta_generic_to_shared(key_table())) + (lane << 2);
}}
__device__ __forceinline__ uint32_t table_at(uint32_t address) {{
  uint32_t d;
  asm("ld.shared.b32 %0, [%1];" : "=r"(d) : "r"(address));
  return d;
}}
// keys: the 16 pairs of 64 dims (4 words; byte g of word k is register g of k-block k) as fp16x2
__device__ __forceinline__ void k4_keys(const uint32_t* w, uint32_t lane4, uint32_t* out) {{
#pragma unroll
  for (int k = 0; k < 4; ++k) {{
    uint32_t x = w[k];
    out[4 * k + 0] = table_at(lane4 + ((x << 7) & 0x7f80u));
    out[4 * k + 1] = table_at(lane4 + ((x >> 1) & 0x7f80u));
    out[4 * k + 2] = table_at(lane4 + ((x >> 9) & 0x7f80u));
    out[4 * k + 3] = table_at(lane4 + ((x >> 17) & 0x7f80u));
  }}
}}
"""


def tq3_device_source(centroids: tuple[float, ...], shift_by_imad: bool) -> str:
    """CUDA helpers: triple decode (keys / values), mma.sync m16n8k16, movmatrix, half2 packing. The
    key codebook's size says the key code width: 8 centroids for 3-bit keys, 16 for 4-bit keys."""
    value_consts = ", ".join(f"{{0x{_half2(2.0**-s):08x}u, 0x{_half2(-(2.0 ** (10 - s))):08x}u}}" for s in _SHIFTS)
    key_table = _key4_table_source(centroids) if len(centroids) == KEY4_CODES else _key_table_source(centroids, shift_by_imad)
    return f"""
#include <cstdint>
#include <cuda_fp16.h>
namespace minima {{
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {{
  uint32_t d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}}
template <int kShift>
__device__ __forceinline__ uint32_t magic(uint32_t w) {{  // (w & (7 << s in both halves)) | 1024.0
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "n"(0x00070007u << kShift), "n"({_MAGIC:#x}u));
  return d;
}}
// The 16 pairs of one triple as (1024 + c * 2^s) fp16x2 words and their shift index (s = 1, 4, 7).
__device__ __forceinline__ void triple_magic(const uint32_t* w, uint32_t* m) {{
#pragma unroll
  for (int k = 0; k < 3; ++k) {{
    uint32_t hi = w[k] >> 9;  // pairs 3, 4 of the word move to s = 1, 4
    m[5 * k + 0] = magic<1>(w[k]);
    m[5 * k + 1] = magic<4>(w[k]);
    m[5 * k + 2] = magic<7>(w[k]);
    m[5 * k + 3] = magic<1>(hi);
    m[5 * k + 4] = magic<4>(hi);
  }}
  // pair 15: bit b of its low / high code is bit 0 / 16 of word b
  m[15] = ((w[0] & 0x00010001u) << 1) | ((w[1] & 0x00010001u) << 2) | ((w[2] & 0x00010001u) << 3) | {_MAGIC:#x}u;
}}
__device__ __forceinline__ int shift_of(int pair) {{ return pair == 15 ? 0 : (pair % 5 < 3 ? pair % 5 : pair % 5 - 3); }}
// values: raw codes c as fp16x2 (exact): c = x * 2^-s - 2^(10-s)
__device__ __forceinline__ void tq3_values(const uint32_t* w, uint32_t* out) {{
  const uint32_t k[3][2] = {{{value_consts}}};
  uint32_t m[16];
  triple_magic(w, m);
#pragma unroll
  for (int p = 0; p < 16; ++p) out[p] = hfma2(m[p], k[shift_of(p)][0], k[shift_of(p)][1]);
}}
{key_table}__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {{
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {{
  uint32_t d; asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x)); return d;
}}
__device__ __forceinline__ uint32_t smem_addr(const void* p) {{ return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }}
template <int kBytes>
__device__ __forceinline__ void cp_async_to(uint32_t dst, const void* gmem) {{
  if constexpr (kBytes == 16) {{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(gmem));
  }} else {{
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(dst), "l"(gmem), "n"(kBytes));
  }}
}}
// One chunk of a page: its K and V code words (the warp copies adjacent pieces: lane l pieces l,
// l + 32, l + 64 at byte code_off of the page) and, on lanes with meta_lane, 4 bytes of its norms /
// scales / zeros at byte meta_off.
template <int kPiece, int kValueDelta, int kValueSlot>
__device__ __forceinline__ void copy_chunk(uint32_t dst, uint32_t meta_dst, const void* page, int code_off, int meta_off, bool meta_lane) {{
  const char* src = static_cast<const char*>(page) + code_off;
#pragma unroll
  for (int j = 0; j < 3; ++j) {{
    cp_async_to<kPiece>(dst + 32 * kPiece * j, src + 32 * kPiece * j);
    cp_async_to<kPiece>(dst + kValueSlot + 32 * kPiece * j, src + kValueDelta + 32 * kPiece * j);
  }}
  if (meta_lane) cp_async_to<4>(meta_dst, static_cast<const char*>(page) + meta_off);
}}
// 4-bit keys: the key lane streams are kKeyPieces pieces (4) and lie elsewhere than value + a
// constant, so both offsets are given (key pieces at dst, value pieces at dst + kValueSlot)
template <int kPiece, int kKeyPieces, int kValueSlot>
__device__ __forceinline__ void copy_chunk_kv(uint32_t dst, uint32_t meta_dst, const void* page, int k_off, int v_off, int meta_off, bool meta_lane) {{
  const char* base = static_cast<const char*>(page);
#pragma unroll
  for (int j = 0; j < kKeyPieces; ++j) cp_async_to<kPiece>(dst + 32 * kPiece * j, base + k_off + 32 * kPiece * j);
#pragma unroll
  for (int j = 0; j < 3; ++j) cp_async_to<kPiece>(dst + kValueSlot + 32 * kPiece * j, base + v_off + 32 * kPiece * j);
  if (meta_lane) cp_async_to<4>(meta_dst, base + meta_off);
}}
__device__ __forceinline__ void cp_async_commit() {{ asm volatile("cp.async.commit_group;"); }}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {{ asm volatile("cp.async.wait_group %0;" :: "n"(kPending)); }}
__device__ __forceinline__ float ex2(float x) {{  // 2^x, flushing subnormals (ex2(-inf) = 0)
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {{
  __half2 h = __floats2half2_rn(lo, hi); return *reinterpret_cast<uint32_t*>(&h);
}}
}}  // namespace minima
"""


# An FP8 chunk in a warp's ring (the FP8 role of mixed_decode_kernel): 16 K rows of D bytes whose
# 32-byte groups are XOR-swizzled by the row, then 16 V rows padded to D + FP8_V_ROW_PAD bytes, so
# that the fragment loads of both GEMMs hit 32 distinct banks.
FP8_V_ROW_PAD = 16


def fp8_chunk_bytes(head_dim: int) -> int:
    return CHUNK_TOKENS * (2 * head_dim + FP8_V_ROW_PAD)


def fp8_device_source(num_kv_heads: int, head_dim: int, page_size: int) -> str:
    """CUDA for the FP8 role: the chunk copy (zero-filling tokens past the request's last one) and
    the two fragment loads. SGLang's FP8 pool is ``[pages, page_size, H, D]`` e4m3.

    Both GEMMs are free to permute their k dimension and the value GEMM its rows, as long as the
    other operand (q, p) and the output follow; the FP8 role picks the orders in which a lane's
    registers come from adjacent bytes:
    - keys (scores^T = K q^T, k = head dims): lane 4r + t's registers of k-blocks 2b, 2b + 1 hold
      dims 32b + 8t .. 32b + 8t + 7 of tokens r and r + 8 (one 8-byte load per token), so q's word
      16b + 4t + 2(kb & 1) + j is its B operand j of k-block kb;
    - values (out^T += V^T p^T, k = tokens): m-blocks 2b, 2b + 1 hold dims 32b + 4r + (0, 1) and
      (2, 3) as rows r, r + 8; a lane loads 4 bytes of tokens 2t, 2t + 1, 2t + 8, 2t + 9 and pairs
      them by token with two byte permutes before the e4m3 -> fp16 conversion. Output element i of
      m-block mb is dim 32 (mb // 2) + 4r + 2 (mb % 2) + i // 2."""
    D, H, P = head_dim, num_kv_heads, page_size
    k_xor = "row & 3" if D >= 128 else "(row >> 1) & 1"  # 4 rows of a half warp in 4 bank groups
    return f"""
namespace minima {{
constexpr int kFp8D = {D}, kFp8VRow = {D + FP8_V_ROW_PAD}, kFp8KBytes = {CHUNK_TOKENS * D};
constexpr int64_t kFp8PageBytes = {P * H * D}, kFp8TokenStride = {H * D};
__device__ __forceinline__ int k_group_xor(int row) {{ return {k_xor}; }}
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, int src_size) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_size));
}}
// One 16-token chunk of an FP8 page, one kv head (chunk_off: its first token's K/V bytes in the page):
// lane l copies 16-byte piece l % (D/16) of token rows l / (D/16) + j * (32 / (D/16)); rows at or past
// valid_rows are zero-filled, no byte read (a free slot may hold e4m3 NaN, and 0 * NaN is NaN)
__device__ __forceinline__ void copy_fp8_chunk(uint32_t dst, const uint8_t* k_pool, const uint8_t* v_pool, int page,
                                               int chunk_off, int lane, int valid_rows) {{
  constexpr int kPieces = kFp8D / 16, kRows = 32 / kPieces;
  const int row0 = lane / kPieces, p = lane % kPieces;
  // one source pointer per pool and three destinations per lane, the pieces at constant offsets from
  // them: k_group_xor has period 4 in the row, so rows row0 + j kRows alternate between two K swizzles
  const int64_t src = page * kFp8PageBytes + chunk_off + row0 * kFp8TokenStride + p * 16;
  const uint8_t *k = k_pool + src, *v = v_pool + src;
  const uint32_t k_dst[2] = {{dst + row0 * kFp8D + ((((p >> 1) ^ k_group_xor(row0)) << 5) | ((p & 1) << 4)),
                             dst + (row0 + kRows) * kFp8D + ((((p >> 1) ^ k_group_xor(row0 + kRows)) << 5) | ((p & 1) << 4))}};
  const uint32_t v_dst = dst + kFp8KBytes + row0 * kFp8VRow + p * 16;
  const int rows_left = valid_rows - row0;
  static_assert(2 * kRows % 4 == 0, "two K swizzles");
#pragma unroll
  for (int j = 0; j < kFp8D / 32; ++j) {{
    const int size = j * kRows < rows_left ? 16 : 0;
    cp_async_zfill(k_dst[j & 1] + (j >> 1) * 2 * kRows * kFp8D, k + j * kRows * kFp8TokenStride, size);
    cp_async_zfill(v_dst + j * kRows * kFp8VRow, v + j * kRows * kFp8TokenStride, size);
  }}
}}
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {{
  asm("{{ .reg .b16 l, h; mov.b32 {{l, h}}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {{
  uint32_t d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {{
  uint32_t v; asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a)); return v;
}}
__device__ __forceinline__ uint2 lds64(uint32_t a) {{
  uint2 v; asm volatile("ld.shared.v2.b32 {{%0, %1}}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a)); return v;
}}
// keys of dims 64 tr .. 64 tr + 63 (k-blocks 4 tr .. 4 tr + 3) as 16 A-operand registers
__device__ __forceinline__ void fp8_keys(uint32_t chunk, int r, int t, int tr, uint32_t* out) {{
#pragma unroll
  for (int b = 0; b < 2; ++b) {{
    // group 2 tr + b of row r (and r + 8: same XOR): (blk & 3) ^ xor takes 4 lane-invariant values, the
    // rest is a constant offset of the load
    const int blk = 2 * tr + b;
    const uint32_t at = chunk + r * kFp8D + 8 * t + (((blk & 3) ^ k_group_xor(r)) << 5) + ((blk >> 2) << 7);
    const uint2 w = lds64(at), u = lds64(at + 8 * kFp8D);
    e4m3x4_to_half2x2(w.x, out[8 * b + 0], out[8 * b + 2]);
    e4m3x4_to_half2x2(u.x, out[8 * b + 1], out[8 * b + 3]);
    e4m3x4_to_half2x2(w.y, out[8 * b + 4], out[8 * b + 6]);
    e4m3x4_to_half2x2(u.y, out[8 * b + 5], out[8 * b + 7]);
  }}
}}
// values of dims 64 tr .. 64 tr + 63 (m-blocks 4 tr .. 4 tr + 3) as 16 A-operand registers
__device__ __forceinline__ void fp8_values(uint32_t chunk, int r, int t, int tr, uint32_t* out) {{
  const uint32_t v = chunk + kFp8KBytes + 2 * t * kFp8VRow + 4 * r;
#pragma unroll
  for (int b = 0; b < 2; ++b) {{
    const uint32_t at = v + ((2 * tr + b) << 5);
    const uint32_t wa = lds32(at), wb = lds32(at + kFp8VRow), wc = lds32(at + 8 * kFp8VRow), wd = lds32(at + 9 * kFp8VRow);
    // byte i of each word is dim 4r + i of its token: pair tokens (2t, 2t + 1) per dim
    e4m3x4_to_half2x2(prmt(wa, wb, 0x5140u), out[8 * b + 0], out[8 * b + 1]);
    e4m3x4_to_half2x2(prmt(wc, wd, 0x5140u), out[8 * b + 2], out[8 * b + 3]);
    e4m3x4_to_half2x2(prmt(wa, wb, 0x7362u), out[8 * b + 4], out[8 * b + 5]);
    e4m3x4_to_half2x2(prmt(wc, wd, 0x7362u), out[8 * b + 6], out[8 * b + 7]);
  }}
}}
__device__ __forceinline__ uint32_t bf16x2_to_half2(uint32_t w) {{  // a bf16 is the top half of its fp32
  return pack_half2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}}
}}  // namespace minima
"""
