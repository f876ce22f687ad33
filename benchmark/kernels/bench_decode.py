"""Decode attention on the GPU: FlashInfer BF16, FlashInfer FP8 and Minima mixed FP8/TQ3, side by side.

For each geometry x batch x context x Stale fraction: median time per call (CUDA-graph replay when the
path captures, else events around eager calls; ``graph`` says which), KV bytes read, achieved TB/s
against the copy roofline, and Minima's speed-up over FlashInfer FP8. Also the TQ3 kernel alone
(split decode + combine) against the roofline on the bytes it reads, FlashInfer FP8 with token-granular
indices (page_size=1, SGLang's way) vs real pages, and conversion throughput (FP8 -> TQ3, TQ3 -> FP8).

    PYTHONPATH=kernels:python python benchmark/kernels/bench_decode.py --out results.json [--budget-s 300]

Runs in one device call: configurations are ordered by priority and the run stops adding new ones
once ``--budget-s`` is spent (the skipped ones are listed in the JSON).
"""

import argparse
import json
import math
import time
from functools import partial

import flashinfer
import torch
import triton.testing
from minima_kernels import (
    MinimaDecodeWrapper,
    choose_num_splits,
    fp8_to_tq3,
    tile_config,
    tq3_decode_kernel,
    tq3_to_fp8,
)
from minima_kernels.common import MAX_SPLITS, key_centroids_fp16
from minima_kernels.heuristics import (
    TILELANG_FP8_MAX_TOKENS,
    choose_mixed_splits,
    min_split_pages,
    one_wave_share,
    slots_per_pair,
    tilelang_fp8_preferred,
)
from render_decode import previous_ms
from wrapper_parts import run_fp8, run_glue, run_tq3
from sglang_minima.codec import LayerRotation, TQ3PageLayout, encode_pages, key_codebook
from sglang_minima.config import MinimaConfig

ROOFLINE_TBPS = 4.2
PAGE = 64
GEOMETRIES = {"24q/4kv/256": (24, 4, 256), "32q/8kv/128": (32, 8, 128), "9q/3kv/64": (9, 3, 64)}
BATCHES = (8, 32, 1)
CONTEXTS = (32768, 131072, 4096)
STALE = (0.75, 0.9, 0.5, 0.0)
MAX_POOL_BYTES = 48 << 30  # per config, all pools together
TQ3_BASE_PAGES = 2048  # distinct TQ3 pages made by the conversion kernel, tiled over the pool


