"""CPU decode attention over Minima's pages: FP8-only vs mixed FP8/TQ3, per decode op.

Builds one layer's pool state for SmolLM2-135M's geometry (9 q heads, 3 kv heads, head dim 64, page
size 64) at each context and batch (every request on its own pages, the last page partial and hot),
once with every page FP8 and once with ``--stale`` of the full pages TQ3 (the first page and the last
``--recent`` pages stay FP8, as the sink and Recent tiers keep them), and times one decode attention
call of each op (median of ``--repeats`` timed calls, arms interleaved so a shared machine's noise
hits them alike). The figure that matters is a ratio measured in the same process: TQ3-mixed time
over FP8-only time, per op. One layer is timed; ``x layers`` scales it to the model's 30.

    PYTHONPATH=python python benchmark/ops/bench_cpu_decode.py --json docs/results/cpu_decode.json
    PYTHONPATH=python python benchmark/ops/bench_cpu_decode.py --profile 6144:1   # where the time goes

``OMP_NUM_THREADS=1`` (torch.set_num_threads(1)) by default, as the CPU server runs.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.fp8 import fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import encode_pages
from sglang_minima.layers.attention.forward_plan import ForwardPlan, plan_forward
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops import batched_decode, lut_decode

ROOT = Path(__file__).resolve().parents[2]
HQ, HKV, D, PAGE, LAYERS = 9, 3, 64, 64, 30
K_SCALE, V_SCALE = 0.05, 0.03

OPS: dict[str, Callable] = {"reference": batched_decode.mixed_batch_decode, "fast": lut_decode.lut_mixed_batch_decode}


@dataclass
class Pool:
    """One layer's buffers, page table and the decode plan of one batch."""

    plan: ForwardPlan
    hot_k: torch.Tensor
    hot_v: torch.Tensor
    tq3: torch.Tensor
    layout: TQ3PageLayout
    rotation: LayerRotation
    q: torch.Tensor
    tq3_pages: int
    hot_pages: int


def build_pool(context: int, batch: int, stale: float, recent: int, seed: int = 0) -> Pool:
    g = torch.Generator().manual_seed(seed)
    layout, codebook = TQ3PageLayout(HKV, PAGE, D), tq3_codebook(D)
    rotation = LayerRotation(HKV, D, layer_id=0, seed=0)
    pages = -(-context // PAGE)
    full = context // PAGE
    n_stale = round(stale * full)
    first_stale = 1
    last_stale = min(full - recent, first_stale + n_stale)  # exclusive
    total = batch * pages
    fmt = torch.zeros(total + 1, dtype=torch.int8)
    phys = torch.zeros(total + 1, dtype=torch.int32)
    req_to_token = torch.zeros(batch, pages * PAGE, dtype=torch.int32)
    kinds = [[first_stale <= j < last_stale for j in range(pages)] for _ in range(batch)]
    n_tq3 = sum(map(sum, kinds))
    hot_k = torch.zeros((total - n_tq3 + 1) * PAGE, HKV, D, dtype=torch.uint8)
    hot_v = torch.zeros_like(hot_k)
    tq3 = torch.zeros(n_tq3 + 1, layout.page_bytes, dtype=torch.uint8)
    lp, nh, nt = 1, 0, 0
    for row in range(batch):
        for j in range(pages):
            req_to_token[row, j * PAGE : (j + 1) * PAGE] = torch.arange(lp * PAGE, (lp + 1) * PAGE)
            k = fp8_quantize(torch.randn(PAGE, HKV, D, generator=g) * 4, K_SCALE)
            v = fp8_quantize(torch.randn(PAGE, HKV, D, generator=g), V_SCALE)
            if kinds[row][j]:
                nt += 1
                fmt[lp], phys[lp] = FMT_TQ3, nt
                tq3[nt] = encode_pages(
                    k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], layout, rotation, codebook,
                    k_scale=K_SCALE, v_scale=V_SCALE,
                )[0]
            else:
                nh += 1
                fmt[lp], phys[lp] = FMT_HOT, nh
                hot_k[nh * PAGE : (nh + 1) * PAGE] = k
                hot_v[nh * PAGE : (nh + 1) * PAGE] = v
            lp += 1
    kv_lens = torch.full((batch,), context, dtype=torch.int32)
    plan = plan_forward(
        req_to_token, torch.arange(batch), kv_lens, torch.ones(batch, dtype=torch.int32), fmt, phys, PAGE, pages
    )
    q = torch.randn(batch, HQ, D, generator=g)
    return Pool(plan, hot_k, hot_v, tq3, layout, rotation, q, nt, nh)


