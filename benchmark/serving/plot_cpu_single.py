"""One picture of bench_cpu_single.py runs at several context lengths: per arm, the median decode
tok/s and TTFT of a single request, each run's prompt length on the x axis.

  python benchmark/serving/plot_cpu_single.py run2k.json run6k.json --out cpu_single.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("decode_tok_s_median", "decode tok/s (median)"), ("ttft_s_median", "TTFT of the repeated prompt, s (median)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="--json files of bench_cpu_single.py")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.runs), key=lambda r: r["prompt_tokens"])
    arms = list(runs[0]["summary"])
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.6 * len(PANELS), 3.6))
    width = 0.8 / len(arms)
    for ax, (key, label) in zip(axes, PANELS):
        for i, arm in enumerate(arms):
            values = [r["summary"][arm][key] for r in runs]
            xs = [x + (i - (len(arms) - 1) / 2) * width for x in range(len(runs))]
            ax.bar(xs, values, width, label=arm)
            if key == "decode_tok_s_median":
                for x, v in zip(xs, values):
                    ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(runs)), [f"{r['prompt_tokens']} tokens" for r in runs])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"one request on CPU, {runs[0]['new_tokens']} greedy tokens (bench_cpu_single.py)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
