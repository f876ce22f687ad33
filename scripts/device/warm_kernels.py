"""Compile every kernel the GPU tests and the benchmark use, in parallel, before they run.

TileLang kernels (nvcc) and FlashInfer's JIT modules each take seconds to tens of seconds to build;
built one after another inside the tests they would eat most of a device call. Threads overlap the
nvcc/ninja subprocesses on the device's CPU cores; the caches they fill (~/.tilelang, ~/.cache/flashinfer)
serve the tests and the benchmark that follow in the same call. ``--serving``: only the decode
kernels ``--attention-backend minima`` builds for the device e2e suite's models; ``--tests``: only
those of test/gpu/test_kernels.py (its geometries, conversions included).
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# the harness's environment (env.sh) points the kernel caches where its servers read them and puts the
# bundle's packages on the path; run without it (2026-12-05: "No module named 'flashinfer'") nothing is
# built, or it is built where no server looks
if not {"FLASHINFER_WORKSPACE_BASE", "TILELANG_CACHE_DIR"} <= os.environ.keys():
    sys.exit("warm_kernels.py: run `. scripts/device/env.sh` first (run_suite.sh does): its FLASHINFER_WORKSPACE_BASE "
             "and TILELANG_CACHE_DIR are the caches the servers read")

import flashinfer  # noqa: E402
import torch
from minima_kernels import PageConversions, tile_config, tq3_decode_kernel, tq3_merge_splits
from minima_kernels.common import key_centroids_fp16
from minima_kernels.fp8_decode import fp8_decode_kernel
from minima_kernels.heuristics import fp8_tile_config, fused_build_of
from minima_kernels.mixed_decode import mixed_decode_kernel
from minima_kernels.rotation_merge import FP8_STATES, mixed_epilogue_kernel, rotate_queries_kernel

TEST_GEOMETRIES = [(24, 4, 256, 64), (32, 8, 128, 32), (9, 3, 64, 16)]
BENCH_GEOMETRIES = [(24, 4, 256, 64), (32, 8, 128, 64), (9, 3, 64, 64)]
# the device e2e suite's models at the launcher's page size: SmolLM2-135M, Llama-3-8B-class, Qwen3.6-class
SERVING_GEOMETRIES = [(9, 3, 64, 64), (32, 8, 128, 64), (24, 4, 256, 64)]


def unique(builds: list[dict]) -> list[dict]:
    """Each build once, in order."""
    return [b for i, b in enumerate(builds) if b not in builds[:i]]


def library_tq3_builds(g: int, p: int, d: int) -> list[dict]:
    """The TQ3 decode builds MinimaDecodeWrapper takes: for batches and for a single request."""
    return [tile_config(g, p, d), tile_config(g, p, d, 1)]


def tilelang_jobs(decode_only: bool, geometries=None):
    """All kernels of the tests and the benchmark (``geometries``: only these, e.g. TEST_GEOMETRIES
    for the GPU tests alone); with decode_only, those of the decode tests and the decode benchmark
    (no conversions: the benchmark encodes its TQ3 pools with the torch codec)."""
    for hq, h, d, p in sorted(set(geometries or TEST_GEOMETRIES + BENCH_GEOMETRIES)):
        g = hq // h
        # the batch build, the single-request one, test_mixed_decode_with_another_tq3_build's (each once)
        builds = library_tq3_builds(g, p, d)
        if (hq, h, d, p) in TEST_GEOMETRIES:
            builds += [{**tile_config(g, p, d), **other} for other in ({"warps": 4, "min_blocks": 2}, {"warps": 8, "min_blocks": 1})]
        for build in unique(builds):
            yield (
                f"tq3_decode {hq}/{h}/{d}/p{p} {build}",
                lambda h=h, g=g, d=d, p=p, build=build: tq3_decode_kernel(h, g, d, p, d**-0.5, key_centroids_fp16(d), **build),
            )
        # fp8_kernel="fused": the library's builds with the FP8 role (fp16 queries: one GPU test)
        for build in unique(library_tq3_builds(g, p, d)):
            for dtype in ("bfloat16", "float16") if (hq, h, d, p) in TEST_GEOMETRIES else ("bfloat16",):
                yield (
                    f"mixed_decode {hq}/{h}/{d}/p{p} {dtype} {build}",
                    lambda h=h, g=g, d=d, p=p, b=fused_build_of(build, p), dtype=dtype: mixed_decode_kernel(
                        h, g, d, p, d**-0.5, key_centroids_fp16(d), dtype, **b
                    ),
                )
        yield f"merge {hq}/{d}", lambda hq=hq, d=d: tq3_merge_splits(hq, d)
        yield f"rotate q {hq}/{h}/{d}", lambda hq=hq, g=g, d=d: rotate_queries_kernel(hq, g, d, "bfloat16")
        for state in FP8_STATES:
            yield (
                f"epilogue {hq}/{h}/{d} fp8={state}",
                lambda hq=hq, g=g, d=d, s=state: mixed_epilogue_kernel(hq, g, d, s, "bfloat16"),
            )
        if (hq, h, d, p) in TEST_GEOMETRIES:  # the fp16-query fused test's wrapper builds its glue for fp16
            yield f"rotate q {hq}/{h}/{d} fp16", lambda hq=hq, g=g, d=d: rotate_queries_kernel(hq, g, d, "float16")
            for state in FP8_STATES:
                yield (
                    f"epilogue {hq}/{h}/{d} fp8={state} fp16",
                    lambda hq=hq, g=g, d=d, s=state: mixed_epilogue_kernel(hq, g, d, s, "float16"),
                )
        for pages in (1, 2) if d <= 128 else (1,):
            yield (
                f"fp8 decode {hq}/{h}/{d}/p{p} pages_per_step={pages}",
                lambda h=h, g=g, d=d, p=p, pages=pages: fp8_decode_kernel(
                    h, g, d, p, d**-0.5, "bfloat16", **{**fp8_tile_config(p), "pages_per_step": pages}
                ),
            )
        if not decode_only:
            # the conversions as the memory system builds them (PageConversions holds their constants), both key widths
            for bits in (3, 4):
                conv = lambda h=h, p=p, d=d, bits=bits: PageConversions(h, p, d, bits)  # noqa: E731
                yield f"fp8_to_tq3 {h}/{d}/p{p} k{bits}", lambda conv=conv: conv().encode_kernel
                yield f"tq3_to_fp8 {h}/{d}/p{p} k{bits}", lambda conv=conv: conv().decode_kernel
                yield f"tq3 tile {h}/{d}/p{p} k{bits}", lambda conv=conv: conv().dequant_kernel


def variant_jobs():
    sys.path.insert(0, "benchmark/kernels")
    from bench_decode import TQ3_VARIANTS, tq3_variant_kernel, variant_build

    for hq, h, d, p in BENCH_GEOMETRIES:
        # each build once; the library's (batch and single request) come from tilelang_jobs in a full warm-up
        made = [] if "--variants-only" in sys.argv else library_tq3_builds(hq // h, p, d)
        for name in TQ3_VARIANTS:
            build = variant_build(d, name)
            if build in made:
                continue
            made.append(build)
            yield (
                f"tq3 variant {name} {hq}/{h}/{d}",
                lambda hq=hq, h=h, d=d, name=name: tq3_variant_kernel(hq, h, d, name),
            )


def flashinfer_jobs(geometries=BENCH_GEOMETRIES):
    """FlashInfer's decode modules (JIT): FP8 and bf16 KV, with and without tensor cores."""
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for hq, h, d, _ in geometries:
        for dtype, tensor_cores in ((torch.float8_e4m3fn, True), (torch.bfloat16, True), (torch.float8_e4m3fn, False)):

            def build(hq=hq, h=h, d=d, dtype=dtype, tensor_cores=tensor_cores):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
                indptr = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
                w.plan(
                    indptr,
                    torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                    torch.tensor([3], dtype=torch.int32, device="cuda"),
                    hq,
                    h,
                    d,
                    16,
                    q_data_type=torch.bfloat16,
                    kv_data_type=dtype,
                )
                kv = torch.randn(2, 16, h, d, device="cuda").to(dtype)
                w.run(torch.randn(1, hq, d, device="cuda").to(torch.bfloat16), (kv, kv), return_lse=True)
                torch.cuda.synchronize()

            yield f"flashinfer {hq}/{h}/{d} {dtype} tensor_cores={tensor_cores}", build


