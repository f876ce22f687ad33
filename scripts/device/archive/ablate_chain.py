"""Which launch sets the mixed decode's time: the mixed decode with one of its parts left out (outputs
wrong, timing only), and each part alone, CUDA-graph medians in microseconds. 75% Stale, page 64.

    PYTHONPATH=kernels:python:benchmark/kernels python3 scripts/device/archive/ablate_chain.py out.json [GEOM:B:CTX ...]
"""

import json
import sys
from functools import partial

import torch
from bench_decode import GEOMETRIES, PAGE, bench_ms, tq3_pool
from minima_kernels import MinimaDecodeWrapper
from sglang_minima.codec import LayerRotation

PARTS = ("_rotate_queries", "_split_decode", "run_fp8", "_finish")


def ablate(geom: str, batch: int, ctx: int, stale: float = 0.75) -> dict:
    hq, h, d = GEOMETRIES[geom]
    dev = "cuda"
    per_req = ctx // PAGE
    n_tq3 = round(stale * per_req)
    n_fp8 = per_req - n_tq3
    q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
    k8 = (torch.randn(batch * n_fp8, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(batch * n_fp8, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
    rotation = LayerRotation(h, d, layer_id=0, seed=0, device=dev)
    signs = rotation.signs.to(dev)
    tq3 = tq3_pool(batch * n_tq3, h, d, rotation, dev)
    plan_args = (
        torch.arange(0, batch * n_fp8 + 1, n_fp8, dtype=torch.int32),
        torch.randperm(batch * n_fp8).to(torch.int32),
        torch.full((batch,), PAGE, dtype=torch.int32),
        torch.arange(0, batch * n_tq3 + 1, n_tq3, dtype=torch.int32),
        torch.randperm(batch * n_tq3).to(torch.int32),
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = MinimaDecodeWrapper(workspace, hq, h, d, PAGE)
    w.plan(*plan_args)
    mixed = partial(w.run, q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5)
    us = lambda fn: round(bench_ms(fn)[0] * 1e3, 2)  # noqa: E731
    row = {"geom": geom, "batch": batch, "ctx": ctx, "stale": stale, "fp8_kernel": "flashinfer" if w.fp8_plan is None else "tilelang"}
    row["mixed"] = us(mixed)
    for part in PARTS:  # the mixed decode without this part
        setattr(w, part, lambda *a, **k: None)
        row[f"without_{part.lstrip('_')}"] = us(mixed)
        delattr(w, part)
    row["only_rotate"] = us(partial(w._rotate_queries, q, signs))
    row["only_tq3_kernel"] = us(partial(w._split_decode, w.tq3_plan.q_rot, tq3))
    row["only_fp8"] = us(partial(w.run_fp8, q, (k8, v8), k_scale=0.5, v_scale=0.5))
    row["only_epilogue"] = us(partial(w._finish, signs))
    row["rotate_tq3_epilogue"] = us(lambda: (w._rotate_queries(q, signs), w._split_decode(w.tq3_plan.q_rot, tq3), w._finish(signs)))
    row["empty_graph_kernel"] = us(lambda: q.add_(0))
    return row


if __name__ == "__main__":
    configs = sys.argv[2:] or [f"{g}:{b}:32768" for b in (1, 8) for g in GEOMETRIES] + [f"{g}:1:131072" for g in GEOMETRIES]
    rows = []
    for c in configs:
        g, b, ctx = c.split(":")
        rows.append(ablate(g, int(b), int(ctx)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    with open(sys.argv[1], "w") as f:  # not stdout: TileLang logs its builds there
        json.dump(rows, f, indent=1)
