"""One picture of bench_capacity.py runs: per arm, output throughput, mean TTFT, mean TPOT and peak
running requests, one group of bars per round (its clients and prompts), same KV byte budget. Where a
run has the stall figure (``itl_stall_share``), the TPOT bar's hatched top is its share in stalls: the
gaps longer than three decode steps, prefill batches run between decode steps (#16 (a): 58-66%).

  python benchmark/serving/plot_capacity.py run8/serving.json run32/serving.json --out capacity.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
          ("mean_tpot_ms", "mean TPOT (ms)"), ("peak_running_requests", "peak running requests"))


def rounds(runs: list[dict]) -> dict[tuple[int, int], dict[str, dict]]:
    """(clients, prompts) -> arm -> result, over every run (runs before rounds existed had one each)."""
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for run in runs:
        for res in run["results"]:
            clients = res["clients"] if "clients" in res else int(run["args"]["max_concurrency"])
            out.setdefault((clients, res.get("num_prompts", 0)), {})[res["arm"]] = res
    return dict(sorted(out.items()))


def tpot_split(res: dict) -> tuple[float, float] | None:
    """(TPOT outside stalls, TPOT in them) in ms: the mean TPOT cut by the stalls' share of the summed
    gaps (exact where every request has the same output length, as bench_capacity's datasets do); None
    for a run without the stall figure."""
    share = res.get("itl_stall_share")
    if share is None or res.get("mean_tpot_ms") is None:
        return None
    return res["mean_tpot_ms"] * (1 - share), res["mean_tpot_ms"] * share


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="JSON files of bench_capacity.py")
    ap.add_argument("--title", help="the figure's title (default: the budget and device)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in args.runs]
    groups = rounds(runs)
    arms = list(dict.fromkeys(arm for by_arm in groups.values() for arm in by_arm))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    width = 0.8 / len(arms)
    for ax, (key, label) in zip(axes, PANELS):
        hatched = False
        for i, arm in enumerate(arms):
            xs = [x + (i - (len(arms) - 1) / 2) * width for x, by_arm in enumerate(groups.values()) if arm in by_arm]
            results = [by_arm[arm] for by_arm in groups.values() if arm in by_arm]
            splits = [tpot_split(r) for r in results] if key == "mean_tpot_ms" else []
            if splits and all(splits):
                bars = ax.bar(xs, [s[0] for s in splits], width, label=arm)
                ax.bar(xs, [s[1] for s in splits], width, bottom=[s[0] for s in splits],
                       color=bars.patches[0].get_facecolor(), alpha=0.45, hatch="//")
                hatched = True
            else:
                ax.bar(xs, [r[key] for r in results], width, label=arm)
        ax.set_xticks(range(len(groups)), [f"{c} clients" + (f"\n{p} prompts" if p else "") for c, p in groups])
        if hatched:
            ax.set_title(label + "\nhatched: in stalls", fontsize=10)
        else:
            ax.set_title(label)
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 1.3)  # room for the legend above the bars
    axes[0].legend(fontsize=8, loc="upper right")
    budget = float(runs[0]["args"]["budget_mib"])  # args are stored as strings
    device = runs[0].get("device", "cpu")
    fig.suptitle(args.title or f"bench_serving, {budget:g} MiB of KV per arm ({device})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
