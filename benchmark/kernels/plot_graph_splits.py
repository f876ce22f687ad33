"""Draw bench_graph_splits.py's sweeps: one layer's fused decode time over FlashInfer FP8's against the
TQ3 split count, a panel per sweep file, a line per batch and context; each line marks the split count
that ``heuristics.graph_splits`` gives today at that batch and context (``rule_splits``, computed here for
the run's geometry and 132 SMs). It also scores today's rule on every swept row (``score``: its time over
the row's best split count, geometric mean and worst), the figure a change of the rule is judged by.

    PYTHONPATH=kernels:python python benchmark/kernels/plot_graph_splits.py a.json b.json --out splits.png
"""

import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from minima_kernels import heuristics  # noqa: E402

PAGE = 64  # bench_graph_splits.py's (bench_decode.PAGE)


def geometry(name: str) -> tuple[int, int, int]:
    """bench_decode's geometry name "32q/8kv/128" as (query heads, kv heads, head dim)."""
    q, kv, d = name.split("/")
    return int(q.removesuffix("q")), int(kv.removesuffix("kv")), int(d)


def rule_splits(run: dict, row: dict, num_sms: int) -> tuple[int, int]:
    """Today's ``graph_splits`` (TQ3, FP8 splits) for a swept row: its batch, captured at its context."""
    hq, h, d = geometry(run["geometry"])
    build = heuristics.tile_config(hq // h, PAGE, d, row["batch"], run["key_bits"])
    return heuristics.graph_splits(row["batch"], h, -(-row["context"] // PAGE), PAGE, build, num_sms, head_dim=d)


def rule_point(row: dict, splits: tuple[int, int]) -> dict | None:
    """The swept point of the rule's ``splits`` in ``row``, None where the sweep lacks it (its points
    have one FP8 split)."""
    tq3, fp8 = splits
    return row["sweep"].get(str(tq3)) if fp8 == 1 else None


def circles(run: dict, num_sms: int) -> list[tuple[int, int, int, float]]:
    """(batch, context, the rule's TQ3 splits, its time over FlashInfer FP8's) for each row of ``run``
    whose rule count was swept: the marks ``main`` draws."""
    out = []
    for row in run["rows"]:
        splits = rule_splits(run, row, num_sms)
        if (point := rule_point(row, splits)) is not None:
            out.append((row["batch"], row["context"], splits[0], point["x_fp8"]))
    return out


def score(runs: list[dict], num_sms: int = 132) -> dict:
    """Today's ``graph_splits`` on every swept row, each at its own captured context: the geometric mean
    and the worst of its time over the row's best swept count, the sums of both times (ms), and the
    rows whose rule count was not swept (left out of the figures)."""
    ratios, worst, rule_ms, best_ms, unswept = [], None, 0.0, 0.0, []
    for run in runs:
        for row in run["rows"]:
            splits = rule_splits(run, row, num_sms)
            case = {"geometry": run["geometry"], "pages": run["pages"], "batch": row["batch"], "context": row["context"],
                    "splits": list(splits)}
            if (point := rule_point(row, splits)) is None:
                unswept.append(case)
                continue
            ms, best = point["ms"], min(r["ms"] for r in row["sweep"].values())
            ratios.append(ms / best)
            rule_ms, best_ms = rule_ms + ms, best_ms + best
            if worst is None or ms / best > worst["x_best"]:
                worst = {**case, "x_best": ms / best}
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    return {"cases": len(ratios), "x_best_geomean": geomean, "worst": worst, "rule_ms": rule_ms, "best_ms": best_ms,
            "unswept": unswept}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="bench_graph_splits.py JSON files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-sms", type=int, default=132)
    args = ap.parse_args()
    runs = [json.load(open(p)) for p in args.runs]
    batches = sorted({r["batch"] for run in runs for r in run["rows"]})
    tab20 = plt.get_cmap("tab20")  # its saturated ten first, then their light pairs
    palette = [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)]]
    color = {b: palette[i % len(palette)] for i, b in enumerate(batches)}  # a batch keeps its colour across panels
    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, run in zip(axes.flat, runs):
        # a line per batch and distinct sweep: a file may hold one sweep at several captured contexts
        # (graph_splits_0446_70p.json: the same pages, so the same times), which only the rule tells apart
        lines: dict[tuple, list[int]] = {}
        for row in run["rows"]:
            sweep = tuple(sorted((int(n), r["x_fp8"]) for n, r in row["sweep"].items()))
            lines.setdefault((row["batch"], sweep), []).append(row["context"])
        several = len({r["context"] for r in run["rows"]}) > 1
        for (batch, sweep), contexts in sorted(lines.items()):
            label = f"{batch} rows" + (f" ({', '.join(f'{c // 1024}K' for c in sorted(contexts))})" if several else "")
            ax.plot([n for n, _ in sweep], [x for _, x in sweep], marker=".", color=color[batch], label=label)
        for batch, _, tq3, x in circles(run, args.num_sms):
            ax.plot([tq3], [x], marker="o", ms=9, mfc="none", color=color[batch])
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
    scored = score(runs, args.num_sms)
    w = scored["worst"] or {}
    print(f"graph_splits today: {scored['x_best_geomean']:.3f}x the best swept count over {scored['cases']} rows "
          f"(worst {w.get('x_best', float('nan')):.2f}x: {w.get('geometry')} {w.get('pages')} pages, {w.get('batch')} rows, "
          f"context {w.get('context')}); {scored['rule_ms']:.2f} ms against {scored['best_ms']:.2f}; "
          f"{len(scored['unswept'])} rows whose count was not swept")


if __name__ == "__main__":
    main()
