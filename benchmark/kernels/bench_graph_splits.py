"""The CUDA graph's split counts against the requests a graph really serves (device; #16).

A captured decode fixes its split counts at capture (``heuristics.graph_splits``), from the batch
size and the model's longest context; the requests then divide their pages among those splits. This
times the fused decode of one layer at requests of ``--pages`` pages (``--fp8-pages`` of them FP8, the
rest TQ3, like a gsp request at the defaults) with the split counts each rule gives for a model
context: today's ``heuristics.graph_splits`` (``graph_rule``; stop 55's JSON files call stop 54's rule
``capped``, and stop 55's and 56's hold the rule before stop 54, ``before``, and name the graph rule of
their day ``graph_rule``), the fused split rule on the real page counts
(``fused_real``) and a sweep of TQ3 splits (one FP8 split); beside them the eager
step's own choice (``auto``: at these shapes often the two-launch path) and FlashInfer's FP8 decode
over the same pages in FP8, the baseline. CUDA-graph medians (``graph`` false: timed eagerly).

    PYTHONPATH=kernels:python:benchmark/kernels python benchmark/kernels/bench_graph_splits.py --out r.json
"""

import argparse
import json
import time
from functools import partial

import torch
from bench_decode import GEOMETRIES, PAGE, bench_ms, flashinfer_decode, tq3_pool
from minima_kernels import MinimaDecodeWrapper, heuristics
from sglang_minima.codec import LayerRotation
from tqdm import tqdm


