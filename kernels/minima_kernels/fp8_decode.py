"""FP8 paged split-KV decode attention in TileLang: the FP8 pages' part of the mixed decode as split
partials, for the epilogue that already combines the TQ3 splits.

FlashInfer's decode over the FP8 pages costs 60-100% of its decode over the whole context at batch
1-8 (its own split-KV plan, a merge launch, a fixed cost per call: docs/results/kernels.md), so at small
batch the FP8 part, not the TQ3 part, sets the mixed decode's time. This kernel writes its splits'
(out, LSE) next to the TQ3 kernel's and leaves the combine to the one epilogue: no second merge launch.

One CTA = (split, kv head, request), the pattern of TileLang's GQA flash-decoding example: the G query
heads of the group padded to one 16-row MMA tile; per page, TMA copies the e4m3 K and V tiles
(SGLang's ``[pages, page_size, H, D]`` pool, one kv head; TileLang pipelines them in a producer warp
group), the consumer warps convert them to fp16 in shared memory and run two tensor-core GEMMs with an
online base-2 softmax between them. The per-layer scales are folded in: k_scale into the score scale,
v_scale into the output. q is rounded to fp16 (exact for bf16 values of magnitude 6e-5 to 65504; fp16
rather than bf16 keeps 3 more bits of the probabilities in GEMM 2).
"""

import tilelang
import tilelang.language as T

from .common import FP8_HEADS_PER_TILE as HEADS_PER_TILE
from .common import LOG2E, TWO_PAGE_STEP_MAX_HEAD_DIM

FP8_BUILD_OPTIONS = ("threads", "stages", "pages_per_step")  # fp8_decode_kernel's; heuristics.fp8_tile_config picks them


