"""``mixed_decode_kernel``: both formats' split partials in one TileLang grid, the default mixed
decode. The split body and its FP8 role are in split_decode.py; ``heuristics.fused_build_of`` picks
its build and ``heuristics.choose_mixed_splits`` shares the grid between the formats.
"""

import tilelang

from .heuristics import FP8_STEP_CHUNKS, STEP_CHUNKS, WARPS
from .split_decode import split_decode


@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})
def mixed_decode_kernel(
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    centroids: tuple[float, ...],
    q_dtype: str = "bfloat16",
    *,
    min_blocks: int = 1,
    warps: int = WARPS,
    stages: int = 2,
    step_chunks: int = STEP_CHUNKS,
    shift_by_imad: bool = False,
    key_center: bool = False,
    fp8_step_chunks: int = FP8_STEP_CHUNKS,
):
    """Both formats' split partials in one launch: CTAs (split < num_splits, kv head, request) run the
    TQ3 decode over the TQ3 pages (rotated fp16 queries), the next num_fp8_splits CTAs of each (kv
    head, request) the same loop over the FP8 pages of SGLang's e4m3 pool (the queries as given), with
    e4m3 pairs converted to fp16 operands in registers (``device_source.fp8_device_source``). One
    grid, one register and shared-memory budget for both: the two roles' CTAs share the SMs instead
    of taking turns.

    Shapes as ``tq3_decode_kernel``'s, plus: q8_words [batch, H*G, D/2] int32 (the queries, ``q_dtype``
    pairs); k_pool / v_pool [num_fp8_pages, page_size, H, D] uint8 (e4m3); fp8_indptr [batch+1],
    fp8_ids [fp8_nnz], fp8_last_len [batch] int32 (tokens in each request's last FP8 page); k_scale,
    v_scale fp32 -> fp8_out_partial [batch, H*G, num_fp8_splits, D] fp32, fp8_lse_partial [batch, H*G,
    num_fp8_splits] (base 2). A split without tokens writes out = 0, lse = -inf. ``key_center``: the
    TQ3 pages' keys are page-centered (``split_decode``).
    """
    return split_decode(
        num_kv_heads, group_size, head_dim, page_size, sm_scale, centroids,
        min_blocks=min_blocks, warps=warps, stages=stages, step_chunks=step_chunks, shift_by_imad=shift_by_imad,
        fp8_step_chunks=fp8_step_chunks, q_dtype=q_dtype, key_center=key_center,
    )
