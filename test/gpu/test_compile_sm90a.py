"""Compile-only check of every minima_kernels kernel for sm_90a, on a machine without a GPU.

TileLang lowers and nvcc compiles CUDA for {"kind": "cuda", "arch": "sm_90a"} here, so shape or
layout errors surface before any device time is spent. Skipped where tilelang or nvcc is missing
(CI installs neither: they are the GPU extra).
"""

import collections
import math
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")
pytest.importorskip("flashinfer")  # minima_kernels imports it: both come with the gpu extra
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

SM90A = {"kind": "cuda", "arch": "sm_90a"}
GEOMETRIES = [(24, 4, 256, 64), (32, 8, 128, 32), (9, 3, 64, 16)]


def _compile(jit_fn, *args, **kwargs) -> str:
    tir = jit_fn.get_tir(*args, **kwargs)
    kernel = tilelang.compile(tir, target=SM90A, execution_backend="tvm_ffi", pass_configs=jit_fn.pass_configs)
    return kernel.get_kernel_source()


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_tq3_decode_compiles_streaming(hq: int, h: int, d: int, p: int) -> None:
    from minima_kernels import tile_config, tq3_decode_kernel, tq3_merge_splits
    from minima_kernels.common import key_centroids_fp16
    from minima_kernels.fp8_decode import fp8_decode_kernel
    from minima_kernels.heuristics import fp8_tile_config
    from minima_kernels.rotation_merge import FP8_STATES, mixed_epilogue_kernel, rotate_queries_kernel

    g = hq // h
    config = tile_config(g, p, d)
    src = _compile(tq3_decode_kernel, h, g, d, p, d**-0.5, key_centroids_fp16(d), **config)
    assert f"__launch_bounds__({32 * config['warps']}, {config['min_blocks']})" in src
    # each lane streams its own code words through the warp's cp.async ring (4/8/16-byte pieces for
    # D = 64/128/256), decodes them with the magic-number helpers, and both GEMMs are warp-level
    # mma.sync with movmatrix in between
    assert f"minima::copy_chunk<{d // 16}," in src and "minima::cp_async_wait<" in src
    assert "minima::tq3_keys" in src and "minima::tq3_values" in src and "minima::transpose8x8" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    _compile(rotate_queries_kernel, hq, g, d, "bfloat16")
    for state in FP8_STATES:
        _compile(mixed_epilogue_kernel, hq, g, d, state, "bfloat16")
    _compile(tq3_merge_splits, hq, d)
    # the FP8 decode: its page copies pipelined by TMA (TileLang's warp-specialized producer)
    src = _compile(fp8_decode_kernel, h, g, d, p, d**-0.5, "bfloat16", **fp8_tile_config(p))
    assert src.count("tl::tma_load(") == 2
    if d <= 128:  # two pages per step: four TMA loads, still pipelined
        src = _compile(fp8_decode_kernel, h, g, d, p, d**-0.5, "bfloat16", **{**fp8_tile_config(p), "pages_per_step": 2})
        assert src.count("tl::tma_load(") == 4


