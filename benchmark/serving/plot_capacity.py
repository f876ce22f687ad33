"""One picture of bench_capacity.py runs at several client counts: per arm, output throughput,
mean TTFT and peak running requests, each run's concurrency on the x axis (same KV byte budget).

  python benchmark/serving/plot_capacity.py run8/serving.json run32/serving.json --out capacity.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"), ("peak_running_requests", "peak running requests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="serving.json files of bench_capacity.py")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.runs), key=lambda r: int(r["args"]["max_concurrency"]))
    clients = [int(r["args"]["max_concurrency"]) for r in runs]
    arms = [res["arm"] for res in runs[0]["results"]]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    width = 0.8 / len(arms)
    for ax, (key, label) in zip(axes, PANELS):
        for i, arm in enumerate(arms):
            values = [next(res[key] for res in r["results"] if res["arm"] == arm) for r in runs]
            ax.bar([x + (i - (len(arms) - 1) / 2) * width for x in range(len(runs))], values, width, label=arm)
        ax.set_xticks(range(len(runs)), [f"{c} clients" for c in clients])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    budget = float(runs[0]["args"]["budget_mib"])  # args are stored as strings
    fig.suptitle(f"bench_serving, generated shared prefix, {budget:g} MiB of KV per arm (CPU)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