def save(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--geometry", default="32q/8kv/128", choices=sorted(GEOMETRIES))
    ap.add_argument("--batches", default="64,32,24")
    ap.add_argument("--pages", type=int, default=70, help="pages per request (gsp at the defaults: 4,480 tokens)")
    ap.add_argument("--fp8-pages", type=int, default=6, help="of them FP8 (the Recent tier, sinks, Anchors)")
    ap.add_argument("--contexts", default="131072,34816,6400", help="model contexts the graph is captured for")
    ap.add_argument("--key-bits", type=int, choices=(3, 4), default=4)
    ap.add_argument("--sweep", default="1,2,4,8,16", help="TQ3 split counts timed with one FP8 split")
    args = ap.parse_args()
    if not 0 < args.fp8_pages < args.pages:
        ap.error(f"--fp8-pages {args.fp8_pages}: between 1 and --pages - 1 ({args.pages - 1})")
    dev = "cuda"
    hq, h, d = GEOMETRIES[args.geometry]
    n_fp8, n_tq3 = args.fp8_pages, args.pages - args.fp8_pages
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    rotation = LayerRotation(h, d, layer_id=0, seed=0, device=dev)
    signs = rotation.signs.to(dev)
    wrapper = MinimaDecodeWrapper(workspace, hq, h, d, PAGE, key_bits=args.key_bits, fp8_kernel="fused")
    # an eager step's choice, on its own workspace (FlashInfer's plan lives there)
    auto = MinimaDecodeWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), hq, h, d, PAGE, key_bits=args.key_bits)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "geometry": args.geometry, "pages": args.pages, "fp8_pages": n_fp8, "key_bits": args.key_bits, "rows": []}
    cases = [(int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    done: dict[tuple[int, tuple[int, int]], tuple[float, bool]] = {}
    for batch in tqdm(sorted({b for b, _ in cases}, reverse=True), desc="batches"):
        q = torch.randn(batch, hq, d, device=dev).to(torch.bfloat16)
        k8 = (torch.randn(batch * args.pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
        v8 = (torch.randn(batch * args.pages, PAGE, h, d, device=dev) * 2).to(torch.float8_e4m3fn)
        all_ids = torch.randperm(batch * args.pages, device=dev).to(torch.int32)
        indptr = torch.arange(0, batch * args.pages + 1, args.pages, dtype=torch.int32, device=dev)
        last = torch.full((batch,), PAGE, dtype=torch.int32, device=dev)
        tq3 = tq3_pool(batch * n_tq3, h, d, rotation, dev, args.key_bits)
        ids = all_ids.cpu().view(batch, args.pages)
        plan_args = (
            torch.arange(0, batch * n_fp8 + 1, n_fp8, dtype=torch.int32), ids[:, :n_fp8].reshape(-1).contiguous(),
            torch.full((batch,), PAGE, dtype=torch.int32),
            torch.arange(0, batch * n_tq3 + 1, n_tq3, dtype=torch.int32), torch.randperm(batch * n_tq3).to(torch.int32),
        )
        mixed = partial(wrapper.run, q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5)
        wrapper.plan(*plan_args)  # the fused split rule on the real page counts
        fused_real = (wrapper.path.tq3_splits, wrapper.path.fp8_splits)

        def timed(splits: tuple[int, int]) -> dict:
            if (batch, splits) not in done:
                wrapper.plan(*plan_args, num_splits=splits[0], num_fp8_splits=splits[1])
                done[batch, splits] = bench_ms(mixed)
            ms, graph = done[batch, splits]
            return {"splits": list(splits), "ctas": (splits[0] + splits[1]) * batch * h, "ms": ms, "graph": graph}

        rows = []
        for b, ctx in cases:  # the fused decode's rows first: FlashInfer's JIT build may be cold
            if b != batch:
                continue
            row = {"batch": batch, "context": ctx,
                   "sweep": {str(n): timed((n, 1)) for n in (int(x) for x in args.sweep.split(","))}}
            # the graph's splits for a model of this context
            rule = heuristics.graph_splits(batch, h, -(-ctx // PAGE), PAGE, wrapper.tq3_build, num_sms, head_dim=d)
            row["graph_rule"] = timed(rule)
            row["fused_real"] = timed(fused_real)
            rows.append(row)
            result["rows"].append(row)
            save(result, args.out)
        # then what may build FlashInfer's JIT kernels: the eager step's own path, FlashInfer's FP8 decode
        auto.plan(*plan_args)
        auto_ms, auto_graph = bench_ms(partial(auto.run, q, (k8, v8), tq3, signs, k_scale=0.5, v_scale=0.5))
        two = "two-launch, " + ("TileLang" if auto.path.tilelang_fp8 else "FlashInfer") + " FP8"
        for row in rows:
            row["auto"] = {"path": "fused" if auto.path.fused else two, "splits": [auto.path.tq3_splits, auto.path.fp8_splits],
                           "ms": auto_ms, "graph": auto_graph}
        save(result, args.out)
        fp8_ms, fp8_graph = bench_ms(flashinfer_decode(workspace, q, k8, v8, indptr, all_ids, last, hq, h, d, PAGE,
                                               torch.float8_e4m3fn, (0.5, 0.5)))
        for row in rows:
            row["flashinfer_fp8_ms"], row["flashinfer_fp8_graph"] = fp8_ms, fp8_graph
            for part in (row["graph_rule"], row["fused_real"], row["auto"], *row["sweep"].values()):
                part["x_fp8"] = part["ms"] / fp8_ms
        save(result, args.out)
    names = ("graph_rule", "fused_real", "auto")
    print(f"{'rows':>4} {'context':>7} {'FP8 ms':>8}  " + "  ".join(f"{n:>26}" for n in names) + "  sweep (TQ3 splits: x FP8)")
    for row in result["rows"]:
        cells = [f"{str(tuple(row[n]['splits'])):>10} {row[n]['ms']:.4f} ({row[n]['x_fp8']:.2f}x)" for n in names]
        sweep = " ".join(f"{n}: {r['x_fp8']:.2f}" for n, r in row["sweep"].items())
        print(f"{row['batch']:>4} {row['context']:>7} {row['flashinfer_fp8_ms']:>8.4f}  " + "  ".join(cells) + "  " + sweep)


if __name__ == "__main__":
    main()