def previous_fused_splits(slots: int, tq3_pages: int, fp8_pages: int, min_pages: int) -> tuple[int, int]:
    """The fused rule's splits before stop 56 at 2 resident slots a (request, kv head) or more:
    ``heuristics.one_wave_share`` by pages, each split at least ``min_pages`` pages."""
    share = one_wave_share(slots, tq3_pages, fp8_pages)
    return tuple(max(1, min(n, pages // min_pages)) for n, pages in zip(share, (tq3_pages, fp8_pages)))


def bench_ms(fn, graph: bool = True) -> tuple[float, bool]:
    """Median ms of fn(): CUDA-graph replay if fn captures, else eager events."""
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                fn()
                with torch.cuda.graph(g, stream=stream):
                    fn()
            torch.cuda.synchronize()
            return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median"), True
        except Exception:  # noqa: BLE001 - a path that cannot be captured is timed eagerly
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), False


def flashinfer_decode(
    workspace, q, k, v, indptr, indices, last, hq, h, d, page, kv_dtype, scales=(None, None), tensor_cores=True
):
    """FlashInfer's paged decode as SGLang drives it for FP8 KV (tensor-core kernel) unless told."""
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, hq, h, d, page, q_data_type=q.dtype, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return lambda: w.run(q, (k, v), k_scale=scales[0], v_scale=scales[1], out=out, lse=lse, return_lse=True)


def tq3_pool(n_pages: int, h: int, d: int, rotation: LayerRotation, dev: str, key_bits: int = 3,
             key_center: bool = False) -> torch.Tensor:
    """n_pages TQ3P pages: TQ3_BASE_PAGES encoded from random K/V by the torch codec (on the GPU), tiled."""
    layout = TQ3PageLayout(h, PAGE, d, key_bits, key_center)
    base = min(n_pages, TQ3_BASE_PAGES)
    k = torch.randn(base, h, PAGE, d, device=dev)
    v = torch.randn(base, h, PAGE, d, device=dev)
    pages = encode_pages(k, v, layout, rotation, key_codebook(d, key_bits))
    reps = math.ceil(n_pages / base)
    return pages.repeat(reps, 1)[:n_pages].contiguous()


def split_sweep(wrapper, plan_args: tuple, mixed, knob: str, candidates: set[int]) -> dict[int, float]:
    """Median ms of the mixed decode re-planned with each split count (``knob``: plan's num_splits or
    num_fp8_splits), candidates clamped to 1..MAX_SPLITS."""
    sweep = {}
    for splits in sorted({min(max(1, c), MAX_SPLITS) for c in candidates}):
        wrapper.plan(*plan_args, **{knob: splits})
        sweep[splits], _ = bench_ms(mixed)
    return sweep


FUSED_WEIGHTS = (0.5, 1.0, 2.0)  # FP8 chunk weights of the fused decode's split rule, timed at 75% Stale


def run_config(geom: str, batch: int, ctx: int, workspace: torch.Tensor, dev: str, lean: bool = False,
               key_bits: int = 3, key_center: bool = False) -> list[dict]:
    """All Stale fractions of one shape. ``lean``: FlashInfer, the mixed decode (the library's: fused)
    and the two-launch paths with each FP8 kernel, the TQ3 kernel alone, without the split sweeps,
    build variants and per-part timings. ``key_bits``: the TQ3 pages' key width (the build variants
    are 3-bit keys' only); ``key_center``: page-centered keys."""
    hq, h, d = GEOMETRIES[geom]
    pages_per_req = ctx // PAGE
    n_pages = batch * pages_per_req
    tokens = batch * ctx
    bf16_bytes = tokens * h * d * 2 * 2
    layout = TQ3PageLayout(h, PAGE, d, key_bits, key_center)
    pool_bytes = bf16_bytes * 3 // 2 + n_pages * layout.page_bytes
    if pool_bytes > MAX_POOL_BYTES:
        return [{"geom": geom, "batch": batch, "ctx": ctx, "skipped": f"pools need {pool_bytes / 2**30:.0f} GiB"}]
    gen_q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
    perm = torch.randperm(n_pages, device=dev).to(torch.int32)
    indptr = torch.arange(0, n_pages + 1, pages_per_req, dtype=torch.int32, device=dev)
    last = torch.full((batch,), PAGE, dtype=torch.int32, device=dev)
    rows = []

    k16 = torch.randn(n_pages, PAGE, h, d, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn(n_pages, PAGE, h, d, device=dev, dtype=torch.bfloat16)
    bf16_ms, bf16_graph = bench_ms(
        flashinfer_decode(workspace, gen_q, k16, v16, indptr, perm, last, hq, h, d, PAGE, torch.bfloat16)
    )
    del k16, v16
    k8 = (torch.randn(n_pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(n_pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)

    def flashinfer_fp8(tensor_cores=True):  # a fresh wrapper and plan: Minima's plan overwrites the shared workspace
        return flashinfer_decode(
            workspace, gen_q, k8, v8, indptr, perm, last, hq, h, d, PAGE, torch.float8_e4m3fn, (0.5, 0.5), tensor_cores
        )

    fp8_ms, fp8_graph = bench_ms(flashinfer_fp8())
    # FlashInfer's CUDA-core decode kernel (SGLang picks the tensor-core one for FP8 KV): for reference
    fp8_cuda_cores_ms = float("nan") if lean else bench_ms(flashinfer_fp8(tensor_cores=False))[0]
    base = {
        "geom": geom,
        "batch": batch,
        "ctx": ctx,
        "flashinfer_bf16_ms": bf16_ms,
        "flashinfer_bf16_tbps": bf16_bytes / bf16_ms / 1e9,
        "bf16_graph": bf16_graph,
        "flashinfer_fp8_ms": fp8_ms,
        "flashinfer_fp8_tbps": bf16_bytes / 2 / fp8_ms / 1e9,
        "flashinfer_fp8_cuda_cores_ms": fp8_cuda_cores_ms,
        "fp8_graph": fp8_graph,
    }

    rotation = LayerRotation(h, d, layer_id=0, seed=0, device=dev)
    signs = rotation.signs.to(dev)
    max_tq3 = round(max(STALE) * pages_per_req)
    tq3 = tq3_pool(max(batch * max_tq3, 1), h, d, rotation, dev, key_bits, key_center)
    tq3_perm = torch.randperm(tq3.shape[0], device="cpu").to(torch.int32)
    fp8_perm_cpu = perm.cpu()
    wrapper = MinimaDecodeWrapper(workspace, hq, h, d, PAGE, key_bits=key_bits, key_center=key_center)
    variant_wrappers = {}  # MIXED_TQ3_VARIANTS' mixed decodes
    one_page_wrapper = None  # the TileLang FP8 decode with 1 page per step
    for frac in STALE:
        n_tq3 = round(frac * pages_per_req)
        n_fp8 = pages_per_req - n_tq3
        fp8_ids = torch.cat([fp8_perm_cpu[b * pages_per_req : b * pages_per_req + n_fp8] for b in range(batch)])
        tq3_ids = (
            torch.cat([tq3_perm[b * max_tq3 : b * max_tq3 + n_tq3] for b in range(batch)])
            if n_tq3
            else torch.empty(0, dtype=torch.int32)
        )
        fp8_indptr = (
            torch.arange(0, batch * n_fp8 + 1, max(n_fp8, 1), dtype=torch.int32)[: batch + 1]
            if n_fp8
            else torch.zeros(batch + 1, dtype=torch.int32)
        )
        tq3_indptr = (
            torch.arange(0, batch * n_tq3 + 1, max(n_tq3, 1), dtype=torch.int32)[: batch + 1]
            if n_tq3
            else torch.zeros(batch + 1, dtype=torch.int32)
        )
        plan_args = (fp8_indptr, fp8_ids, torch.full((batch,), PAGE, dtype=torch.int32), tq3_indptr, tq3_ids)
        wrapper.plan(*plan_args)
        mixed = partial(wrapper.run, gen_q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5)
        mixed_ms, mixed_graph = bench_ms(mixed)
        mixed_bytes = batch * n_fp8 * PAGE * h * d * 2 + batch * n_tq3 * layout.page_bytes
        row = dict(
            base,
            stale=frac,
            minima_ms=mixed_ms,
            minima_graph=mixed_graph,
            minima_bytes=mixed_bytes,
            minima_tbps=mixed_bytes / mixed_ms / 1e9,
            speedup_vs_fp8=fp8_ms / mixed_ms,
            num_splits=wrapper.tq3_plan.num_splits if n_tq3 else 0,
        )
        if n_tq3 and n_fp8:
            # the library's mixed decode is the fused one (the FP8 pages in the TQ3 decode's grid):
            # its split rule with other FP8 chunk weights at 75% Stale; where the grid takes several
            # waves, one split of each format (the rule's equal-work splits against the one-wave share);
            # at 2 slots or more, the one-wave share where the rule now differs from it (stop 56)
            row["fused_splits"] = [wrapper.tq3_plan.num_splits, wrapper.fp8_plan.num_splits]
            build = wrapper.tq3_build
            slots = slots_per_pair(batch, h, build, wrapper.num_sms)
            if slots < 2:
                wrapper.plan(*plan_args, num_splits=1, num_fp8_splits=1)
                row["minima_fused_one_split_each_ms"], _ = bench_ms(mixed)
            elif (share := previous_fused_splits(slots, n_tq3, n_fp8, min_split_pages(build, PAGE))) != tuple(row["fused_splits"]):
                # the rule before stop 56 (one wave shared by the work, the FP8 split at least a slot)
                row["one_wave_share_splits"] = list(share)
                wrapper.plan(*plan_args, num_splits=share[0], num_fp8_splits=share[1])
                row["minima_fused_one_wave_share_ms"], _ = bench_ms(mixed)
            if frac == STALE[0]:
                sweep = {}
                for weight in FUSED_WEIGHTS:
                    splits = choose_mixed_splits(batch, h, n_tq3, n_fp8, PAGE, build, fp8_weight=weight, num_sms=wrapper.num_sms, head_dim=d)
                    if splits not in sweep.values():
                        wrapper.plan(*plan_args, num_splits=splits[0], num_fp8_splits=splits[1])
                        row[f"minima_fused_w{weight}_ms"], _ = bench_ms(mixed)
                        sweep[weight] = splits
                row["fused_weight_splits"] = {str(w): list(s) for w, s in sweep.items()}
            wrapper.plan(*plan_args)
        if n_tq3 and n_fp8 and batch <= 8 and frac == STALE[0] and not lean:
            # the split count at small batch: more splits fill the GPU with shorter CTAs, fewer leave
            # SMs to FlashInfer's concurrent kernel and give the combine less to do
            chosen = wrapper.tq3_plan.num_splits
            row["split_sweep_ms"] = split_sweep(
                wrapper, plan_args, mixed, "num_splits", {chosen // 4, chosen // 2, chosen, min(2 * chosen, n_tq3)}
            )
            wrapper.plan(*plan_args)
        if n_tq3 and n_fp8 and frac in (0.75, 0.9) and batch == 1 and not lean and key_bits == 3:
            seen = [tile_config(0, PAGE, d, batch)]  # builds equal to the library's (at head dim 256: both) are not re-timed
            for name in MIXED_TQ3_VARIANTS:
                build = variant_build(d, name)
                if build in seen:
                    continue
                seen.append(build)
                variant = variant_wrappers.get(name) or MinimaDecodeWrapper(workspace, hq, h, d, PAGE, tq3_config=build)
                variant_wrappers[name] = variant
                variant.plan(*plan_args)
                row[f"minima_tq3_{name}_ms"], _ = bench_ms(partial(variant.run, gen_q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5))
        if n_tq3 and n_fp8 and batch <= 8 and d <= 128 and frac in (0.75, 0.9) and not lean:
            # the TileLang FP8 decode with 1 page per step at every split length (the build before
            # fp8_tile_config's 2 pages per step for splits of 8 pages and more)
            one_page = one_page_wrapper or MinimaDecodeWrapper(
                workspace, hq, h, d, PAGE, fp8_kernel="tilelang", fp8_config={"pages_per_step": 1}, key_bits=key_bits,
                key_center=key_center,
            )
            one_page_wrapper = one_page
            one_page.plan(*plan_args)
            row["minima_tilelang_fp8_1page_ms"], _ = bench_ms(partial(one_page.run, gen_q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5))
            row["fp8_part_tilelang_1page_ms"], _ = bench_ms(partial(run_fp8, one_page, gen_q, (k8, v8), k_scale=0.5, v_scale=0.5))
        if n_tq3 and n_fp8:
            # the two-launch paths, the FP8 part by each kernel: FlashInfer's decode + merge, or the
            # TileLang FP8 decode (split partials into the same epilogue); before the fused decode the
            # library's "auto" took one of them by the batch's FP8 slots
            previous = "tilelang" if tilelang_fp8_preferred(n_fp8 * batch * PAGE, d) else "flashinfer"
            row["fp8_kernel_previous_auto"] = previous
            for kernel in ("tilelang", "flashinfer"):
                wrapper.fp8_kernel = kernel
                wrapper.plan(*plan_args)
                row[f"minima_{kernel}_fp8_ms"], _ = bench_ms(mixed)
                if lean:
                    continue
                row[f"fp8_part_{kernel}_ms"], _ = bench_ms(partial(run_fp8, wrapper, gen_q, (k8, v8), k_scale=0.5, v_scale=0.5))
                if kernel == "tilelang":
                    chosen = row["fp8_tilelang_splits"] = wrapper.fp8_plan.num_splits
                    if batch <= 8 and frac == STALE[0]:
                        row["fp8_split_sweep_ms"] = split_sweep(
                            wrapper, plan_args, mixed, "num_fp8_splits", {chosen // 2, chosen, min(2 * chosen, n_fp8)}
                        )
            # where the time goes: each part alone, and the same launches on one stream (what the
            # overlap buys)
            # (FlashInfer for the FP8 part, planned last above)
            if not lean:
                row["glue_ms"], _ = bench_ms(partial(run_glue, wrapper, gen_q, signs))
                wrapper.overlap_fp8 = False  # (takes effect at the next plan)
                wrapper.plan(*plan_args)
                row["minima_serial_ms"], _ = bench_ms(mixed)
                wrapper.overlap_fp8 = True
                wrapper.plan(*plan_args)
        if n_tq3:  # the TQ3 kernel alone, with its own split rule (planned as the two-launch path does)
            wrapper.fp8_kernel = "flashinfer"
            wrapper.plan(*plan_args)
            row["tq3_alone_splits"] = wrapper.tq3_plan.num_splits
            q_rot = torch.randn(batch, hq, d, device=dev).to(torch.float16)
            tq3_ms, _ = bench_ms(partial(run_tq3, wrapper, q_rot, tq3))
            tq3_bytes = batch * n_tq3 * layout.page_bytes
            row.update(
                tq3_kernel_ms=tq3_ms,
                tq3_kernel_tbps=tq3_bytes / tq3_ms / 1e9,
                tq3_roofline_frac=tq3_bytes / tq3_ms / 1e9 / ROOFLINE_TBPS,
            )
            wrapper.fp8_kernel = "auto"
        rows.append(row)
    # FlashInfer FP8 once more, after Minima's runs: a slower GPU (clocks, heat) slows this one too,
    # a slower Minima path does not
    fp8_after_ms, _ = bench_ms(flashinfer_fp8())
    for row in rows:
        row["flashinfer_fp8_after_ms"] = fp8_after_ms
    return rows


LIBRARY_BUILD = "library"
TQ3_VARIANTS = {  # name: build options over tile_config (warps, resident CTAs per SM, ring stages, step, shifts)
    LIBRARY_BUILD: lambda d: {},
    "3stages": lambda d: {"stages": 3},
    "one-chunk-steps": lambda d: {"step_chunks": 1},  # a softmax step per 16-token chunk (previous build)
    "two-chunk-steps": lambda d: {"step_chunks": 2},  # the library build for head dims 128 / 256
    "imad-shifts": lambda d: {"shift_by_imad": True},  # key-field right shifts as IMAD.HI (FMA pipe)
    # fewer / more warps per SM: 8 / 8 / 8 and 16 / 24 / 24 for head dim 256 / 128 / 64
    "fewer-warps": lambda d: {"warps": 8, "min_blocks": 1} if d >= 256 else {"warps": 4, "min_blocks": 2},
    "more-warps": lambda d: {"warps": 16, "min_blocks": 1} if d >= 256 else {"warps": 12, "min_blocks": 2} if d >= 128 else {"warps": 4, "min_blocks": 6},
    "one-cta-8-warps": lambda d: {"warps": 8, "min_blocks": 1},  # 8 warps per SM at every head dim
}
# builds of the TQ3 decode timed inside the mixed decode at batch 1 too: fewer of its warps per SM leave
# registers to the FP8 kernel's CTAs, so the two formats' kernels can share SMs instead of taking turns
# (tile_config's batch-1 builds come from these)
MIXED_TQ3_VARIANTS = ("fewer-warps", "one-cta-8-warps")


def variant_build(d: int, name: str) -> dict:
    return {**tile_config(0, PAGE, d), **TQ3_VARIANTS[name](d)}


def tq3_variant_kernel(hq: int, h: int, d: int, name: str):
    """The TQ3 decode kernel of one geometry built as TQ3_VARIANTS[name] (page 64)."""
    return tq3_decode_kernel(h, hq // h, d, PAGE, d**-0.5, key_centroids_fp16(d), **variant_build(d, name))


VARIANT_BATCH, VARIANT_CTX, VARIANT_STALE = 8, 32768, 0.75


def variant_case(hq: int, h: int, d: int, dev: str) -> tuple[tuple, int]:
    """Inputs of the TQ3 kernel at batch 8 x 32K, 75% Stale, random page order: (q words, pool words,
    page_indptr, page_ids) and the TQ3 pages per request."""
    batch = VARIANT_BATCH
    n_tq3 = int(VARIANT_STALE * VARIANT_CTX // PAGE)
    pool = tq3_pool(batch * n_tq3, h, d, LayerRotation(h, d, layer_id=0, seed=0, device=dev), dev)
    ids = torch.randperm(batch * n_tq3, device=dev).to(torch.int32)
    indptr = torch.arange(0, batch * n_tq3 + 1, n_tq3, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev).to(torch.float16).view(torch.int32)
    return (q, pool.view(torch.int32), indptr, ids), n_tq3


def variant_launch(hq: int, h: int, d: int, name: str, inputs: tuple, n_tq3: int, dev: str):
    """The variant's kernel bound to ``inputs`` and split buffers sized for its build; and the split count."""
    splits = choose_num_splits(VARIANT_BATCH, h, n_tq3, PAGE, d, build=variant_build(d, name))
    out = torch.empty(VARIANT_BATCH, hq, splits, d, device=dev)
    lse = torch.empty(VARIANT_BATCH, hq, splits, device=dev)
    return partial(tq3_variant_kernel(hq, h, d, name), *inputs, out, lse), splits


def tq3_variants(dev: str) -> list[dict]:
    """TQ3 kernel alone (split decode, no combine), 75% of a 32K context, batch 8, per variant
    (the split count chosen for the variant's build, as the library does for its own)."""
    rows = []
    for geom, (hq, h, d) in GEOMETRIES.items():
        inputs, n_tq3 = variant_case(hq, h, d, dev)
        nbytes = VARIANT_BATCH * n_tq3 * TQ3PageLayout(h, PAGE, d).page_bytes
        for name in TQ3_VARIANTS:
            try:
                launch, splits = variant_launch(hq, h, d, name, inputs, n_tq3, dev)
                ms, graph = bench_ms(launch)
            except Exception as e:  # noqa: BLE001 - e.g. a build that needs more shared memory than an SM has
                rows.append({"geom": geom, "variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append(
                {
                    "geom": geom,
                    "variant": name,
                    "batch": VARIANT_BATCH,
                    "ctx": VARIANT_CTX,
                    "stale": VARIANT_STALE,
                    "splits": splits,
                    "ms": ms,
                    "graph": graph,
                    "tbps": nbytes / ms / 1e9,
                    "roofline_frac": nbytes / ms / 1e9 / ROOFLINE_TBPS,
                }
            )
    return rows


def token_granular_fp8(workspace: torch.Tensor, dev: str) -> dict:
    """FlashInfer FP8, 32q/8kv/128, batch 8 x 32K: page_size=1 token indices (SGLang) vs 64-token pages."""
    hq, h, d = GEOMETRIES["32q/8kv/128"]
    batch, ctx = 8, 32768
    n_pages = batch * ctx // PAGE
    q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
    k8 = (torch.randn(n_pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(n_pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    perm = torch.randperm(n_pages, device=dev).to(torch.int32)
    indptr = torch.arange(0, n_pages + 1, ctx // PAGE, dtype=torch.int32, device=dev)
    paged_ms, _ = bench_ms(
        flashinfer_decode(
            workspace,
            q,
            k8,
            v8,
            indptr,
            perm,
            torch.full((batch,), PAGE, dtype=torch.int32, device=dev),
            hq,
            h,
            d,
            PAGE,
            torch.float8_e4m3fn,
        )
    )
    slots = (perm.view(-1, 1).long() * PAGE + torch.arange(PAGE, device=dev)).reshape(-1).to(torch.int32)
    tok_indptr = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32, device=dev)
    ones = torch.ones(batch, dtype=torch.int32, device=dev)
    token_ms, _ = bench_ms(
        flashinfer_decode(
            workspace,
            q,
            k8.view(-1, 1, h, d),
            v8.view(-1, 1, h, d),
            tok_indptr,
            slots,
            ones,
            hq,
            h,
            d,
            1,
            torch.float8_e4m3fn,
        )
    )
    return {"geom": "32q/8kv/128", "batch": batch, "ctx": ctx, "page64_ms": paged_ms, "token_granular_ms": token_ms}


def conversion_throughput(dev: str, key_bits: int = 3, key_center: bool = False) -> list[dict]:
    rows = []
    for geom, (hq, h, d) in GEOMETRIES.items():
        n = 4096
        layout = TQ3PageLayout(h, PAGE, d, key_bits, key_center)
        rotation = LayerRotation(h, d, layer_id=0, seed=0, device=dev)
        k = (torch.randn(n, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
        v = (torch.randn(n, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
        pages = torch.empty(n, layout.page_bytes, dtype=torch.uint8, device=dev)
        ids = torch.randperm(n, device=dev).to(torch.int32)
        fwd_ms, _ = bench_ms(
            partial(fp8_to_tq3, k, v, ids, ids, pages, rotation, k_scale=0.5, v_scale=0.5, key_bits=key_bits,
                    key_center=key_center), graph=False
        )
        bwd_ms, _ = bench_ms(
            partial(tq3_to_fp8, pages, ids, ids, k, v, rotation, k_scale=0.5, v_scale=0.5, key_bits=key_bits,
                    key_center=key_center), graph=False
        )
        fp8_bytes = n * PAGE * h * d * 2
        rows.append(
            {
                "geom": geom,
                "pages": n,
                "fp8_to_tq3_ms": fwd_ms,
                "fp8_to_tq3_gbps_in": fp8_bytes / fwd_ms / 1e6,
                "fp8_to_tq3_pages_per_s": n / fwd_ms * 1e3,
                "tq3_to_fp8_ms": bwd_ms,
                "tq3_to_fp8_gbps_in": n * layout.page_bytes / bwd_ms / 1e6,
                "tq3_to_fp8_pages_per_s": n / bwd_ms * 1e3,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--skip-conversion", action="store_true", help="leave out the conversion throughput")
    ap.add_argument("--variants-only", action="store_true", help="only the TQ3 kernel build variants")
    ap.add_argument("--lean", action="store_true", help="decode shapes and conversions, without sweeps, variants and per-part timings")
    ap.add_argument(
        "--config", action="append", default=[], metavar="GEOM:BATCH:CTX", help="only these decode shapes (repeatable)"
    )
    ap.add_argument("--key-bits", type=int, choices=(3, 4), default=MinimaConfig().key_bits,
                    help="the TQ3 pages' key width (--minima-key-bits; default: the launcher's)")
    ap.add_argument("--key-center", action="store_true", help="page-centered keys (--minima-key-center)")
    args = ap.parse_args()
    configs = [(g, b, c) for c in CONTEXTS for b in BATCHES for g in GEOMETRIES]
    if args.config:  # any shape, in this order; checked before the GPU does anything
        configs = []
        for x in args.config:
            geom, _, rest = x.partition(":")
            batch, _, ctx = rest.partition(":")
            if geom not in GEOMETRIES or not (batch.isdigit() and ctx.isdigit()) or int(batch) < 1 or int(ctx) < PAGE:
                ap.error(f"--config {x!r}: GEOM:BATCH:CTX, GEOM one of {sorted(GEOMETRIES)}, BATCH >= 1, CTX >= {PAGE} tokens")
            configs.append((geom, int(batch), int(ctx)))
    dev = "cuda"
    t0 = time.time()
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "roofline_tbps": ROOFLINE_TBPS,
        "page_size": PAGE,
        "key_bits": args.key_bits,
        "key_center": args.key_center,
        "tilelang_fp8_max_tokens": TILELANG_FP8_MAX_TOKENS,  # fp8_kernel="auto"'s thresholds, by head dim
        "decode": [],
        "not_run": [],
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not (args.skip_conversion or args.variants_only):
        result["conversion"] = conversion_throughput(dev, args.key_bits, args.key_center)
        save()
    if not (args.config or args.lean):
        result["tq3_variants"] = tq3_variants(dev)
        save()
        print_variants(result)
    if args.variants_only:
        return
    for geom, batch, ctx in configs:
        if time.time() - t0 > args.budget_s:
            result["not_run"].append({"geom": geom, "batch": batch, "ctx": ctx, "why": "time budget"})
            continue
        try:
            result["decode"].extend(run_config(geom, batch, ctx, workspace, dev, args.lean, args.key_bits, args.key_center))
        except Exception as e:  # noqa: BLE001 - one failing shape must not lose the rest
            result["not_run"].append(
                {"geom": geom, "batch": batch, "ctx": ctx, "why": f"{type(e).__name__}: {e}"[:300]}
            )
        torch.cuda.empty_cache()
        save()
    if time.time() - t0 < args.budget_s and not (args.config or args.lean):
        result["token_granular_fp8"] = token_granular_fp8(workspace, dev)
    save()
    print_table(result)


def print_variants(result: dict) -> None:
    for r in result["tq3_variants"]:
        if "error" in r:
            print(f"tq3 variant {r['geom']:12} {r['variant']:13} not run: {r['error']}", flush=True)
            continue
        print(
            f"tq3 variant {r['geom']:12} {r['variant']:13} {r['ms']:.3f} ms {r['tbps']:.2f} TB/s "
            f"({100 * r['roofline_frac']:.1f}% of roofline) splits {r['splits']} graph {r['graph']}",
            flush=True,
        )


def print_table(result: dict) -> None:
    centered = ", page-centered" if result.get("key_center") else ""
    print(f"{result['gpu']}  {result['date']}  page {result['page_size']}  {result.get('key_bits', 3)}-bit keys{centered}  "
          f"roofline {result['roofline_tbps']} TB/s")
    print(
        f"{'geom':12} {'B':>3} {'ctx':>6} {'stale':>5} | {'FI bf16 ms':>10} {'FI fp8 ms':>9} {'minima ms':>9} {'x fp8':>6} | "
        f"{'fp8 TB/s':>8} {'min TB/s':>8} {'tq3 TB/s':>8} {'tq3 %roof':>9} {'splits':>6} {'FI fp8 after':>12} {'serial ms':>9} | "
        f"{'prev ms':>8} {'x fp8':>6}"
    )
    for r in result["decode"]:
        if "skipped" in r:
            print(f"{r['geom']:12} {r['batch']:>3} {r['ctx']:>6}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['geom']:12} {r['batch']:>3} {r['ctx'] // 1024:>5}K {r['stale']:>5.2f} | {r['flashinfer_bf16_ms']:>10.3f} "
            f"{r['flashinfer_fp8_ms']:>9.3f} {r['minima_ms']:>9.3f} {r['speedup_vs_fp8']:>6.2f} | {r['flashinfer_fp8_tbps']:>8.2f} "
            f"{r['minima_tbps']:>8.2f} {r.get('tq3_kernel_tbps', float('nan')):>8.2f} {100 * r.get('tq3_roofline_frac', float('nan')):>8.1f}% "
            f"{r['num_splits']:>6} {r.get('flashinfer_fp8_after_ms', float('nan')):>12.3f} {r.get('minima_serial_ms', float('nan')):>9.3f} | "
            f"{previous_ms(r) or float('nan'):>8.3f} {r['flashinfer_fp8_ms'] / (previous_ms(r) or float('nan')):>6.2f}"
        )
    for r in result.get("conversion", []):
        print(
            f"convert {r['geom']:12} fp8->tq3 {r['fp8_to_tq3_gbps_in']:.0f} GB/s in, {r['fp8_to_tq3_pages_per_s']:.3g} pages/s; "
            f"tq3->fp8 {r['tq3_to_fp8_gbps_in']:.0f} GB/s in, {r['tq3_to_fp8_pages_per_s']:.3g} pages/s"
        )
    if "token_granular_fp8" in result:
        t = result["token_granular_fp8"]
        print(
            f"FlashInfer FP8 32q/8kv/128 8x32K: 64-token pages {t['page64_ms']:.3f} ms, token-granular (page_size=1) {t['token_granular_ms']:.3f} ms"
        )
    for r in result["not_run"]:
        print(f"not run: {r}")


if __name__ == "__main__":
    main()