@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("batch", [None, 1], ids=["batch", "one-request"])
@pytest.mark.parametrize("hq,h,d", [(24, 4, 256), (32, 8, 128), (9, 3, 64)])
def test_tq3_decode_builds_for_every_page_size(hq: int, h: int, d: int, page: int, batch: int | None) -> None:
    # tile_config's steps fit every supported page size: whole pages per step or steps per page
    # (the kernel refuses warps x step_chunks that is not a multiple of the chunks per page), for
    # batches and for a single request (8 warps per SM at head dims 256 and 64)
    from minima_kernels import tile_config, tq3_decode_kernel
    from minima_kernels.common import key_centroids_fp16

    config = tile_config(hq // h, page, d, batch)
    src = _compile(tq3_decode_kernel, h, hq // h, d, page, d**-0.5, key_centroids_fp16(d), **config)
    assert "minima::copy_chunk<" in src
    assert f"__launch_bounds__({32 * config['warps']}, {config['min_blocks']})" in src
    if batch == 1 and d != 128:
        assert config["warps"] * config["min_blocks"] == 8
    # the same build with the FP8 role (fp8_kernel="fused"): its chunk copy and fragment loads, and the
    # FP8 ring's steps also fit every page size
    from minima_kernels.heuristics import fused_build_of
    from minima_kernels.mixed_decode import mixed_decode_kernel

    src = _compile(mixed_decode_kernel, h, hq // h, d, page, d**-0.5, key_centroids_fp16(d), "float16", **fused_build_of(config, page))
    assert "minima::copy_fp8_chunk(" in src and "minima::fp8_keys(" in src and "minima::fp8_values(" in src
    assert "minima::bf16x2_to_half2(" not in src.split("namespace minima")[-1]  # fp16 queries go in as they are
    assert f"__launch_bounds__({32 * config['warps']}, {config['min_blocks']})" in src


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("hq,h,d", [(24, 4, 256), (32, 8, 128), (9, 3, 64)])
def test_decodes_build_for_4bit_keys(hq: int, h: int, d: int, page: int) -> None:
    # --minima-key-bits 4: a 16-centroid codebook builds the 256-entry key table, key lane streams of
    # four pieces and the key/value copy with both offsets; the value path is the 3-bit one
    from minima_kernels import tile_config, tq3_decode_kernel
    from minima_kernels.common import key_centroids_fp16
    from minima_kernels.heuristics import fused_build_of
    from minima_kernels.mixed_decode import mixed_decode_kernel

    config, cents = tile_config(hq // h, page, d), key_centroids_fp16(d, 4)
    assert len(cents) == 16 and len(key_centroids_fp16(d)) == 8
    for src in (
        _compile(tq3_decode_kernel, h, hq // h, d, page, d**-0.5, cents, **config),
        _compile(mixed_decode_kernel, h, hq // h, d, page, d**-0.5, cents, "bfloat16", **fused_build_of(config, page)),
    ):
        body = src.split("namespace minima")[-1]
        assert f"minima::copy_chunk_kv<{d // 16}, 4, {4 * 32 * d // 16}>(" in body
        assert "minima::k4_keys(" in body and "minima::tq3_keys(" not in body and "minima::tq3_values(" in body
        assert "uint32_t table[8192]" in src  # 256 entries x 32 lane columns
    with pytest.raises(ValueError, match="8 \\(3-bit keys\\) or 16"):
        tq3_decode_kernel.get_tir(h, hq // h, d, page, d**-0.5, cents[:12], **config)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("hq,h,d", [(24, 4, 256), (32, 8, 128), (9, 3, 64)])
def test_decodes_build_for_page_centered_keys(hq: int, h: int, d: int, page: int) -> None:
    # --minima-key-center: each step's pages' mean keys come into the ring by one 16-byte cp.async per
    # lane of D/8, from the page's k_mean field (pages of 16 tokens: a step spans several)
    from minima_kernels import tile_config, tq3_decode_kernel
    from minima_kernels.common import key_centroids_fp16
    from minima_kernels.heuristics import fused_build_of
    from minima_kernels.mixed_decode import mixed_decode_kernel

    config, cents = tile_config(hq // h, page, d, None, 4, True), key_centroids_fp16(d, 4)
    for src in (
        _compile(tq3_decode_kernel, h, hq // h, d, page, d**-0.5, cents, key_center=True, **config),
        _compile(mixed_decode_kernel, h, hq // h, d, page, d**-0.5, cents, "bfloat16", key_center=True, **fused_build_of(config, page)),
    ):
        body = src.split("namespace minima")[-1]
        assert "minima::cp_async_to<16>(" in body and "minima::k4_keys(" in body
    plain = _compile(tq3_decode_kernel, h, hq // h, d, page, d**-0.5, cents, **tile_config(hq // h, page, d, None, 4))
    assert "minima::cp_async_to<16>(" not in plain.split("namespace minima")[-1]


def test_centered_conversion_refuses_a_page_size_it_cannot_halve() -> None:
    # pages of 48 tokens are valid TQ3 pages (the torch codec centers them, zero-padding its sum): the
    # kernel says why it does not, and the store converts such pages on the codec
    from minima_kernels.convert import _kernel_constants, fp8_to_tq3_kernel

    with pytest.raises(ValueError, match="page_size=48: the kernel sums a page's keys"):
        fp8_to_tq3_kernel.get_tir(4, 48, 64, *_kernel_constants(64, 4), key_center=True)
    fp8_to_tq3_kernel.get_tir(4, 48, 64, *_kernel_constants(64, 4))  # uncentered: no sum over the page


def test_tq3_decode_rejects_steps_that_straddle_pages() -> None:
    from minima_kernels import tq3_decode_kernel
    from minima_kernels.common import key_centroids_fp16

    with pytest.raises(ValueError, match="warps=3 x step_chunks=1"):
        tq3_decode_kernel.get_tir(4, 6, 256, 64, 256**-0.5, key_centroids_fp16(256), warps=3, step_chunks=1)


def test_two_page_steps_past_the_tested_head_dims_are_refused() -> None:
    from minima_kernels.fp8_decode import fp8_decode_kernel

    with pytest.raises(ValueError, match="pages_per_step=2"):
        fp8_decode_kernel(4, 6, 256, 64, 256**-0.5, "bfloat16", pages_per_step=2)


@pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True)])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_conversions_compile_without_contraction(hq: int, h: int, d: int, p: int, key_bits: int, key_center: bool) -> None:
    import torch
    from minima_kernels import fp8_to_tq3_kernel, tq3_to_fp8_kernel
    from sglang_minima.codec import key_codebook
    from sglang_minima.codec.rotation import fp32_inv_sqrt

    book = key_codebook(d, key_bits)
    cent = tuple(float(c) for c in book.centroids)
    thr = tuple(float(t) for t in book.thresholds)
    inv = fp32_inv_sqrt(d)
    sqrt_d = float(torch.tensor(math.sqrt(d), dtype=torch.float32))
    fwd = _compile(fp8_to_tq3_kernel, h, p, d, cent, thr, inv, sqrt_d, key_center=key_center)
    bwd = _compile(tq3_to_fp8_kernel, h, p, d, cent, inv, key_center=key_center)
    heads = _compile(tq3_to_fp8_kernel, h, p, d, cent, inv, key_center=key_center, output="bf16_heads")  # the prefill's TQ3 tile
    for src in (fwd, bwd, heads):
        assert "__fmaf" not in src and "fmaf(" not in src
    # the value min and max get + 0.0 (-0.0 -> +0.0) as an add TVM's simplifier cannot drop
    assert fwd.count("__fadd_rn(") == 2
    # page-centered keys: the mean is one IEEE division of the tokens' sum by the page size
    assert fwd.count("__fdiv_rn(") == int(key_center)


@pytest.mark.parametrize("hq,h,d", [(24, 4, 256), (32, 8, 128), (9, 3, 64)])
def test_decode_main_loop_sass(hq: int, h: int, d: int, tmp_path) -> None:
    # scripts/kernel_sass.py on the library build: no register spills, and one softmax step (two
    # 16-token chunks) per iteration costs 2 * D/16 MMAs per chunk (keys and values, one n8 tile of
    # heads) and D/4 key-table loads per chunk
    kernel_sass = _kernel_sass()
    if shutil.which("cuobjdump") is None and not _wheel_has("cuobjdump"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    cubin = kernel_sass.build_cubin(f"{hq}/{h}/{d}", 64, {}, tmp_path)
    usage = kernel_sass.cuobjdump(cubin, "-res-usage")
    assert "STACK:0" in usage and "LOCAL:0" in usage, usage
    (loop,) = kernel_sass.role_loops(kernel_sass.cuobjdump(cubin, "-sass"), 1)
    loop = [kernel_sass.opcode(t) for t in loop]
    from minima_kernels import tile_config

    chunks = tile_config(hq // h, 64, d)["step_chunks"]
    assert loop.count("HMMA") == chunks * 2 * d // 16
    assert loop.count("LDS") >= chunks * d // 4  # the key table, one load per code pair, plus the ring reads
    if d >= 128:  # page-centered keys: one more D/16 MMAs a step (its page's q'.m), no spills (the server's
        # 4-bit keys at 128; 3-bit keys at 256, whose 12-warp build spilled until tile_config capped it at 8)
        bits = 4 if d == 128 else 3
        (tmp_path / "center").mkdir()
        for center in (False, True):
            cubin = kernel_sass.build_cubin(f"{hq}/{h}/{d}", 64, {}, tmp_path / "center", key_bits=bits, key_center=center)
            usage = kernel_sass.cuobjdump(cubin, "-res-usage")
            assert "STACK:0" in usage and "LOCAL:0" in usage, usage
            (loop,) = kernel_sass.role_loops(kernel_sass.cuobjdump(cubin, "-sass"), 1)
            steps = tile_config(hq // h, 64, d, None, bits, center)["step_chunks"]
            assert [kernel_sass.opcode(t) for t in loop].count("HMMA") == steps * 2 * d // 16 + center * d // 16


@pytest.mark.parametrize("hq,h,d", [(24, 4, 256), (32, 8, 128), (9, 3, 64)])
def test_fused_decode_main_loops_sass(hq: int, h: int, d: int, tmp_path) -> None:
    # mixed_decode_kernel: no spills; its TQ3 role's step loop does the TQ3 decode's work (the same
    # MMAs, loads, exponentials; within 1% of its instructions); its FP8 role's has 2 * D/16 MMAs per chunk and converts the chunk's K and V bytes
    # with D/2 cvt.e4m3x2 (F2FP) per lane, fed by D/16 8-byte and D/8 4-byte ring loads
    kernel_sass = _kernel_sass()
    if shutil.which("cuobjdump") is None and not _wheel_has("cuobjdump"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from minima_kernels import tile_config
    from minima_kernels.heuristics import fused_build_of

    build = fused_build_of(tile_config(hq // h, 64, d), 64)
    cubin = kernel_sass.build_cubin(f"{hq}/{h}/{d}", 64, {"fp8_step_chunks": build["fp8_step_chunks"]}, tmp_path, fused=True)
    usage = kernel_sass.cuobjdump(cubin, "-res-usage")
    assert "STACK:0" in usage and "LOCAL:0" in usage, usage
    tq3, fp8 = kernel_sass.role_loops(kernel_sass.cuobjdump(cubin, "-sass"), 2)
    (tmp_path / "alone").mkdir()
    alone = kernel_sass.build_cubin(f"{hq}/{h}/{d}", 64, {}, tmp_path / "alone")
    (tq3_alone,) = kernel_sass.role_loops(kernel_sass.cuobjdump(alone, "-sass"), 1)
    mix = lambda loop: collections.Counter(kernel_sass.opcode(t) for t in loop if not t.startswith("@!PT"))  # noqa: E731
    fused_mix, alone_mix = mix(tq3), mix(tq3_alone)
    # registers and a few address instructions differ, not the work
    assert all(fused_mix[op] == alone_mix[op] for op in ("HMMA", "LDS", "LDGSTS", "MUFU", "HFMA2", "SHFL"))
    assert abs(sum(fused_mix.values()) - sum(alone_mix.values())) <= 0.01 * sum(alone_mix.values())
    ops = [kernel_sass.opcode(t) for t in fp8 if not t.startswith("@!PT")]  # (never-executed padding loads)
    chunks = build["fp8_step_chunks"]
    assert ops.count("HMMA") == chunks * 2 * d // 16
    assert ops.count("F2FP") >= chunks * d // 2
    assert ops.count("LDS") == chunks * (d // 16 + d // 8)


def _kernel_sass():
    """scripts/kernel_sass.py as a module."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "kernel_sass.py"
    spec = importlib.util.spec_from_file_location("kernel_sass", script)
    kernel_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_sass)
    return kernel_sass


def _wheel_has(tool: str) -> bool:
    try:
        import nvidia
    except ImportError:
        return False
    from pathlib import Path

    return any(any(Path(base).glob(f"cu*/bin/{tool}")) for base in nvidia.__path__)
