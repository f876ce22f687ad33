"""Batch 1: the mixed decode (75% Stale) and its TQ3 / FP8 kernels alone over build and split variants:
deeper copy rings (more bytes in flight per warp), fewer warps, split counts x 0.5 / 1 / 2. CUDA-graph
medians in microseconds.

    PYTHONPATH=kernels:python:benchmark/kernels python3 scripts/device/archive/sweep_batch1.py out.json
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from bench_decode import GEOMETRIES, PAGE, bench_ms, tq3_pool
from minima_kernels import MinimaDecodeWrapper, tile_config, tq3_decode_kernel
from minima_kernels.decode import key_centroids_fp16
from minima_kernels.fp8_decode import fp8_decode_kernel, fp8_tile_config
from sglang_minima.codec import LayerRotation

TQ3_BUILDS = {  # over tile_config(..., batch=1)
    "library": {},
    "stages3": {"stages": 3},
    "stages4": {"stages": 4},
    "8w1cta_stages4": {"warps": 8, "min_blocks": 1, "stages": 4},
    "4w2cta_stages4": {"warps": 4, "min_blocks": 2, "stages": 4},
}
FP8_BUILDS = {  # over fp8_tile_config's; pages per step pinned (the wrapper would pick it by split length)
    "library": {"pages_per_step": 1},  # the 1-page build, as when kernels_h200_batch1_sweep.json was measured
    "stages3": {"stages": 3, "pages_per_step": 1},
    "stages4": {"stages": 4, "pages_per_step": 1},
    "2pages": {"pages_per_step": 2},
    "2pages_stages3": {"pages_per_step": 2, "stages": 3},
}


def tq3_build(d: int, name: str) -> dict:
    return {**tile_config(0, PAGE, d, 1), **TQ3_BUILDS[name]}


def fp8_build(d: int, name: str) -> dict | None:
    b = {**fp8_tile_config(PAGE), **FP8_BUILDS[name]}
    return None if b.get("pages_per_step", 1) > 1 and d > 128 else b


def warm() -> None:
    jobs = []
    for hq, h, d in GEOMETRIES.values():
        g = hq // h
        for name in TQ3_BUILDS:
            jobs.append(partial(tq3_decode_kernel, h, g, d, PAGE, d**-0.5, key_centroids_fp16(d), **tq3_build(d, name)))
        for name in FP8_BUILDS:
            if (b := fp8_build(d, name)) is not None:
                jobs.append(partial(fp8_decode_kernel, h, g, d, PAGE, d**-0.5, "bfloat16", **b))
    with ThreadPoolExecutor(12) as pool:
        for f in [pool.submit(j) for j in jobs]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - e.g. past an SM's shared memory: that row says so
                print(f"build failed: {type(e).__name__}: {str(e)[-300:]}", file=sys.stderr)


def sweep(geom: str, ctx: int, stale: float = 0.75) -> list[dict]:
    hq, h, d = GEOMETRIES[geom]
    dev, batch = "cuda", 1
    per_req = ctx // PAGE
    n_tq3 = round(stale * per_req)
    n_fp8 = per_req - n_tq3
    q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
    k8 = (torch.randn(n_fp8, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(n_fp8, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    rotation = LayerRotation(h, d, layer_id=0, seed=0, device=dev)
    signs = rotation.signs.to(dev)
    tq3 = tq3_pool(n_tq3, h, d, rotation, dev)
    plan_args = (
        torch.tensor([0, n_fp8], dtype=torch.int32),
        torch.randperm(n_fp8).to(torch.int32),
        torch.full((batch,), PAGE, dtype=torch.int32),
        torch.tensor([0, n_tq3], dtype=torch.int32),
        torch.randperm(n_tq3).to(torch.int32),
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    us = lambda fn: round(bench_ms(fn)[0] * 1e3, 2)  # noqa: E731
    rows = []
    base = {"geom": geom, "ctx": ctx, "stale": stale}
    mixed = lambda w: partial(w.run, q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5)  # noqa: E731
    alone = {  # each part's kernel alone
        "tq3": lambda w: partial(w._split_decode, w.tq3_plan.q_rot, tq3),
        "fp8": lambda w: partial(w.run_fp8, q, (k8, v8), k_scale=0.5, v_scale=0.5),
    }
    for part, builds, knob in (("tq3", TQ3_BUILDS, "num_splits"), ("fp8", FP8_BUILDS, "num_fp8_splits")):
        for name, config in builds.items():
            if part == "fp8" and fp8_build(d, name) is None:
                continue
            try:
                w = MinimaDecodeWrapper(workspace, hq, h, d, PAGE, fp8_kernel="tilelang", **{f"{part}_config": config})
                w.plan(*plan_args)
                default = getattr(w, f"{part}_plan").num_splits
                for splits in sorted({max(1, default // 2), default, 2 * default}):
                    w.plan(*plan_args, **{knob: splits})
                    row = {f"{part}_build": name, f"{part}_splits": splits, "default_splits": default}
                    row.update(mixed_us=us(mixed(w)), **{f"{part}_kernel_us": us(alone[part](w))})
                    rows.append(dict(base, **row))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - e.g. past an SM's shared memory: the row says so
                rows.append(dict(base, **{f"{part}_build": name}, error=f"{type(e).__name__}: {e}"[:300]))
    w = MinimaDecodeWrapper(workspace, hq, h, d, PAGE, fp8_kernel="flashinfer")
    w.plan(*plan_args)
    rows.append(dict(base, fp8_build="flashinfer", mixed_us=us(mixed(w))))
    return rows


if __name__ == "__main__":
    warm()
    rows = []
    for ctx in (32768, 131072):
        for geom in GEOMETRIES:
            rows += sweep(geom, ctx)
    with open(sys.argv[1], "w") as f:  # not stdout: TileLang logs its builds there
        json.dump(rows, f, indent=1)
