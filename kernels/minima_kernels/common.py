"""What several kernels share: constants, kernel limits the plan must respect, and small helpers.

No tilelang import, so heuristics.py (and its CPU tests) can read the limits too.
"""

import torch
from sglang_minima.codec.codebook import key_codebook

LOG2E = 1.4426950408889634  # base-2 softmax: scores are scaled by sm_scale * log2(e)
# ``pass_configs`` of the kernels that must match the torch codec bit for bit: nvcc contracts no
# multiply-add (the key of tilelang.PassConfigKey.TL_DEVICE_COMPILE_FLAGS, spelled out)
EXACT_FP32 = {"tl.device_compile_flags": ["--fmad=false"]}
TQ3_HEADS_PER_TILE = 8  # the TQ3 / mixed decode's MMA N: query heads of a GQA group per tile
FP8_HEADS_PER_TILE = 16  # the TileLang FP8 decode's MMA M: the group's query heads, padded
MAX_SPLITS = 1024  # the split combine keeps one weight per split in shared memory (4 KB)
# the TileLang FP8 decode's 2-page steps: built and measured up to this head dim (head dim 256, page
# 64: more shared memory than an SM has)
TWO_PAGE_STEP_MAX_HEAD_DIM = 128


def log2_int(n: int) -> int:
    """log2 of a power-of-two head dim (the Hadamard path's stage count)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard path needs a power-of-two head_dim, got {n}")
    return n.bit_length() - 1


def key_bits_of(centroids) -> int:
    """The key code width a key codebook's size gives: 8 centroids, 3-bit keys; 16, 4-bit keys (the
    kernels take their width from the codebook they are built with)."""
    if len(centroids) not in (8, 16):
        raise ValueError(f"{len(centroids)} key centroids: 8 (3-bit keys) or 16 (4-bit keys)")
    return 4 if len(centroids) == 16 else 3


def key_centroids_fp16(head_dim: int, key_bits: int = 3) -> tuple[float, ...]:
    """The key codebook of ``key_bits``-bit Stale keys rounded to fp16 (the kernel's GEMM operand
    precision): 8 centroids, or 16 for 4-bit keys (the decode kernels read the width from the count)."""
    return tuple(float(c) for c in key_codebook(head_dim, key_bits).centroids.to(torch.float16).float())
