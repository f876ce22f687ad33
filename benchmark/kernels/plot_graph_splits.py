"""Draw bench_graph_splits.py's sweeps: one layer's fused decode time over FlashInfer FP8's against the
TQ3 split count, a panel per request length, a line per batch; each line marks the split count that
``heuristics.graph_splits`` gives today (computed here, for the run's geometry and 132 SMs).

    PYTHONPATH=kernels:python python benchmark/kernels/plot_graph_splits.py a.json b.json --out splits.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from minima_kernels import heuristics  # noqa: E402

PAGE = 64  # bench_graph_splits.py's (bench_decode.PAGE)


def geometry(name: str) -> tuple[int, int, int]:
    """bench_decode's geometry name "32q/8kv/128" as (query heads, kv heads, head dim)."""
    q, kv, d = name.split("/")
    return int(q.removesuffix("q")), int(kv.removesuffix("kv")), int(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="bench_graph_splits.py JSON files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-sms", type=int, default=132)
    args = ap.parse_args()
    runs = [json.load(open(p)) for p in args.runs]
    batches = sorted({r["batch"] for run in runs for r in run["rows"]})
    color = {b: f"C{i % 10}" for i, b in enumerate(batches)}  # a batch keeps its colour across panels
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        hq, h, d = geometry(run["geometry"])
        max_pages = -(-max(r["context"] for r in run["rows"]) // PAGE)  # the rule's captured context
        for row in sorted({r["batch"]: r for r in run["rows"]}.values(), key=lambda r: r["batch"]):
            sweep = sorted((int(n), r["x_fp8"]) for n, r in row["sweep"].items())
            c = color[row["batch"]]
            ax.plot([n for n, _ in sweep], [x for _, x in sweep], marker=".", color=c, label=f"{row['batch']} rows")
            build = heuristics.tile_config(hq // h, PAGE, d, row["batch"], run["key_bits"])
            tq3, fp8 = heuristics.graph_splits(row["batch"], h, max_pages, PAGE, build, args.num_sms, head_dim=d)
            if fp8 == 1 and str(tq3) in row["sweep"]:  # the sweep's points have one FP8 split
                ax.plot([tq3], [row["sweep"][str(tq3)]["x_fp8"]], marker="o", ms=9, mfc="none", color=c)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("TQ3 splits per (request, kv head)")
        ax.set_ylabel("time / FlashInfer FP8's")
        gpu = run["gpu"].split(" ")[1]  # "NVIDIA H100 80GB HBM3": H100
        ax.set_title(f"{run['geometry']}, {run['pages']} pages ({run['fp8_pages']} FP8), {gpu}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("CUDA graph's fused decode, one layer, by TQ3 split count (circles: graph_splits' choice where swept)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
