"""TQ3 paged split-KV decode attention in TileLang, and the split combine.

One CTA = (split, kv head, request). It walks its share of the request's TQ3 page list (CSR:
``page_indptr`` / ``page_ids``), one page per tile (TQ3 pages are always full: no masking). Each
page's packed codes and fp16 metadata move global -> shared as bytes in a 2-stage cp.async pipeline
(TMA + warp specialization when built without ``TL_DISABLE_WARP_SPECIALIZED``, which measured
slower); the 3-bit codes are unpacked into fp16 tiles in shared memory through byte-permute lookup
tables, and the two GEMMs run on tensor cores (mma.sync) with the query heads of the GQA group as
rows (padded to ``block_h``), so each decoded tile serves the whole group:

    score_t = s_t * (q' . centroids[c_t])            keys: codebook value, per-token norm correction
    out'    = sum_t p_t (scale_t * c_t + zero_t)     values: GEMM on the raw codes with p_t*scale_t,
            = (p*scale) @ codes + sum_t p_t zero_t   plus one rank-1 zero term per row

Softmax is base 2 (``exp2`` with log2(e) folded into the scale); each split writes its partial
output (rotated space, fp32) and LSE (base 2). A split with no page writes out = 0, lse = -inf.
``tq3_merge_splits`` combines the splits. The whole computation stays in the rotated space
(q' = R q in, out' = R^T out afterwards, see ``decode.py``).
"""

import tilelang
import tilelang.language as T
import torch
from sglang_minima.codec.layout import BYTES_PER_GROUP, CODES_PER_GROUP, NUM_CODES, TQ3PageLayout

LOG2E = 1.4426950408889634
CODE_ROW_BYTES = 64  # codes move as rows of 64 bytes: P*3D/8 is a multiple of 64 for P >= 16, D >= 64


def _byte_perm(x, y, selector):
    return T.call_extern(T.uint32, "__byte_perm", x, y, selector)


