"""``tq3_decode_kernel``: the TQ3 pages' split partials (the two-launch path's TQ3 part). The split
body and how it decodes are in split_decode.py; ``tile_config`` (heuristics.py) picks its build.
"""

import tilelang

from .heuristics import STEP_CHUNKS, WARPS
from .split_decode import split_decode


# page ids come from the memory system's page tables and the CSR from plan(): no bounds guards on loads
@tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})
def tq3_decode_kernel(
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    centroids: tuple[float, ...],
    *,
    min_blocks: int = 1,
    warps: int = WARPS,
    stages: int = 2,
    step_chunks: int = STEP_CHUNKS,
    shift_by_imad: bool = False,
    key_center: bool = False,
):
    """Partial decode over TQ3 pages; the key codebook (``centroids``, ascending, fp16-rounded) is
    baked in and becomes the CTA's key table. ``step_chunks``: 16-token chunks per softmax step.

    Shapes (dynamic: batch, num_pages, nnz, num_splits): q_words [batch, H*G, D/2] int32 (rotated fp16
    queries viewed as words); the TQ3 pool [num_pages, page_bytes] seen as int32 words; page_indptr
    [batch+1] int32, page_ids [nnz] int32 -> out_partial [batch, H*G, num_splits, D] fp32, lse_partial
    [batch, H*G, num_splits] fp32 (base 2). ``key_center``: page-centered keys (each page's
    ``k_mean`` read, q'.m added to its scores: ``split_decode``).
    """
    return split_decode(
        num_kv_heads, group_size, head_dim, page_size, sm_scale, centroids,
        min_blocks=min_blocks, warps=warps, stages=stages, step_chunks=step_chunks, shift_by_imad=shift_by_imad,
        key_center=key_center,
    )
