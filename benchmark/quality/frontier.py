"""#17's frontier: each policy's NIAH difference against FP8 against the KV bytes its attention read
per token, one point per policy, pooled over every committed run that measured it
(benchmark/quality/niah.py's answers). A single run's niah_frontier.png holds only that call's arms;
the policies were measured in different calls, each beside its own FP8 arm, and this puts them on
one figure without pairing across calls.

A point is ``LABEL=DIR:ARM@CHUNK[,DIR:ARM@CHUNK...]``. Its Δ is pooled_delta.py's ``--mixed``
macro: each example's difference against the reference of its own run, averaged over the runs that
answered it, then the mean over tasks, with a bootstrap interval over examples within each task. Its
bytes are the KV bytes per attended token and layer of all its runs together (the route counters'
FP8 and TQ3 token reads, each run's codec layout). Points of one figure should cover the same
lengths: the figure says which each covers, and a macro over other lengths is another quantity. The
two axes weigh examples differently: Δ gives every task of a length the same weight, the bytes are
per attended token, so long prompts weigh more there (the defaults' four runs: 212 bytes by tokens,
about 228 by examples).

  python benchmark/quality/frontier.py --out docs/results/quality_frontier_default.png \\
      --point "FP8 pages only=docs/results/quality_h200_arms_1754:minima-nostale@default" \\
      --point "aggressive=docs/results/quality_h200_arms_1754:minima-default-aggressive-eqbytes@default"
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import niah  # noqa: E402
import pooled_delta  # noqa: E402


@dataclass(frozen=True)
class Point:
    label: str
    runs: tuple[tuple[Path, niah.Run], ...]


def parse_point(spec: str) -> Point:
    label, sep, runs = spec.partition("=")
    if not sep or not label or not runs:
        raise argparse.ArgumentTypeError(f"--point {spec!r}: give LABEL=DIR:ARM@CHUNK[,DIR:ARM@CHUNK...]")
    return Point(label, tuple(pooled_delta.parse_run(r) for r in runs.split(",")))


def run_bytes(directory: Path, run: niah.Run) -> tuple[float | None, int]:
    """(KV bytes per attended token and layer, attended tokens) of one run, from its answers' route
    counters (once per group) and its niah.json's model facts; a run that does not convert reads FP8
    or the model dtype whatever it attended (0 tokens: it weighs nothing in a mix)."""
    meta = json.loads((directory / "niah.json").read_text())["meta"]["args"]
    groups = list(niah.group_routes(niah.load_answers(directory, run)).values())
    return niah.attended_bytes(run.arm, groups, tuple(meta["geometry"]), meta["page_size"], meta["dtype"],
                               meta.get("server_args") or "")


def measure(point: Point, reference: str, resamples: int) -> dict:
    for d, run in point.runs:  # a misspelt run would add nothing and still count as one of the point's
        if not (d / "niah.json").exists():
            raise SystemExit(f"--point {point.label!r}: {d} holds no niah.json (not a niah.py run)")
        if run.arm not in niah.ARMS:
            raise SystemExit(f"--point {point.label!r}: {run.arm!r} is not a niah.py arm")
    diffs = [pooled_delta.paired(d, run, reference, None) for d, run in point.runs]
    for (d, run), paired in zip(point.runs, diffs):
        if not paired:
            raise SystemExit(f"--point {point.label!r}: {d}:{run.label} has no example answered beside "
                             f"{reference}@{run.chunk} (check the arm and the chunk)")
    r = pooled_delta.averaged(diffs, resamples)
    per_run = [run_bytes(d, run) for d, run in point.runs]
    known = [(b, t) for b, t in per_run if b is not None]
    tokens = sum(t for _, t in known)
    if not known:
        bpt = None
    elif tokens:
        bpt = sum(b * t for b, t in known) / tokens
    else:  # arms that do not convert: one fixed figure
        bpt = known[0][0]
    lengths = sorted({int(k.rsplit("/", 2)[1]) for d in diffs for k in d})  # keys are task/length/index
    worst = min(r["per_task"].items(), key=lambda kv: kv[1][0])
    return {"label": point.label, "runs": [f"{d}:{run.label}" for d, run in point.runs],
            "minima": any(niah.ARMS[run.arm].is_minima for _, run in point.runs),
            "examples": r["examples"], "lengths": lengths, "chunks": sorted({run.chunk for _, run in point.runs}),
            "diff_vs_ref": r["pooled"], "diff_ci95": list(r["ci95"]), "bytes_per_token": bpt,
            "worst_task": {"task": worst[0], "diff": worst[1][0], "ci95": list(worst[1][1])}}


def markdown(points: list[dict], reference: str) -> str:
    lines = [f"| point | runs | examples | lengths | Δ vs {reference} [95% CI] | KV bytes / attended token | worst task |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        w = p["worst_task"]
        bpt = "-" if p["bytes_per_token"] is None else f"{p['bytes_per_token']:.0f}"
        lines.append(f"| {p['label']} | {len(p['runs'])} | {p['examples']} | {', '.join(str(n) for n in p['lengths'])} | "
                     f"{p['diff_vs_ref']:+.2f} [{p['diff_ci95'][0]:+.2f}, {p['diff_ci95'][1]:+.2f}] | {bpt} | "
                     f"`{w['task']}` {w['diff']:+.2f} [{w['ci95'][0]:+.2f}, {w['ci95'][1]:+.2f}] |")
    return "\n".join(lines) + "\n"


def spread_labels(anchors: list[tuple[float, float]], widths: list[float], gap: float) -> list[float]:
    """Heights for labels whose left edges and heights are ``anchors`` (all in points, the figure's
    unit): labels are placed from the lowest anchor up, each at its own height unless a label already
    placed that it overlaps sideways is within ``gap`` of it; then just above that one. (adjustText
    does this in general, but pulls in scipy for it.)"""
    heights = [0.0] * len(anchors)
    placed: list[int] = []
    for i in sorted(range(len(anchors)), key=lambda i: anchors[i][1]):
        x, y = anchors[i]
        for j in sorted(placed, key=lambda j: heights[j]):
            side = anchors[j][0] - x
            if -widths[j] < side < widths[i] and heights[j] - gap < y < heights[j] + gap:
                y = heights[j] + gap
        heights[i] = y
        placed.append(i)
    return heights


def plot(points: list[dict], path: Path, reference: str, reference_bytes: float | None, title: str,
         target: float | None) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Affine2D

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    shown = [p for p in points if p["bytes_per_token"] is not None]
    for p in shown:
        d, (lo, hi) = p["diff_vs_ref"], p["diff_ci95"]
        ax.errorbar(p["bytes_per_token"], d, yerr=[[d - lo], [hi - d]], fmt="o", capsize=3,
                    color="tab:blue" if p["minima"] else "tab:gray")
    ax.axhline(0, color="black", lw=0.6)
    if reference_bytes is not None:  # the reference itself: Δ 0 at its own bytes
        ax.plot(reference_bytes, 0, "x", color="black")
        ax.annotate(reference, (reference_bytes, 0), textcoords="offset points", xytext=(6, -12), fontsize=8)
    if target is not None:
        ax.axhline(target, color="tab:red", lw=0.8, ls="--", label=f"target {target:+.1f} pp")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("KV bytes per attended token and layer"
                  + ("" if reference_bytes is None else f" ({reference}: {reference_bytes:.0f})"))
    ax.set_ylabel(f"RULER NIAH macro Δ vs {reference} (pp, 95% CI)")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    # Policies a few bytes apart would print their names over each other: stack the names upward,
    # each with a line to its point where it moved, a name that would leave the axes on its point's
    # left. Positions in points on the final layout, so the names stay out of it.
    to_points = ax.transData + Affine2D().scale(72 / fig.dpi)
    right = ax.get_window_extent().x1 * 72 / fig.dpi
    points_at = [to_points.transform((p["bytes_per_token"], p["diff_vs_ref"])) for p in shown]
    widths = [4.4 * len(p["label"]) + 6 for p in shown]
    lefts = [x + 6 if x + 6 + w <= right else x - 6 - w for (x, _), w in zip(points_at, widths)]
    heights = spread_labels([(left, y) for left, (_, y) in zip(lefts, points_at)], widths, gap=11)
    for p, (x, y), left, h in zip(shown, points_at, lefts, heights):
        line = None if h == y else dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=0, shrinkB=3)
        name = ax.annotate(p["label"], (p["bytes_per_token"], p["diff_vs_ref"]), textcoords="offset points",
                           xytext=(left - x, h - y), fontsize=8, va="center", arrowprops=line)
        name.set_in_layout(False)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", type=parse_point, action="append", required=True, metavar="LABEL=DIR:ARM@CHUNK[,...]")
    ap.add_argument("--reference", default="fp8")
    ap.add_argument("--out", type=Path, required=True, help="the PNG; its .json and .md beside it")
    ap.add_argument("--title", default="RULER NIAH against KV bytes read, paired with FP8 in each run's own call")
    ap.add_argument("--target", type=float, default=-1.0, help="#17's line, drawn dashed (pp)")
    ap.add_argument("--bootstrap", type=int, default=5000)
    args = ap.parse_args(argv)
    points = [measure(p, args.reference, args.bootstrap) for p in args.point]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(points, args.reference)
    args.out.with_suffix(".json").write_text(json.dumps({"reference": args.reference, "points": points}, indent=1))
    args.out.with_suffix(".md").write_text(md)
    # the reference's own bytes, from the first run's directory (a converting reference: that run's figure)
    directory, first = args.point[0].runs[0]
    plot(points, args.out, args.reference, run_bytes(directory, niah.Run(args.reference, first.chunk))[0],
         args.title, args.target)
    print(md)
    return points


if __name__ == "__main__":
    main()