def fp16_lut(values: tuple[float, ...]):
    """An 8-entry fp16 table held in four 32-bit immediates (low bytes, high bytes), read with byte
    permutes (``prmt``): no shared-memory lookup, so the decode loops have no data-dependent shared
    access. ``lookup(word, e)`` decodes code e of an 8-code group word: the 4 codes of a half-word are
    spread to nibbles and looked up together (2 ``prmt``), then one ``prmt`` per value joins its bytes;
    the per-quad work is shared by the 4 values after unrolling."""
    bits = torch.tensor(values, dtype=torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    lo = [int(b) & 0xFF for b in bits]
    hi = [int(b) >> 8 for b in bits]

    def word(bytes4: list[int]) -> int:
        return bytes4[0] | bytes4[1] << 8 | bytes4[2] << 16 | bytes4[3] << 24

    lo_a, lo_b, hi_a, hi_b = (T.uint32(word(x)) for x in (lo[:4], lo[4:], hi[:4], hi[4:]))

    def lookup(group_word, e):
        quad = T.if_then_else(e < 4, group_word & 0xFFF, group_word >> 12)  # codes 4q .. 4q+3
        nibbles = (quad & 0x7) | ((quad & 0x38) << 1) | ((quad & 0x1C0) << 2) | ((quad & 0xE00) << 3)
        lo_bytes = _byte_perm(lo_a, lo_b, nibbles)
        hi_bytes = _byte_perm(hi_a, hi_b, nibbles)
        j = T.Cast(T.uint32, e % 4)
        half_bits = _byte_perm(lo_bytes, hi_bytes, j | ((j + 4) << 4))
        return T.reinterpret(T.Cast(T.uint16, half_bits), T.float16)

    return lookup


@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True})
def tq3_decode_kernel(
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    centroids: tuple[float, ...],
    *,
    block_h: int = 16,
    num_stages: int = 2,
    threads: int = 128,
    min_blocks: int = 1,
):
    """Partial decode over TQ3 pages; ``centroids`` (the 8 key codebook values) are baked in.

    Shapes (dynamic: batch, num_pages, nnz, num_splits): q_rot [batch, H*G, D] fp16 (rotated
    queries); the TQ3 pool seen through three strided views of one [num_pages, page_bytes] uint8
    tensor (``pool_views``): k_codes / v_codes [num_pages, H, P*3D/512, 64] uint8 and meta
    [num_pages, 3, H, P] fp16 (k_norm, v_scale, v_zero); page_indptr [batch+1] int32, page_ids [nnz]
    int32 -> out_partial [batch, H*G, num_splits, D] fp32, lse_partial [batch, H*G, num_splits] fp32
    (base 2).
    """
    layout = TQ3PageLayout(num_kv_heads, page_size, head_dim)
    H, G, D, P = num_kv_heads, group_size, head_dim, page_size
    if not G <= block_h:
        raise ValueError(f"block_h={block_h} must cover the GQA group ({G} query heads)")
    heads = H * G
    cb = layout.code_bytes_per_token
    rows = P * cb // CODE_ROW_BYTES  # one head's codes in one page, as rows of CODE_ROW_BYTES
    tile_n = P  # one page per tile: TQ3 pages are always full, so no masking
    # pad the 3 metadata rows (k_norm, v_scale, v_zero; 2P bytes each) to a multiple of 128 bytes,
    # so every pipeline stage starts 128-byte aligned, as TMA needs when the kernel is built
    # warp-specialized (cp.async, the default build, needs 16)
    meta_rows = next(r for r in range(3, 65) if r * P * 2 % 128 == 0)
    page_bytes = layout.page_bytes
    scale = sm_scale * LOG2E
    # both GEMMs must split the rows the same way so their row statistics share one layout
    policy = T.GemmWarpPolicy.FullCol if block_h == 16 else T.GemmWarpPolicy.Square
    neg_inf = -T.infinity(T.float32)

    batch, num_pages, nnz, num_splits = T.dynamic("batch, num_pages, nnz, num_splits")
    code_shape = [num_pages, H, rows, CODE_ROW_BYTES]
    code_strides = [page_bytes, rows * CODE_ROW_BYTES, CODE_ROW_BYTES, 1]

    key_lut = fp16_lut(centroids)
    value_lut = fp16_lut(tuple(float(c) for c in range(NUM_CODES)))

    def group_word(codes_s, i, g):
        """The 24-bit little-endian word of code group g of token row i of a codes tile."""
        base = i * cb + g * BYTES_PER_GROUP
        return (
            T.Cast(T.uint32, codes_s[base // CODE_ROW_BYTES, base % CODE_ROW_BYTES])
            | (T.Cast(T.uint32, codes_s[(base + 1) // CODE_ROW_BYTES, (base + 1) % CODE_ROW_BYTES]) << 8)
            | (T.Cast(T.uint32, codes_s[(base + 2) // CODE_ROW_BYTES, (base + 2) % CODE_ROW_BYTES]) << 16)
        )

    @T.prim_func
    def tq3_decode(
        q_rot: T.Tensor([batch, heads, D], T.float16),
        k_codes: T.StridedTensor(code_shape, code_strides, T.uint8),
        v_codes: T.StridedTensor(code_shape, code_strides, T.uint8),
        meta: T.StridedTensor([num_pages, 3, H, P], [page_bytes // 2, H * P, P, 1], T.float16),
        page_indptr: T.Tensor([batch + 1], T.int32),
        page_ids: T.Tensor([nnz], T.int32),
        out_partial: T.Tensor([batch, heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, heads, num_splits], T.float32),
    ):
        with T.Kernel(num_splits, H, batch, threads=threads) as (sid, hk, bid):
            T.annotate_min_blocks_per_sm(min_blocks)
            q_s = T.alloc_shared([block_h, D], T.float16)
            kc_s = T.alloc_shared([rows, CODE_ROW_BYTES], T.uint8)
            vc_s = T.alloc_shared([rows, CODE_ROW_BYTES], T.uint8)
            meta_s = T.alloc_shared([meta_rows, P], T.float16)
            k_s = T.alloc_shared([tile_n, D], T.float16)
            v_s = T.alloc_shared([tile_n, D], T.float16)
            p_s = T.alloc_shared([block_h, tile_n], T.float16)

            acc_s = T.alloc_fragment([block_h, tile_n], T.float32)
            zero_w = T.alloc_fragment([block_h, tile_n], T.float32)
            acc_o = T.alloc_fragment([block_h, D], T.float32)
            m_i = T.alloc_fragment([block_h], T.float32)
            m_prev = T.alloc_fragment([block_h], T.float32)
            alpha = T.alloc_fragment([block_h], T.float32)
            l_i = T.alloc_fragment([block_h], T.float32)
            z_i = T.alloc_fragment([block_h], T.float32)
            row_sum = T.alloc_fragment([block_h], T.float32)
            zero_sum = T.alloc_fragment([block_h], T.float32)

            first = page_indptr[bid]
            n_pages = page_indptr[bid + 1] - first
            chunk = T.ceildiv(n_pages, num_splits)
            p_lo = T.min(sid * chunk, n_pages)
            p_hi = T.min(p_lo + chunk, n_pages)

            for i, d in T.Parallel(block_h, D):
                q_s[i, d] = T.if_then_else(i < G, q_rot[bid, hk * G + T.min(i, G - 1), d], T.float16(0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(z_i, 0)
            T.fill(m_i, neg_inf)

            for t in T.Pipelined(p_hi - p_lo, num_stages=num_stages):
                page = page_ids[first + p_lo + t]
                T.copy(k_codes[page, hk, :, :], kc_s)
                T.copy(v_codes[page, hk, :, :], vc_s)
                T.copy(meta[page, :, hk, :], meta_s[0:3, :])

                # keys -> codebook values (fp16), one 8-code group per iteration
                for i, g in T.Parallel(tile_n, D // CODES_PER_GROUP):
                    for e in T.unroll(CODES_PER_GROUP):
                        k_s[i, g * CODES_PER_GROUP + e] = key_lut(group_word(kc_s, i, g), e)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=policy)
                for i, j in T.Parallel(block_h, tile_n):
                    acc_s[i, j] = acc_s[i, j] * T.Cast(T.float32, meta_s[0, j]) * scale
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(block_h):
                    alpha[i] = T.exp2(m_prev[i] - m_i[i])
                for i, j in T.Parallel(block_h, tile_n):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m_i[i])
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i, j in T.Parallel(block_h, tile_n):
                    zero_w[i, j] = acc_s[i, j] * T.Cast(T.float32, meta_s[2, j])
                    p_s[i, j] = T.Cast(T.float16, acc_s[i, j] * T.Cast(T.float32, meta_s[1, j]))
                T.reduce_sum(zero_w, zero_sum, dim=1)
                for i in T.Parallel(block_h):
                    l_i[i] = l_i[i] * alpha[i] + row_sum[i]
                    z_i[i] = z_i[i] * alpha[i] + zero_sum[i]
                for i, d in T.Parallel(block_h, D):
                    acc_o[i, d] *= alpha[i]

                # values: raw uniform codes as fp16 (exact); the scale went into p, the zero into z_i
                for i, g in T.Parallel(tile_n, D // CODES_PER_GROUP):
                    for e in T.unroll(CODES_PER_GROUP):
                        v_s[i, g * CODES_PER_GROUP + e] = value_lut(group_word(vc_s, i, g), e)
                T.gemm(p_s, v_s, acc_o, policy=policy)

            for i, d in T.Parallel(block_h, D):
                if i < G:
                    out_partial[bid, hk * G + i, sid, d] = T.if_then_else(
                        l_i[i] > 0, (acc_o[i, d] + z_i[i]) / l_i[i], T.float32(0)
                    )
            for i in T.Parallel(block_h):
                if i < G:
                    lse_partial[bid, hk * G + i, sid] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i], neg_inf)

    return tq3_decode


@tilelang.jit
def tq3_merge_splits(num_heads: int, head_dim: int):
    """Combine split partials: out_partial [batch, heads, S, D] fp32, lse_partial [batch, heads, S]
    (base 2) -> out [batch, heads, D] fp32, lse [batch, heads] (base 2). All -inf -> out 0, lse -inf."""
    D = head_dim
    batch, num_splits = T.dynamic("batch, num_splits")
    neg_inf = -T.infinity(T.float32)

    @T.prim_func
    def merge_splits(
        out_partial: T.Tensor([batch, num_heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, num_heads, num_splits], T.float32),
        out: T.Tensor([batch, num_heads, D], T.float32),
        lse: T.Tensor([batch, num_heads], T.float32),
    ):
        with T.Kernel(num_heads, batch, threads=D) as (h, b):
            tx = T.get_thread_binding()
            lse_max = T.alloc_local([1], T.float32)
            denom = T.alloc_local([1], T.float32)
            acc = T.alloc_local([1], T.float32)
            lse_max[0] = neg_inf
            for s in T.serial(num_splits):
                lse_max[0] = T.max(lse_max[0], lse_partial[b, h, s])
            denom[0] = 0
            acc[0] = 0
            if lse_max[0] > neg_inf:
                for s in T.serial(num_splits):
                    w = T.exp2(lse_partial[b, h, s] - lse_max[0])
                    denom[0] += w
                    acc[0] += w * out_partial[b, h, s, tx]
                out[b, h, tx] = acc[0] / denom[0]
                if tx == 0:
                    lse[b, h] = T.log2(denom[0]) + lse_max[0]
            else:
                out[b, h, tx] = 0
                if tx == 0:
                    lse[b, h] = neg_inf

    return merge_splits


def tile_config(group_size: int, page_size: int) -> dict[str, int]:
    """Tile shapes for a (GQA group, page size), as measured best on the H200 (docs/results/kernels.md).

    Rows (query heads) are padded to a multiple of 16 (the MMA M). The kernel is bound by unpacking
    codes, which wants several CTAs per SM: 4 warps per CTA and 2 CTAs per SM beat both the TMA
    warp-specialized build (one consumer warpgroup per SM) and 8-warp CTAs. With 16-token pages the
    4 warps need >= 32 rows to split the tile 2 x 2."""
    block_h = max(16, -(-group_size // 16) * 16)
    if page_size < 32:
        block_h = max(block_h, 32)
    return {"block_h": block_h, "threads": 128, "min_blocks": 2}
