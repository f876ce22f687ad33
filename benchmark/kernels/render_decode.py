"""Render a saved bench_decode.py run (no GPU needed): markdown tables for docs/results/kernels.md
and a PNG of Minima's speed-up over FlashInfer FP8 against context length.

    python benchmark/kernels/render_decode.py docs/results/kernels_h200.json --plot docs/results/kernels_speedup.png \
        --plot-fp8 docs/results/kernels_fp8_kernel.png
"""

import argparse
import json

ROOFLINE_TBPS = 4.2


def library_ms(row: dict) -> float:
    """The library's time for a row: its annotated choice where the run has one, else as run."""
    return row.get("library_ms", row["minima_ms"])


def flashinfer_fp8_ms(row: dict) -> float:
    """FlashInfer FP8, the faster of its two timings in the run (before and after Minima's)."""
    return min(row["flashinfer_fp8_ms"], row.get("flashinfer_fp8_after_ms", row["flashinfer_fp8_ms"]))


def previous_ms(row: dict) -> float | None:
    """The two-launch path the library's "auto" took before the fused decode, where the run timed it."""
    kernel = row.get("fp8_kernel_previous_auto")
    return row.get(f"minima_{kernel}_fp8_ms") if kernel else None


def print_markdown(result: dict) -> None:
    """The decode table and the variant table as markdown (docs/results/kernels.md)."""
    print(
        "| geometry | B | ctx | Stale | FI BF16 ms | FI FP8 ms | Minima ms | x FI FP8 | path | before: ms (x) | FI FP8 TB/s "
        "| Minima TB/s (% roofline) | TQ3 kernel TB/s | TQ3 % roofline | splits TQ3 / FP8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["decode"]:
        if "skipped" in r:
            continue
        tq3 = f"{r['tq3_kernel_tbps']:.2f} | {100 * r['tq3_roofline_frac']:.1f}%" if "tq3_kernel_tbps" in r else "- | -"
        fi, ms, prev = flashinfer_fp8_ms(r), library_ms(r), previous_ms(r)
        before = f"{prev:.3f} ({fi / prev:.2f})" if prev else "-"
        path = r.get("library_path", "fused" if r["stale"] > 0 else "FlashInfer")
        splits = "/".join(str(s) for s in r.get("fused_splits", [r["num_splits"]])) if path == "fused" else str(r.get("tq3_alone_splits", r["num_splits"]))
        tbps = r["minima_bytes"] / ms / 1e9
        print(
            f"| {r['geom']} | {r['batch']} | {r['ctx'] // 1024}K | {r['stale']:.2f} | {r['flashinfer_bf16_ms']:.3f} | "
            f"{fi:.3f} | {ms:.3f} | {fi / ms:.2f} | {path} | {before} | "
            f"{r['flashinfer_fp8_tbps']:.2f} | {tbps:.2f} ({100 * tbps / ROOFLINE_TBPS:.0f}%) | {tq3} | {splits} |"
        )
    print()
    print_breakdown(result)
    print()
    print("| geometry | variant | ms | TB/s | % roofline | splits |")
    print("|---|---|---|---|---|---|")
    for r in result.get("tq3_variants", []):
        if "error" in r:
            print(f"| {r['geom']} | {r['variant']} | not run: {r['error'][:80]} | | | |")
            continue
        print(f"| {r['geom']} | {r['variant']} | {r['ms']:.3f} | {r['tbps']:.2f} | {100 * r['roofline_frac']:.1f}% | {r['splits']} |")


def print_breakdown(result: dict, stale: float = 0.75) -> None:
    """Where the mixed decode's time goes at one Stale fraction: each part alone (microseconds)."""
    print(
        "| geometry | B | ctx | Minima (auto) | with FI FP8 part / TileLang FP8 part | TQ3 kernel + split combine "
        "| FP8 part: FlashInfer / TileLang | glue (rotate q, epilogue) | Minima with FI, one stream | FI FP8 all pages, before / after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["decode"]:
        if "skipped" in r or r["stale"] != stale or "fp8_part_flashinfer_ms" not in r:
            continue
        print(
            f"| {r['geom']} | {r['batch']} | {r['ctx'] // 1024}K | {1e3 * r['minima_ms']:.1f} | "
            f"{1e3 * r['minima_flashinfer_fp8_ms']:.1f} / {1e3 * r['minima_tilelang_fp8_ms']:.1f} | {1e3 * r['tq3_kernel_ms']:.1f} | "
            f"{1e3 * r['fp8_part_flashinfer_ms']:.1f} / {1e3 * r['fp8_part_tilelang_ms']:.1f} | {1e3 * r['glue_ms']:.1f} | {1e3 * r['minima_serial_ms']:.1f} | "
            f"{1e3 * r['flashinfer_fp8_ms']:.1f} / {1e3 * r['flashinfer_fp8_after_ms']:.1f} |"
        )


def plot_speedup(result: dict, path: str) -> None:
    """Minima mixed decode over FlashInfer FP8 vs context, one panel per geometry, a line per
    (batch, Stale fraction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["decode"] if "skipped" not in r and r["stale"] > 0]
    geoms = list(dict.fromkeys(r["geom"] for r in rows))
    fig, axes = plt.subplots(1, len(geoms), figsize=(5 * len(geoms), 4), sharey=True)
    for ax, geom in zip(axes, geoms):
        for batch in sorted({r["batch"] for r in rows}):
            for stale, style in ((0.75, "-"), (0.9, ":")):
                pts = sorted(
                    (r["ctx"], flashinfer_fp8_ms(r) / library_ms(r))
                    for r in rows
                    if r["geom"] == geom and r["batch"] == batch and r["stale"] == stale
                )
                if pts:
                    ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], style, marker="o", label=f"B={batch}, Stale {stale:.0%}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.5, color="red", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_title(geom)
    axes[0].set_ylabel("speed-up over FlashInfer FP8 decode")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"Minima mixed FP8/TQ3 decode vs FlashInfer FP8, {result['gpu']}, {result['date']} (red: 1.5x target)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_fp8_kernels(result: dict, path: str) -> None:
    """The mixed decode with the TileLang FP8 part over the one with FlashInfer's, against the batch's
    FP8 tokens per kv head, one series per geometry, with ``auto``'s thresholds (heuristics.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    page_size = result["page_size"]
    # auto's thresholds by head dim, as the run had them (heuristics.TILELANG_FP8_MAX_TOKENS)
    by_dim = {int(d): t for d, t in result.get("tilelang_fp8_max_tokens", {}).items()}
    thresholds = {geom: by_dim[int(geom.split("/")[-1])] for geom in {r["geom"] for r in result["decode"]} if int(geom.split("/")[-1]) in by_dim}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, geom in enumerate(dict.fromkeys(r["geom"] for r in result["decode"])):
        pts = sorted(
            (r["batch"] * round((1 - r["stale"]) * r["ctx"] / page_size) * page_size, r["minima_flashinfer_fp8_ms"] / r["minima_tilelang_fp8_ms"])
            for r in result["decode"]
            if r.get("geom") == geom and "minima_tilelang_fp8_ms" in r
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=f"C{i}", label=geom, alpha=0.8)
        if geom in thresholds:
            ax.axvline(thresholds[geom], color=f"C{i}", ls=":", lw=1)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("FP8 tokens per kv head in the batch")
    ax.set_ylabel("mixed decode time, FlashInfer FP8 part / TileLang FP8 part")
    ax.set_title(f"Which FP8 kernel: above 1 the TileLang one is faster (dotted: auto's thresholds)\n{result['gpu']}, {result['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", help="the --out file of bench_decode.py")
    ap.add_argument("--plot", help="write the speed-up PNG here")
    ap.add_argument("--plot-fp8", help="write the FP8-kernel comparison PNG here")
    args = ap.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    print_markdown(result)
    if args.plot:
        plot_speedup(result, args.plot)
    if args.plot_fp8:
        plot_fp8_kernels(result, args.plot_fp8)


if __name__ == "__main__":
    main()
