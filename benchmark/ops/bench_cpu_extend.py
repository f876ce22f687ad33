"""CPU extend attention over Minima's pages: the masked tiles against the fused kernel (``own_tail``).

One request of SmolLM2-135M's geometry (9 q heads, 3 kv heads, head dim 64, page size 64) extends
``new`` tokens over a cached prefix of ``prefix`` tokens whose full pages are ``--stale`` TQ3 (the
first page and the last ``--recent`` pages of the prefix FP8, as the sink and Recent tiers keep them;
the new tokens FP8, as an extend writes them). Its route is planned as the CPU server plans it
(``plan_request``) and one layer's attention is timed both ways through ``mixed_paged_attention``:
the masked path (positions, a score matrix per tile of 256 hot tokens / 4 TQ3 pages) and the fused
kernel (``own_tail``: the new tokens causally, everything before unmasked). The figure is their
ratio in one process, calls interleaved (median of ``--repeats``); the outputs' largest difference
is printed beside it, and the time ``decode_pages`` takes for the case's TQ3 pages (both paths decode
them so). ``x layers`` scales one layer to the model's 30.

    PYTHONPATH=python python benchmark/ops/bench_cpu_extend.py --json docs/results/cpu_extend.json

``OMP_NUM_THREADS=1`` (torch.set_num_threads(1)) by default, as the CPU server runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.fp8 import fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages
from sglang_minima.layers.attention.plan import plan_request
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention
from tqdm import tqdm

HQ, HKV, D, PAGE, LAYERS = 9, 3, 64, 64, 30
KEY_BITS = 4  # the served default
K_SCALE, V_SCALE = 0.05, 0.03
CASES = ((0, 2048), (0, 512), (1536, 512), (4096, 256), (6144, 2048), (8128, 64))
"""(prefix tokens, new tokens): a fresh prompt, later chunks of a long one, a radix hit's question."""


def build(prefix: int, new: int, stale: float, recent: int, seed: int = 0):
    """(q, hot, tq3, rotation) of one request extending ``new`` tokens over ``prefix`` cached ones."""
    g = torch.Generator().manual_seed(seed)
    kv_len = prefix + new
    pages = -(-kv_len // PAGE)
    full_prefix = prefix // PAGE  # sealed pages: the only ones that may be TQ3
    candidates = list(range(1, max(1, full_prefix - recent)))
    stale_pages = set(candidates[: round(stale * len(candidates))])
    fmt = torch.full((pages,), FMT_HOT, dtype=torch.int8)
    fmt[sorted(stale_pages)] = FMT_TQ3
    phys = torch.arange(pages, dtype=torch.int32)  # one pool per format, page i at physical page i
    route = plan_request(torch.arange(kv_len, dtype=torch.int32), fmt, phys, PAGE, q_start=0, q_len=new)
    slots = pages * PAGE
    hot = HotPagedKV(
        fp8_quantize(torch.randn(slots, HKV, D, generator=g) / K_SCALE * 0.3, K_SCALE),
        fp8_quantize(torch.randn(slots, HKV, D, generator=g) / V_SCALE * 0.3, V_SCALE),
        route.hot_slots, route.hot_positions, K_SCALE, V_SCALE,
    )
    layout, codebook = TQ3PageLayout(HKV, PAGE, D, KEY_BITS), key_codebook(D, KEY_BITS)
    rotation = LayerRotation(HKV, D, layer_id=0, seed=0)
    k, v = torch.randn(pages, HKV, PAGE, D, generator=g), torch.randn(pages, HKV, PAGE, D, generator=g)
    tq3 = Tq3PagedKV(encode_pages(k, v, layout, rotation, codebook), route.tq3_pages, layout, codebook,
                     route.tq3_page_starts)
    assert route.own_tokens_hot
    return torch.randn(new, HQ, D, generator=g), hot, tq3, rotation, route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stale", type=float, default=0.75, help="share of the prefix's middle pages that are TQ3")
    ap.add_argument("--recent", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for prefix, new in tqdm(CASES, desc="cases"):
        q, hot, tq3, rotation, route = build(prefix, new, args.stale, args.recent)
        sm = D**-0.5
        masked = lambda: mixed_paged_attention(q, hot, tq3, rotation, sm, route.q_positions)  # noqa: E731
        fused = lambda: mixed_paged_attention(q, hot, tq3, rotation, sm, own_tail=True)  # noqa: E731
        (o1, l1), (o2, l2) = masked(), fused()
        pages = tq3.buffer[tq3.page_ids]
        decode = lambda: decode_pages(pages, tq3.layout, tq3.codebook)  # noqa: E731
        times = {"masked": [], "fused": [], "decode": []}
        for _ in range(args.repeats):
            for name, f in (("masked", masked), ("fused", fused), ("decode", decode)):
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
        rows.append({"prefix": prefix, "new": new, "tq3_pages": route.num_tq3_pages, "hot_tokens": route.num_hot_tokens,
                     "masked_ms": round(ms["masked"], 2), "fused_ms": round(ms["fused"], 2),
                     "speedup": round(ms["masked"] / ms["fused"], 2), "tq3_decode_ms": round(ms["decode"], 2),
                     "max_abs_diff_out": float((o1 - o2).abs().max()), "max_abs_diff_lse": float((l1 - l2).abs().max())})
    lines = [f"| prefix | new | TQ3 pages | hot tokens | masked ms | fused ms | x{LAYERS} layers, masked / fused ms | "
             "speedup | TQ3 decode ms | max diff out / lse |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prefix']} | {r['new']} | {r['tq3_pages']} | {r['hot_tokens']} | {r['masked_ms']} | "
                     f"{r['fused_ms']} | {r['masked_ms'] * LAYERS:.0f} / {r['fused_ms'] * LAYERS:.0f} | "
                     f"**{r['speedup']}x** | {r['tq3_decode_ms']} | {r['max_abs_diff_out']:.1e} / {r['max_abs_diff_lse']:.1e} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": args.threads, "stale": args.stale, "recent": args.recent, "repeats": args.repeats,
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
