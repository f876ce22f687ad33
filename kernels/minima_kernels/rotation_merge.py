"""The small kernels around the TQ3 split decode: rotate the queries in, and in one pass combine the
splits, rotate the output back and merge it with the FP8 pages' state (or only combine the splits,
``tq3_merge_splits``, for the TQ3 part alone).

Without them the mixed decode costs eight launches of glue (permutes, batched matmuls, casts, the
split combine, ``merge_state``) on top of the two attention kernels; at small batch those launches
cost more than the attention itself. The rotation is the codec's randomized Hadamard transform
(``codec/rotation.py``: R = H_d diag(signs) / sqrt(d)), applied as a fast Walsh-Hadamard transform with
the codec's butterfly order, so the kernels read D signs per head instead of a D x D matrix: one CTA
per (query head, request), one thread per dim, butterflies of distance < 32 by warp shuffles and the
rest through shared memory (0-3 barriers for head dims 32-256). Built without FMA contraction, the rotation gives the
codec's fp32 bits (dense-matrix kernels took 12-44 us per decode step on the H200, bound by the
latency of their loads of R and of a serial split loop: docs/results/kernels.md).

The split combine is bound by the latency of its loads too (up to hundreds of splits at batch 1): the
CTA's threads share the splits' LSEs (one load each, block reductions for the max and the sum of the
weights, the weights kept in shared memory) and the partial outputs (``256 / D`` groups of threads,
one per dim, each over every ``groups``-th split, 8 loads in flight).
"""

import tilelang
import tilelang.language as T
from sglang_minima.codec.rotation import fp32_inv_sqrt

from .common import EXACT_FP32, MAX_SPLITS, log2_int

WARP_BUTTERFLIES = 5  # stages h = 1 .. 16 stay inside a warp (shuffles)
THREADS = 256  # per combine CTA: 256 / D groups of D threads


@T.macro
def _fwht_threads(x, buf, d, log_dim: int):
    """x[0] of thread d <- element d of the unnormalized Walsh-Hadamard transform of the CTA's D values
    (one per thread), stages h = 1, 2, 4, ... as the codec: (a, b) -> (a + b, a - b), a at the lower
    index. buf: shared [2, D] fp32, double-buffered so that each shared stage needs one barrier."""
    for s in T.unroll(min(log_dim, WARP_BUTTERFLIES)):
        other = T.shfl_xor(x[0], T.shift_left(1, s))
        x[0] = T.if_then_else(T.bitwise_and(d, T.shift_left(1, s)) != 0, other - x[0], x[0] + other)
    for s in T.unroll(WARP_BUTTERFLIES, log_dim):
        buf[s % 2, d] = x[0]
        T.sync_threads()
        other = buf[s % 2, T.bitwise_xor(d, T.shift_left(1, s))]
        x[0] = T.if_then_else(T.bitwise_and(d, T.shift_left(1, s)) != 0, other - x[0], x[0] + other)