@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})
def fp8_decode_kernel(
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    dtype: str = "bfloat16",
    *,
    threads: int = 128,
    stages: int = 2,
    pages_per_step: int = 1,
):
    """Partial decode over FP8 pages. Shapes (dynamic: batch, num_pages, nnz, num_splits): q [batch,
    H*G, D] (``dtype``); k_pool / v_pool [num_pages, page_size, H, D] e4m3; page_indptr [batch+1],
    page_ids [nnz], last_page_len [batch] int32; k_scale, v_scale fp32 scalars -> out_partial [batch,
    H*G, num_splits, D] fp32, lse_partial [batch, H*G, num_splits] fp32 (base 2). A split without pages
    writes out = 0, lse = -inf. Requests may have no FP8 page (all their splits empty).
    ``pages_per_step``: pages per pipeline step (one score tile of pages_per_step x page_size tokens):
    fewer steps per split, each with one softmax update and two GEMMs over more tokens. page_ids must
    then hold pages_per_step - 1 valid page ids past its end (``MinimaDecodeWrapper.plan`` pads it)."""
    H, G, D, P = num_kv_heads, group_size, head_dim, page_size
    if pages_per_step not in (1, 2):
        raise ValueError(f"pages_per_step={pages_per_step}: 1 or 2")
    if pages_per_step > 1 and head_dim > TWO_PAGE_STEP_MAX_HEAD_DIM:
        raise ValueError(f"pages_per_step={pages_per_step}: built and tested for head dims up to {TWO_PAGE_STEP_MAX_HEAD_DIM}, got {head_dim}")
    if G > HEADS_PER_TILE:
        raise ValueError(f"group_size={G}: the FP8 decode puts at most {HEADS_PER_TILE} query heads in a tile")
    M = HEADS_PER_TILE
    S = pages_per_step
    N = P * S  # tokens per step
    heads = H * G
    scale = sm_scale * LOG2E
    neg_inf = -T.infinity(T.float32)
    batch, num_pages, nnz, num_splits = T.dynamic("batch, num_pages, nnz, num_splits")

    @T.prim_func
    def fp8_decode(
        q: T.Tensor([batch, heads, D], dtype),
        k_pool: T.Tensor([num_pages, P, H, D], T.float8_e4m3fn),
        v_pool: T.Tensor([num_pages, P, H, D], T.float8_e4m3fn),
        page_indptr: T.Tensor([batch + 1], T.int32),
        page_ids: T.Tensor([nnz], T.int32),
        last_page_len: T.Tensor([batch], T.int32),
        k_scale: T.float32,
        v_scale: T.float32,
        out_partial: T.Tensor([batch, heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, heads, num_splits], T.float32),
    ):
        with T.Kernel(num_splits, H, batch, threads=threads) as (sid, hk, bid):
            q_s = T.alloc_shared([M, D], T.float16)
            k8_s = T.alloc_shared([N, D], T.float8_e4m3fn)
            v8_s = T.alloc_shared([N, D], T.float8_e4m3fn)
            k_s = T.alloc_shared([N, D], T.float16)
            v_s = T.alloc_shared([N, D], T.float16)
            p_s = T.alloc_shared([M, N], T.float16)  # the warps split the tokens in GEMM 1, the dims in GEMM 2
            acc_s = T.alloc_fragment([M, N], T.float32)
            acc_o = T.alloc_fragment([M, D], T.float32)
            m_i = T.alloc_fragment([M], T.float32)
            m_prev = T.alloc_fragment([M], T.float32)
            alpha = T.alloc_fragment([M], T.float32)
            l_step = T.alloc_fragment([M], T.float32)
            l_i = T.alloc_fragment([M], T.float32)

            first = page_indptr[bid]
            n_pages = page_indptr[bid + 1] - first
            per_split = T.ceildiv(n_pages, num_splits)
            p_lo = T.min(sid * per_split, n_pages)
            p_hi = T.min(p_lo + per_split, n_pages)
            # tokens a step may attend: the request's (its last page holds last_page_len of them) and,
            # with several pages per step, the split's (a step's pages past the split's last one are
            # read, from the padded page list, and masked out)
            if S == 1:
                n_tokens = (n_pages - 1) * P + last_page_len[bid]
            else:
                n_tokens = T.min((n_pages - 1) * P + last_page_len[bid], p_hi * P)
            score_scale = k_scale * T.float32(scale)

            for i, d in T.Parallel(M, D):
                q_s[i, d] = T.if_then_else(i < G, T.Cast(T.float16, q[bid, hk * G + T.min(i, G - 1), d]), T.float16(0))
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, neg_inf)
            for it in T.Pipelined(p_hi - p_lo if S == 1 else T.ceildiv(p_hi - p_lo, S), num_stages=stages):
                # the page id inline in the copy (not bound to a name first): TileLang then pipelines
                # the copies (TMA, a producer warp group) ahead of the GEMMs; written out per page (a
                # T.unroll loop around them loses the TMA pipeline)
                if S == 1:
                    T.copy(k_pool[page_ids[first + p_lo + it], 0:P, hk, 0:D], k8_s)
                    T.copy(v_pool[page_ids[first + p_lo + it], 0:P, hk, 0:D], v8_s)
                else:
                    T.copy(k_pool[page_ids[first + p_lo + it * S], 0:P, hk, 0:D], k8_s[0:P, 0:D])
                    T.copy(v_pool[page_ids[first + p_lo + it * S], 0:P, hk, 0:D], v8_s[0:P, 0:D])
                    T.copy(k_pool[page_ids[first + p_lo + it * S + 1], 0:P, hk, 0:D], k8_s[P : 2 * P, 0:D])
                    T.copy(v_pool[page_ids[first + p_lo + it * S + 1], 0:P, hk, 0:D], v8_s[P : 2 * P, 0:D])
                # tokens past the request's last one get score -inf and a zero value row (a free
                # slot's bytes may be e4m3 NaN, and 0 * NaN is NaN)
                for j, d in T.Parallel(N, D):
                    k_s[j, d] = T.Cast(T.float16, k8_s[j, d])
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(M, N):
                    acc_s[i, j] = T.if_then_else((p_lo + it * S) * P + j < n_tokens, acc_s[i, j] * score_scale, neg_inf)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(M):
                    alpha[i] = T.exp2(m_prev[i] - m_i[i])
                for i, j in T.Parallel(M, N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m_i[i])
                T.reduce_sum(acc_s, l_step, dim=1)
                for i in T.Parallel(M):
                    l_i[i] = l_i[i] * alpha[i] + l_step[i]
                T.copy(acc_s, p_s)
                for i, d in T.Parallel(M, D):
                    acc_o[i, d] *= alpha[i]
                for j, d in T.Parallel(N, D):
                    v_s[j, d] = T.if_then_else((p_lo + it * S) * P + j < n_tokens, T.Cast(T.float16, v8_s[j, d]), T.float16(0))
                T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(M, D):
                if i < G:
                    out_partial[bid, hk * G + i, sid, d] = T.if_then_else(l_i[i] > 0, acc_o[i, d] * v_scale / l_i[i], T.float32(0))
            for i in T.Parallel(M):
                if i < G:
                    lse_partial[bid, hk * G + i, sid] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i], neg_inf)

    return fp8_decode