def serving_jobs(geometries=SERVING_GEOMETRIES, key_bits=None, key_center=(False,)):
    """The kernels a server builds for the device e2e suite's models, for each of ``key_bits``
    (``--minima-key-bits``; default: the launcher's) and of ``key_center`` (``--minima-key-center``):
    the decode kernels (``MinimaDecodeWrapper.compile``, as ``--attention-backend minima`` does), the
    pool's conversions and the prefill (its FlashInfer modules and TQ3 tile decoder), so its servers
    find them built."""
    from minima_kernels import MinimaDecodeWrapper
    from sglang_minima.config import MinimaConfig

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for hq, h, d, p in geometries:
        for bits, center in ((b, c) for b in key_bits or (MinimaConfig().key_bits,) for c in key_center):
            fmt = f"k{bits}{'c' if center else ''}"
            yield (
                f"serving decode {hq}/{h}/{d}/p{p} {fmt}",
                lambda hq=hq, h=h, d=d, p=p, bits=bits, center=center: MinimaDecodeWrapper(
                    workspace, hq, h, d, p, sm_scale=d**-0.5, key_bits=bits, key_center=center
                ).compile(),
            )
            # the pool's FP8 <-> TQ3 conversions (mem_cache/kernel_conversions.py), built when a server's pool is made
            conv = lambda h=h, d=d, p=p, bits=bits, center=center: PageConversions(h, p, d, bits, center)  # noqa: E731
            yield f"serving retier {h}/{d}/p{p} {fmt}", lambda conv=conv: conv().encode_kernel
            yield f"serving promote {h}/{d}/p{p} {fmt}", lambda conv=conv: conv().decode_kernel
            # the extend path: its FlashInfer modules (JIT: ragged bf16 auto and fa2, paged FP8) and the TQ3 tile
            yield (
                f"serving prefill {hq}/{h}/{d}/p{p} {fmt}",
                lambda hq=hq, h=h, d=d, p=p, bits=bits, center=center: warm_prefill(workspace, hq, h, d, p, bits, center),
            )