def call(op: Callable, pool: Pool) -> tuple[torch.Tensor, torch.Tensor]:
    return op(
        pool.q, pool.plan.hot, pool.plan.tq3, pool.plan.kv_lens, pool.hot_k, pool.hot_v, pool.tq3,
        pool.layout, tq3_codebook(D), pool.rotation, D**-0.5, K_SCALE, V_SCALE,
    )


def time_arms(arms: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each arm, arms interleaved call by call."""
    for fn in arms.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def run_config(context: int, batch: int, stale: float, recent: int, repeats: int) -> dict:
    fp8 = build_pool(context, batch, 0.0, recent)
    mixed = build_pool(context, batch, stale, recent)
    arms: dict[str, Callable[[], object]] = {}
    for name, op in OPS.items():
        arms[f"{name}/fp8"] = lambda op=op: call(op, fp8)
        arms[f"{name}/tq3"] = lambda op=op: call(op, mixed)
    times = time_arms(arms, repeats)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    row = {
        "context": context, "batch": batch, "stale": stale,
        "tq3_pages": mixed.tq3_pages, "hot_pages_mixed": mixed.hot_pages, "hot_pages_fp8": fp8.hot_pages,
        "median_ms": ms, "repeats": repeats,
        "all_ms": {k: [round(1e3 * t, 4) for t in v] for k, v in times.items()},
    }
    for name in OPS:
        row[f"{name}_tq3_over_fp8"] = ms[f"{name}/tq3"] / ms[f"{name}/fp8"]
    if "fast" in OPS:
        row["fast_over_reference_fp8"] = ms["fast/fp8"] / ms["reference/fp8"]
        row["fast_over_reference_tq3"] = ms["fast/tq3"] / ms["reference/tq3"]
        row["fast_tq3_over_reference_fp8"] = ms["fast/tq3"] / ms["reference/fp8"]
    return row


def format_table(rows: list[dict]) -> str:
    names = list(OPS)
    cols = ["context", "batch", "TQ3 pages"] + [f"{n} FP8 ms" for n in names] + [f"{n} TQ3 ms" for n in names]
    cols += [f"{n} TQ3/FP8" for n in names]
    if "fast" in OPS:
        cols += ["fast TQ3 / ref FP8"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["context"]), str(r["batch"]), f"{r['tq3_pages']}/{r['tq3_pages'] + r['hot_pages_mixed']}"]
        cells += [f"{r['median_ms'][f'{n}/fp8']:.2f}" for n in names]
        cells += [f"{r['median_ms'][f'{n}/tq3']:.2f}" for n in names]
        cells += [f"{r[f'{n}_tq3_over_fp8']:.2f}x" for n in names]
        if "fast" in OPS:
            cells += [f"{r['fast_tq3_over_reference_fp8']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, {torch.get_num_threads()} thread(s)"


def profile(context: int, batch: int, stale: float, recent: int, calls: int) -> None:
    """cProfile (Python functions) and torch.profiler (aten ops) of ``calls`` calls per op and arm."""
    for label, s in (("fp8", 0.0), ("tq3", stale)):
        pool = build_pool(context, batch, s, recent)
        for name, op in OPS.items():
            call(op, pool)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call(op, pool)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(f"\n===== cProfile {name}/{label} context={context} batch={batch} ({calls} calls), by tottime")
            print(out.getvalue())
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
                for _ in range(calls):
                    call(op, pool)
            print(f"===== torch.profiler {name}/{label}, by self CPU time")
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,6144")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--stale", type=float, default=0.75, help="fraction of full pages in TQ3")
    p.add_argument("--recent", type=int, default=4, help="last pages kept FP8 (Recent tier)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", metavar="CONTEXT:BATCH", help="profile one configuration instead of timing")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        context, batch = (int(x) for x in args.profile.split(":"))
        profile(context, batch, args.stale, args.recent, calls=20)
        return
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            rows.append(run_config(context, batch, args.stale, args.recent, args.repeats))
            print(f"context={context} batch={batch}: " + ", ".join(
                f"{k} {v:.2f} ms" for k, v in rows[-1]["median_ms"].items()), file=sys.stderr)
    table = format_table(rows)
    print(table)
    print(f"\nOne layer per call; x{LAYERS} layers for SmolLM2-135M. Machine: {machine()}.")
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PAGE, "layers": LAYERS},
            "ops": list(OPS),
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