@tilelang.jit(pass_configs=EXACT_FP32)
def rotate_queries_kernel(num_qo_heads: int, group_size: int, head_dim: int, dtype: str = "bfloat16"):
    """q [batch, Hq, D] (``dtype``), signs [Hq / G, D] fp32 (+-1) -> q' = R q [batch, Hq, D] fp16, the
    codec's ``rotate`` (fp32, bit for bit) rounded to fp16. One CTA per (query head, request)."""
    D, G = head_dim, group_size
    _check_combine_dims(D)  # a warp's shuffles need 32 live lanes: D >= 32
    log_d = log2_int(D)
    inv_sqrt_d = fp32_inv_sqrt(D)
    batch = T.dynamic("batch")

    @T.prim_func
    def rotate_queries(
        q: T.Tensor([batch, num_qo_heads, D], dtype),
        signs: T.Tensor([num_qo_heads // group_size, D], T.float32),
        q_rot: T.Tensor([batch, num_qo_heads, D], T.float16),
    ):
        with T.Kernel(num_qo_heads, batch, threads=D) as (h, b):
            d = T.get_thread_binding()
            x = T.alloc_local([1], T.float32)
            buf = T.alloc_shared([2, D], T.float32)
            x[0] = T.Cast(T.float32, q[b, h, d]) * signs[h // G, d]
            _fwht_threads(x, buf, d, log_d)
            q_rot[b, h, d] = T.Cast(T.float16, x[0] * T.float32(inv_sqrt_d))

    return rotate_queries


@T.macro
def _combine_splits(out_partial, lse_partial, b, h, tid, head_dim: int, x, lse_t, w_s, red_s, part_s, second=None):
    """x[0] <- dim tid % D of head h's output combined over its splits (rotated space), lse_t[0] <- its
    LSE (base 2); every thread of the CTA gets its dim's value. All splits -inf -> x 0, lse -inf.
    w_s: shared [MAX_SPLITS] (the splits' weights), red_s: shared [2, THREADS / 32] (the warps' max and
    sum), part_s: shared [THREADS / D, D] (the groups' partial sums). The split count is read from
    lse_partial's shape: a dynamic size passed as a macro argument would be renamed after the macro's
    parameter (TileLang 0.1.12 names bound arguments in place), and the epilogue's two counts would
    then share one name, which TileLang's cython launcher resolves by name.

    ``second`` = (out_partial, lse_partial, x, w_s, part_s) of a second set of splits (the FP8 pages'):
    one pass over both, with one max and one sum of weights, so x and the second x are both divided by
    the joint sum (their sum is the combined output; the rotation is linear, so x may be un-rotated
    first) and lse_t is the joint LSE. The loads of both sets' LSEs and partials are issued together:
    at batch 1 (tens of splits per head) the epilogue is a chain of dependent loads and barriers."""
    groups = THREADS // head_dim
    m = T.alloc_local([1], T.float32)
    den = T.alloc_local([1], T.float32)
    num = T.alloc_local([1], T.float32)
    num_b = T.alloc_local([1], T.float32)
    two = second is not None
    out_b, lse_b, x_b, w_b, part_b = second if two else (None,) * 5
    m[0] = -T.infinity(T.float32)
    for i in T.unroll(MAX_SPLITS // THREADS):
        if i * THREADS + tid < lse_partial.shape[2]:
            w_s[i * THREADS + tid] = lse_partial[b, h, i * THREADS + tid]
            m[0] = T.max(m[0], w_s[i * THREADS + tid])
        if two and i * THREADS + tid < lse_b.shape[2]:
            w_b[i * THREADS + tid] = lse_b[b, h, i * THREADS + tid]
            m[0] = T.max(m[0], w_b[i * THREADS + tid])
    for off in T.unroll(WARP_BUTTERFLIES):
        m[0] = T.max(m[0], T.shfl_xor(m[0], T.shift_left(1, off)))
    red_s[0, tid // 32] = m[0]
    T.sync_threads()
    for w in T.unroll(THREADS // 32):
        m[0] = T.max(m[0], red_s[0, w])
    den[0] = 0
    for i in T.unroll(MAX_SPLITS // THREADS):
        if i * THREADS + tid < lse_partial.shape[2]:  # m = -inf: every split is empty, weight 0
            w_s[i * THREADS + tid] = T.if_then_else(m[0] > -T.infinity(T.float32), T.exp2(w_s[i * THREADS + tid] - m[0]), 0)
            den[0] += w_s[i * THREADS + tid]
        if two and i * THREADS + tid < lse_b.shape[2]:
            w_b[i * THREADS + tid] = T.if_then_else(m[0] > -T.infinity(T.float32), T.exp2(w_b[i * THREADS + tid] - m[0]), 0)
            den[0] += w_b[i * THREADS + tid]
    for off in T.unroll(WARP_BUTTERFLIES):
        den[0] += T.shfl_xor(den[0], T.shift_left(1, off))
    red_s[1, tid // 32] = den[0]
    T.sync_threads()
    den[0] = 0
    for w in T.unroll(THREADS // 32):
        den[0] += red_s[1, w]
    num[0] = 0
    if two:  # one loop over both sets: each iteration's loads of both in flight together
        num_b[0] = 0
        for i in T.unroll(T.ceildiv(T.max(lse_partial.shape[2], lse_b.shape[2]), groups), unroll_factor=8):
            s = i * groups + tid // head_dim
            if s < lse_partial.shape[2]:
                num[0] += w_s[s] * out_partial[b, h, s, tid % head_dim]
            if s < lse_b.shape[2]:
                num_b[0] += w_b[s] * out_b[b, h, s, tid % head_dim]
        part_b[tid // head_dim, tid % head_dim] = num_b[0]
    else:
        for i in T.unroll(T.ceildiv(lse_partial.shape[2], groups), unroll_factor=8):
            s = i * groups + tid // head_dim
            if s < lse_partial.shape[2]:
                num[0] += w_s[s] * out_partial[b, h, s, tid % head_dim]
    part_s[tid // head_dim, tid % head_dim] = num[0]
    T.sync_threads()
    x[0] = 0
    for g in T.unroll(groups):
        x[0] += part_s[g, tid % head_dim]
    x[0] = T.if_then_else(den[0] > 0, x[0] / den[0], T.float32(0))
    if two:
        x_b[0] = 0
        for g in T.unroll(groups):
            x_b[0] += part_b[g, tid % head_dim]
        x_b[0] = T.if_then_else(den[0] > 0, x_b[0] / den[0], T.float32(0))
    lse_t[0] = T.if_then_else(den[0] > 0, T.log2(den[0]) + m[0], -T.infinity(T.float32))


def _check_combine_dims(head_dim: int) -> None:
    if THREADS % head_dim or head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: the glue kernels take a power of two from 32 to {THREADS}")


@tilelang.jit(pass_configs=EXACT_FP32)
def tq3_merge_splits(num_heads: int, head_dim: int):
    """Combine split partials: out_partial [batch, heads, S, D] fp32, lse_partial [batch, heads, S]
    (base 2) -> out [batch, heads, D] fp32, lse [batch, heads] (base 2). All -inf -> out 0, lse -inf.
    S <= MAX_SPLITS."""
    D = head_dim
    _check_combine_dims(D)
    batch, num_splits = T.dynamic("batch, num_splits")

    @T.prim_func
    def merge_splits(
        out_partial: T.Tensor([batch, num_heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, num_heads, num_splits], T.float32),
        out: T.Tensor([batch, num_heads, D], T.float32),
        lse: T.Tensor([batch, num_heads], T.float32),
    ):
        with T.Kernel(num_heads, batch, threads=THREADS) as (h, b):
            tid = T.get_thread_binding()
            w_s = T.alloc_shared([MAX_SPLITS], T.float32)
            red_s = T.alloc_shared([2, THREADS // 32], T.float32)
            part_s = T.alloc_shared([THREADS // D, D], T.float32)
            x = T.alloc_local([1], T.float32)
            lse_t = T.alloc_local([1], T.float32)
            _combine_splits(out_partial, lse_partial, b, h, tid, D, x, lse_t, w_s, red_s, part_s)
            if tid < D:
                out[b, h, tid] = x[0]
                if tid == 0:
                    lse[b, h] = lse_t[0]

    return merge_splits


FP8_STATES = ("none", "merged", "splits")


@tilelang.jit(pass_configs=EXACT_FP32)
def mixed_epilogue_kernel(num_qo_heads: int, group_size: int, head_dim: int, fp8_state: str, dtype: str = "bfloat16"):
    """Split partials of the TQ3 pages (rotated space) -> final output, merged with the FP8 pages' state.

    out_partial [batch, Hq, S, D] fp32 (S <= MAX_SPLITS), lse_partial [batch, Hq, S] (base 2), signs
    [Hq / G, D]; the FP8 state by ``fp8_state``: "merged" (FlashInfer's): fp8_out [batch, Hq, D]
    (``dtype``), fp8_lse [batch, Hq]; "splits" (``fp8_decode_kernel``'s): fp8_out [batch, Hq, S8, D]
    fp32, fp8_lse [batch, Hq, S8]; "none" (no FP8 page in the batch): as "merged", not read. -> out
    [batch, Hq, D] (``dtype``), lse [batch, Hq] (base 2). A request without pages of one format takes
    the other's state as is (its splits are all -inf); a request needs pages of at least one format
    (with neither, out is 0 / 0: ``MinimaDecodeWrapper.plan`` refuses such batches).

    One CTA per (query head, request): the split combine(s), then the un-rotation of the TQ3 state
    (codec ``unrotate``: FWHT, 1/sqrt(d), signs; every group of D threads transforms its own copy, so
    all threads reach the barriers) and the merge, written by the first group."""
    if fp8_state not in FP8_STATES:
        raise ValueError(f"fp8_state={fp8_state!r}: one of {FP8_STATES}")
    D, G = head_dim, group_size
    _check_combine_dims(D)
    log_d = log2_int(D)
    inv_sqrt_d = fp32_inv_sqrt(D)
    batch, num_splits, num_fp8_splits = T.dynamic("batch, num_splits, num_fp8_splits")
    neg_inf = -T.infinity(T.float32)
    fp8_splits = fp8_state == "splits"
    fp8_out_shape = [batch, num_qo_heads, num_fp8_splits, D] if fp8_splits else [batch, num_qo_heads, D]
    fp8_lse_shape = [batch, num_qo_heads, num_fp8_splits] if fp8_splits else [batch, num_qo_heads]
    fp8_out_dtype = T.float32 if fp8_splits else dtype

    @T.prim_func
    def mixed_epilogue(
        out_partial: T.Tensor([batch, num_qo_heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, num_qo_heads, num_splits], T.float32),
        signs: T.Tensor([num_qo_heads // group_size, D], T.float32),
        fp8_out: T.Tensor(fp8_out_shape, fp8_out_dtype),
        fp8_lse: T.Tensor(fp8_lse_shape, T.float32),
        out: T.Tensor([batch, num_qo_heads, D], dtype),
        lse: T.Tensor([batch, num_qo_heads], T.float32),
    ):
        with T.Kernel(num_qo_heads, batch, threads=THREADS) as (h, b):
            tid = T.get_thread_binding()
            d = tid % D
            w_s = T.alloc_shared([MAX_SPLITS], T.float32)
            red_s = T.alloc_shared([2, THREADS // 32], T.float32)
            part_s = T.alloc_shared([THREADS // D, D], T.float32)
            buf = T.alloc_shared([2, THREADS], T.float32)
            w8_s = T.alloc_shared([MAX_SPLITS if fp8_splits else 1], T.float32)
            part8_s = T.alloc_shared([THREADS // D if fp8_splits else 1, D], T.float32)
            x = T.alloc_local([1], T.float32)
            lse_t = T.alloc_local([1], T.float32)
            x_f = T.alloc_local([1], T.float32)
            lse_f = T.alloc_local([1], T.float32)
            if fp8_splits:  # both formats' splits in one pass: x, x_f are their shares of the output
                _combine_splits(out_partial, lse_partial, b, h, tid, D, x, lse_t, w_s, red_s, part_s, (fp8_out, fp8_lse, x_f, w8_s, part8_s))
            else:
                _combine_splits(out_partial, lse_partial, b, h, tid, D, x, lse_t, w_s, red_s, part_s)
            _fwht_threads(x, buf, tid, log_d)  # butterflies of distance < D stay in the group of tid
            x[0] = x[0] * T.float32(inv_sqrt_d) * signs[h // G, d]
            if tid < D:
                if fp8_state == "none":
                    out[b, h, d] = T.Cast(dtype, x[0])
                    if d == 0:
                        lse[b, h] = lse_t[0]
                elif fp8_splits:  # x and x_f are shares of one combine: their sum is the output
                    out[b, h, d] = T.Cast(dtype, x[0] + x_f[0])
                    if d == 0:
                        lse[b, h] = lse_t[0]
                else:
                    x_f[0] = T.Cast(T.float32, fp8_out[b, h, d])
                    lse_f[0] = fp8_lse[b, h]
                    top = T.max(lse_t[0], lse_f[0])
                    w_t = T.if_then_else(lse_t[0] > neg_inf, T.exp2(lse_t[0] - top), T.float32(0))
                    w_f = T.if_then_else(lse_f[0] > neg_inf, T.exp2(lse_f[0] - top), T.float32(0))
                    out[b, h, d] = T.Cast(dtype, (w_t * x[0] + w_f * x_f[0]) / (w_t + w_f))
                    if d == 0:
                        lse[b, h] = top + T.log2(w_t + w_f)

    return mixed_epilogue
