"""The two small kernels around the TQ3 split decode: rotate the queries in, and in one pass combine
the splits, rotate the output back and merge it with the FP8 pages' state.

Without them the mixed decode costs eight launches of glue (permutes, batched matmuls, casts, the
split combine, ``merge_state``) on top of the two attention kernels; at small batch those launches
cost more than the attention itself. Rotations are dense ``[H, D, D]`` fp32 matrices (``R[h] @ k`` is
the codec's rotate), so any head dim works; for the Hadamard dims a dense matvec is still far below
the attention's bytes (the matrices stay in L2).
"""

import tilelang
import tilelang.language as T


@tilelang.jit
def rotate_queries_kernel(num_qo_heads: int, group_size: int, head_dim: int, dtype: str = "bfloat16", warps: int = 4):
    """q [batch, Hq, D] (``dtype``) -> q' = R[h] q [batch, Hq, D] fp16 (h = head // group_size).

    One CTA per (query head, request); each warp takes D / warps output rows and reads R row by row
    with its 32 lanes (coalesced), reducing across lanes with shuffles."""
    D = head_dim
    if D % 32 or D % warps:
        raise ValueError(f"head_dim={D} must be a multiple of 32 and of warps={warps}")
    rows_per_warp = D // warps
    per_lane = D // 32
    batch = T.dynamic("batch")

    @T.prim_func
    def rotate_queries(
        q: T.Tensor([batch, num_qo_heads, D], dtype),
        rotation: T.Tensor([num_qo_heads // group_size, D, D], T.float32),
        q_rot: T.Tensor([batch, num_qo_heads, D], T.float16),
    ):
        with T.Kernel(num_qo_heads, batch, threads=32 * warps) as (h, b):
            tid = T.get_thread_binding()
            lane = tid % 32
            warp = tid // 32
            q_local = T.alloc_local([per_lane], T.float32)
            acc = T.alloc_local([1], T.float32)
            for e in T.unroll(per_lane):
                q_local[e] = T.Cast(T.float32, q[b, h, e * 32 + lane])
            for row in T.serial(rows_per_warp):
                i = warp * rows_per_warp + row
                acc[0] = 0
                for e in T.unroll(per_lane):
                    acc[0] += rotation[h // group_size, i, e * 32 + lane] * q_local[e]
                for off in T.unroll(5):
                    acc[0] += T.shfl_xor(acc[0], 16 // (1 << off))
                if lane == 0:
                    q_rot[b, h, i] = T.Cast(T.float16, acc[0])

    return rotate_queries


@tilelang.jit
def mixed_epilogue_kernel(num_qo_heads: int, group_size: int, head_dim: int, with_fp8: bool, dtype: str = "bfloat16"):
    """Split partials of the TQ3 pages (rotated space) -> final output, merged with the FP8 state.

    out_partial [batch, Hq, S, D] fp32, lse_partial [batch, Hq, S] (base 2), rotation [H, D, D];
    with_fp8: fp8_out [batch, Hq, D] and fp8_lse [batch, Hq] (base 2, FlashInfer's) -> out [batch, Hq, D],
    lse [batch, Hq] (base 2); outputs in ``dtype``. A request without TQ3 pages (all splits -inf) takes
    the FP8 state as is; with_fp8 False (no FP8 page in the batch) takes the TQ3 state alone and
    ignores fp8_out / fp8_lse."""
    D = head_dim
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
        with T.Kernel(num_qo_heads, batch, threads=D) as (h, b):
            tx = T.get_thread_binding()
            o_rot = T.alloc_shared([D], T.float32)
            m = T.alloc_local([1], T.float32)
            den = T.alloc_local([1], T.float32)
            acc = T.alloc_local([1], T.float32)
            lse_t = T.alloc_local([1], T.float32)
            m[0] = neg_inf
            for s in T.serial(num_splits):
                m[0] = T.max(m[0], lse_partial[b, h, s])
            den[0] = 0
            acc[0] = 0
            if m[0] > neg_inf:
                for s in T.serial(num_splits):
                    w = T.exp2(lse_partial[b, h, s] - m[0])
                    den[0] += w
                    acc[0] += w * out_partial[b, h, s, tx]
            o_rot[tx] = T.if_then_else(den[0] > 0, acc[0] / den[0], T.float32(0))
            lse_t[0] = T.if_then_else(den[0] > 0, T.log2(den[0]) + m[0], neg_inf)
            T.sync_threads()
            # out = R^T out': thread i reads column i of R (consecutive threads, consecutive words)
            acc[0] = 0
            for j in T.serial(D):
                acc[0] += rotation[h // group_size, j, tx] * o_rot[j]
            if with_fp8:
                lse_f = fp8_lse[b, h]
                top = T.max(lse_t[0], lse_f)
                w_t = T.if_then_else(lse_t[0] > neg_inf, T.exp2(lse_t[0] - top), T.float32(0))
                w_f = T.exp2(lse_f - top)
                out[b, h, tx] = T.Cast(
                    dtype, (w_t * acc[0] + w_f * T.Cast(T.float32, fp8_out[b, h, tx])) / (w_t + w_f)
                )
                if tx == 0:
                    lse[b, h] = top + T.log2(w_t + w_f)
            else:
                out[b, h, tx] = T.Cast(dtype, acc[0])
                if tx == 0:
                    lse[b, h] = lse_t[0]

    return mixed_epilogue
