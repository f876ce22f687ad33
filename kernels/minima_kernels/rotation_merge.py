"""The two small kernels around the TQ3 split decode: rotate the queries in, and in one pass combine
the splits, rotate the output back and merge it with the FP8 pages' state.

Without them the mixed decode costs eight launches of glue (permutes, batched matmuls, casts, the
split combine, ``merge_state``) on top of the two attention kernels; at small batch those launches
cost more than the attention itself. Rotations are dense ``[H, D, D]`` fp32 matrices (``R[h] @ k`` is
the codec's rotate), so any head dim works. Both kernels move a few KB per request and are bound by
latency, not bytes: a CTA per (kv head, request, 32 rows or dims) serves the whole GQA group, and each
warp issues all its loads of R before it uses the first (one CTA per (kv head, request) looping over
all D rows took 12-44 us per decode step on the H200: docs/results/kernels.md).
"""

import tilelang
import tilelang.language as T


BLOCK = 32  # rows of R (rotation) or output dims (epilogue) per CTA
WARPS = 8


@tilelang.jit
def rotate_queries_kernel(num_qo_heads: int, group_size: int, head_dim: int, dtype: str = "bfloat16"):
    """q [batch, Hq, D] (``dtype``) -> q' = R[h] q [batch, Hq, D] fp16 (h = head // group_size).

    One CTA per (kv head, request, 32 rows of R) rotates the G query heads of the group: each warp
    reads its 4 rows with its 32 lanes (coalesced) and computes G dot products per row, reduced across
    lanes with shuffles. The kernel moves a few KB and is bound by latency: all of a warp's loads of R
    are issued before the first is used, and the grid has D / 32 CTAs per request and kv head."""
    D, G = head_dim, group_size
    if D % BLOCK:
        raise ValueError(f"head_dim={D} must be a multiple of {BLOCK}")
    rows = BLOCK // WARPS
    per_lane = D // 32
    batch = T.dynamic("batch")

    @T.prim_func
    def rotate_queries(
        q: T.Tensor([batch, num_qo_heads, D], dtype),
        rotation: T.Tensor([num_qo_heads // group_size, D, D], T.float32),
        q_rot: T.Tensor([batch, num_qo_heads, D], T.float16),
    ):
        with T.Kernel(num_qo_heads // group_size, batch, D // BLOCK, threads=32 * WARPS) as (hk, b, blk):
            tid = T.get_thread_binding()
            lane = tid % 32
            warp = tid // 32
            q_local = T.alloc_local([G * per_lane], T.float32)
            r_local = T.alloc_local([rows * per_lane], T.float32)
            acc = T.alloc_local([1], T.float32)
            for k in T.unroll(rows):
                for e in T.unroll(per_lane):
                    r_local[k * per_lane + e] = rotation[hk, blk * BLOCK + warp * rows + k, e * 32 + lane]
            for g in T.unroll(G):
                for e in T.unroll(per_lane):
                    q_local[g * per_lane + e] = T.Cast(T.float32, q[b, hk * G + g, e * 32 + lane])
            for k in T.unroll(rows):
                for g in T.unroll(G):
                    acc[0] = 0
                    for e in T.unroll(per_lane):
                        acc[0] += r_local[k * per_lane + e] * q_local[g * per_lane + e]
                    for off in T.unroll(5):
                        acc[0] += T.shfl_xor(acc[0], 16 // (1 << off))
                    if lane == 0:
                        q_rot[b, hk * G + g, blk * BLOCK + warp * rows + k] = T.Cast(T.float16, acc[0])

    return rotate_queries


@tilelang.jit
def mixed_epilogue_kernel(num_qo_heads: int, group_size: int, head_dim: int, with_fp8: bool, dtype: str = "bfloat16"):
    """Split partials of the TQ3 pages (rotated space) -> final output, merged with the FP8 state.

    out_partial [batch, Hq, S, D] fp32, lse_partial [batch, Hq, S] (base 2), rotation [H, D, D];
    with_fp8: fp8_out [batch, Hq, D] and fp8_lse [batch, Hq] (base 2, FlashInfer's) -> out [batch, Hq, D],
    lse [batch, Hq] (base 2); outputs in ``dtype``. A request without TQ3 pages (all splits -inf) takes
    the FP8 state as is; with_fp8 False (no FP8 page in the batch) takes the TQ3 state alone and
    ignores fp8_out / fp8_lse.

    One CTA per (kv head, request, 32 output dims) handles the group's G query heads: it combines the
    splits of all G x D rotated outputs into shared memory, then out_i = sum_j R[j, i] out'_j for its
    32 dims i, each warp over D / 8 rows j (lane = i: consecutive lanes read consecutive words, all of
    a warp's loads issued before the first is used), and the warps' sums meet in shared memory."""
    D, G = head_dim, group_size
    if D % BLOCK:
        raise ValueError(f"head_dim={D} must be a multiple of {BLOCK}")
    rows = D // WARPS
    threads = 32 * WARPS
    batch, num_splits = T.dynamic("batch, num_splits")
    neg_inf = -T.infinity(T.float32)

    @T.prim_func
    def mixed_epilogue(
        out_partial: T.Tensor([batch, num_qo_heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, num_qo_heads, num_splits], T.float32),
        rotation: T.Tensor([num_qo_heads // group_size, D, D], T.float32),
        fp8_out: T.Tensor([batch, num_qo_heads, D], dtype),
        fp8_lse: T.Tensor([batch, num_qo_heads], T.float32),
        out: T.Tensor([batch, num_qo_heads, D], dtype),
        lse: T.Tensor([batch, num_qo_heads], T.float32),
    ):
        with T.Kernel(num_qo_heads // group_size, batch, D // BLOCK, threads=threads) as (hk, b, blk):
            tid = T.get_thread_binding()
            lane = tid % 32
            warp = tid // 32
            o_rot = T.alloc_shared([G, D], T.float32)
            lse_s = T.alloc_shared([G], T.float32)
            o_part = T.alloc_shared([WARPS, G, BLOCK], T.float32)
            r_local = T.alloc_local([rows], T.float32)
            acc = T.alloc_local([G], T.float32)
            m = T.alloc_local([1], T.float32)
            den = T.alloc_local([1], T.float32)
            num = T.alloc_local([1], T.float32)
            i = blk * BLOCK + lane
            for jj in T.unroll(rows):  # issued first: their latency overlaps the split combine
                r_local[jj] = rotation[hk, warp * rows + jj, i]
            for e in T.serial(T.ceildiv(G * D, threads)):
                idx = e * threads + tid
                if idx < G * D:
                    g = idx // D
                    d = idx % D
                    h = hk * G + g
                    m[0] = neg_inf
                    for s in T.unroll(num_splits, unroll_factor=8):
                        m[0] = T.max(m[0], lse_partial[b, h, s])
                    den[0] = 0
                    num[0] = 0
                    if m[0] > neg_inf:
                        for s in T.unroll(num_splits, unroll_factor=8):
                            w = T.exp2(lse_partial[b, h, s] - m[0])
                            den[0] += w
                            num[0] += w * out_partial[b, h, s, d]
                    o_rot[g, d] = T.if_then_else(den[0] > 0, num[0] / den[0], T.float32(0))
                    if d == 0:
                        lse_s[g] = T.if_then_else(den[0] > 0, T.log2(den[0]) + m[0], neg_inf)
            T.sync_threads()
            for g in T.unroll(G):  # out = R^T out', this warp's rows of R
                acc[g] = 0
                for jj in T.unroll(rows):
                    acc[g] += r_local[jj] * o_rot[g, warp * rows + jj]
                o_part[warp, g, lane] = acc[g]
            T.sync_threads()
            if warp == 0:
                for g in T.unroll(G):
                    h = hk * G + g
                    for w in T.unroll(1, WARPS):
                        acc[g] += o_part[w, g, lane]
                    lse_t = lse_s[g]
                    if with_fp8:
                        lse_f = fp8_lse[b, h]
                        top = T.max(lse_t, lse_f)
                        w_t = T.if_then_else(lse_t > neg_inf, T.exp2(lse_t - top), T.float32(0))
                        w_f = T.exp2(lse_f - top)
                        out[b, h, i] = T.Cast(dtype, (w_t * acc[g] + w_f * T.Cast(T.float32, fp8_out[b, h, i])) / (w_t + w_f))
                        if blk == 0 and lane == 0:
                            lse[b, h] = top + T.log2(w_t + w_f)
                    else:
                        out[b, h, i] = T.Cast(dtype, acc[g])
                        if blk == 0 and lane == 0:
                            lse[b, h] = lse_t

    return mixed_epilogue