def warm_prefill(workspace: torch.Tensor, hq: int, h: int, d: int, p: int, key_bits: int, key_center: bool = False) -> None:
    """One tiny extend over a hot prefix and a TQ3 page through MinimaPrefillWrapper: FlashInfer
    compiles (or loads) the modules a server's first prompts would otherwise wait for (ragged bf16,
    paged FP8, the TQ3 tile's ragged bf16 HND, the in-place merge), and the TQ3 tile decoder is built."""
    from minima_kernels.prefill import MinimaPrefillWrapper, Tq3Segment
    from sglang_minima.codec.layout import TQ3PageLayout
    from sglang_minima.codec.rotation import LayerRotation

    w = MinimaPrefillWrapper(workspace, hq, h, d, p, sm_scale=d**-0.5, key_bits=key_bits, key_center=key_center)  # builds its TQ3 tile decoder
    i32 = dict(dtype=torch.int32)
    page = torch.ones(1, dtype=torch.int64, device="cuda")
    w.plan(torch.tensor([0, 2], **i32), torch.tensor([0, 3], **i32), torch.arange(3, device="cuda", **i32), None,
           (Tq3Segment(0, 2, page),))
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    hot = torch.randn(4, 1, h, d, **bf16).to(torch.float8_e4m3fn)
    tq3 = torch.zeros(2, TQ3PageLayout(h, p, d, key_bits, key_center).page_bytes, dtype=torch.uint8, device="cuda")
    w.run(torch.randn(2, hq, d, **bf16), torch.randn(2, h, d, **bf16), torch.randn(2, h, d, **bf16), (hot, hot),
          tq3, None, None, LayerRotation(h, d, layer_id=0, device="cuda"), k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()


def main() -> int:
    t0 = time.time()
    if "--serving" in sys.argv:
        # --geometries HQ/H/D/P,...: only these (e.g. 9/3/64/64, SmolLM2's), with the FlashInfer decode
        # modules SGLang's own FP8 arm loads, so both kinds of server start warm; --key-bits 3,4: the
        # builds of each key width (default: the launcher's, --minima-key-bits); --key-center: each also
        # page-centered (--minima-key-center)
        bits = None  # the launcher's default
        if "--key-bits" in sys.argv:
            bits = tuple(int(b) for b in sys.argv[sys.argv.index("--key-bits") + 1].split(","))
        center = (False, True) if "--key-center" in sys.argv else (False,)
        if "--geometries" in sys.argv:
            spec = sys.argv[sys.argv.index("--geometries") + 1]
            geometries = [tuple(int(x) for x in g.split("/")) for g in spec.split(",")]
            jobs = list(serving_jobs(geometries, bits, center)) + list(flashinfer_jobs(geometries))
        else:
            jobs = list(serving_jobs(key_bits=bits, key_center=center))
    elif "--tests" in sys.argv:  # test/gpu/test_kernels.py's kernels alone (no benchmark builds)
        jobs = list(tilelang_jobs(False, TEST_GEOMETRIES)) + list(flashinfer_jobs(TEST_GEOMETRIES))
    elif "--variants-only" in sys.argv:  # for bench_decode.py --variants-only
        jobs = list(variant_jobs())
    else:
        jobs = list(variant_jobs()) + list(tilelang_jobs("--decode-only" in sys.argv)) + list(flashinfer_jobs())
    failed = 0
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = {name: pool.submit(fn) for name, fn in jobs}
        for name, fut in futures.items():
            try:
                fut.result()
                print(f"built {name}  (t={time.time() - t0:.0f}s)", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on: the tests show the failure too
                failed += 1
                print(f"FAILED {name}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
    print(f"warm: {len(jobs) - failed}/{len(jobs)} built in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
