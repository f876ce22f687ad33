"""Compile-only check of every minima_kernels kernel for sm_90a, on a machine without a GPU.

TileLang lowers and nvcc compiles CUDA for {"kind": "cuda", "arch": "sm_90a"} here, so shape or
layout errors surface before any device time is spent. Skipped where tilelang or nvcc is missing
(CI installs neither: they are the GPU extra).
"""

import math
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

SM90A = {"kind": "cuda", "arch": "sm_90a"}
GEOMETRIES = [(24, 4, 256, 64), (32, 8, 128, 32), (9, 3, 64, 16)]


def _compile(jit_fn, *args, **kwargs) -> str:
    tir = jit_fn.get_tir(*args, **kwargs)
    kernel = tilelang.compile(tir, target=SM90A, execution_backend="tvm_ffi", pass_configs=jit_fn.pass_configs)
    return kernel.get_kernel_source()


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_tq3_decode_compiles_pipelined(hq: int, h: int, d: int, p: int) -> None:
    from minima_kernels import tile_config, tq3_decode_kernel, tq3_merge_splits
    from minima_kernels.decode import key_centroids_fp16

    g = hq // h
    src = _compile(tq3_decode_kernel, h, g, d, p, d**-0.5, key_centroids_fp16(d), **tile_config(g, p))
    assert "cp_async" in src  # codes and metadata copied global -> shared asynchronously
    assert "__launch_bounds__(128, 2)" in src
    assert "mma_sync" in src and "__byte_perm" in src
    _compile(tq3_merge_splits, hq, d)


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_conversions_compile_without_contraction(hq: int, h: int, d: int, p: int) -> None:
    import torch
    from minima_kernels import fp8_to_tq3_kernel, tq3_to_fp8_kernel
    from sglang_minima.codec import tq3_codebook

    book = tq3_codebook(d)
    cent = tuple(float(c) for c in book.centroids)
    thr = tuple(float(t) for t in book.thresholds)
    inv = float(torch.tensor(1 / math.sqrt(d), dtype=torch.float32))
    sqrt_d = float(torch.tensor(math.sqrt(d), dtype=torch.float32))
    fwd = _compile(fp8_to_tq3_kernel, h, p, d, cent, thr, inv, sqrt_d)
    bwd = _compile(tq3_to_fp8_kernel, h, p, d, cent, inv)
    for src in (fwd, bwd):
        assert "__fmaf" not in src and "fmaf(" not in src
