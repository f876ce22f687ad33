"""Where the needles sat: an arm's paired NIAH difference split by the tier of the page holding each
example's farthest needle, from committed answers (benchmark/quality/niah.py). #17 asks which tier
carries the loss; a Stale page is read through TQ3, a sink or Recent page through FP8, so the split
says whether a loss follows the needles into TQ3 pages, and how far from the question they sat.

The tiers are a policy's on the prompt's own pages (``--sink-pages`` first pages, the last
``--recent-pages``, Stale between), counted where the answer's first token sits in the prompt (the
tokenizer's offsets, ``--page-size`` tokens a page). The few tokens a request decodes can move the
Recent window by a page: the split is the prompt's, not the decode's last step. "Farthest" is the
needle on the earliest page, the one the question must reach back to. Each ``--run`` is paired
with ``--reference`` at the same chunk in the same directory; runs over the same examples are
replicates, put together here (each run's examples counted), so the intervals are descriptive.

  python benchmark/quality/needle_tiers.py --reference fp8 --length 1024 \\
      --run docs/results/quality_h200:minima-k4@default --run docs/results/quality_h200_1k_1304:minima-k4@256
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import niah  # noqa: E402
from pooled_delta import paired, parse_run  # noqa: E402
from ruler_data import TASKS, generate  # noqa: E402

TIERS = ("sink", "page after the sinks", "stale", "recent", "not in the prompt")


def needle_pages(offsets: Sequence[tuple[int, int]], prompt: str, outputs: Sequence[str], page_size: int) -> list[int]:
    """Pages (of ``page_size`` tokens) holding each expected answer's first token in ``prompt``;
    ``offsets`` are the tokenizer's (start, end) characters per token. An answer not found verbatim
    in the prompt has no page."""
    pages = []
    for out in outputs:
        at = prompt.find(out)
        if at >= 0:
            token = next(i for i, (_, end) in enumerate(offsets) if end > at)
            pages.append(token // page_size)
    return sorted(pages)


def tier(pages: Sequence[int], num_tokens: int, page_size: int, sink_pages: int, recent_pages: int) -> str:
    """The tier of the earliest of ``pages`` in a prompt of ``num_tokens`` tokens: a sink page, the
    first page after the sinks (the farthest Stale page from the question), another Stale page, or
    one of the last ``recent_pages``."""
    if not pages:
        return "not in the prompt"
    first, last_page = pages[0], (num_tokens - 1) // page_size
    if first < sink_pages:
        return "sink"
    if first > last_page - recent_pages:
        return "recent"
    return "page after the sinks" if first == sink_pages else "stale"


def example_tiers(lengths: Sequence[int], n: int, page_size: int, sink_pages: int, recent_pages: int) -> dict[str, str]:
    """Example key -> the tier of its farthest needle, for RULER's eight tasks at ``lengths``, ``n``
    examples each (the examples niah.py sent: same generator, same seed)."""
    from transformers import AutoTokenizer

    from sglang_minima.models import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    out = {}
    for length in lengths:
        for task in TASKS:
            for ex in generate(task, length, n, default_model_dir()):
                offsets = tok(ex.prompt, return_offsets_mapping=True)["offset_mapping"]
                pages = needle_pages(offsets, ex.prompt, ex.outputs, page_size)
                out[ex.key] = tier(pages, len(offsets), page_size, sink_pages, recent_pages)
    return out


def split(diffs: Sequence[tuple[str, float]], resamples: int) -> dict[str, dict]:
    """(tier, paired difference) per example -> per tier: examples, mean difference and its bootstrap
    95% interval (examples resampled)."""
    import numpy as np

    rng = np.random.default_rng(0)
    by: dict[str, list[float]] = {}
    for name, d in diffs:
        by.setdefault(name, []).append(d)
    out = {}
    for name in TIERS:
        if name in by:
            d = np.asarray(by[name])
            boot = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
            out[name] = {"examples": len(d), "mean": float(d.mean()),
                         "ci95": (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=parse_run, action="append", required=True, metavar="DIR:ARM@CHUNK")
    ap.add_argument("--reference", default="fp8")
    ap.add_argument("--length", type=int, action="append", required=True,
                    help="RULER lengths to split (repeat the flag for several)")
    ap.add_argument("--n", type=int, default=64, help="examples per task and length the runs were given (niah.py --n)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--sink-pages", type=int, default=1,
                    help="where the split puts the sinks: 1, the policy until 2026-12-05, so that the page the "
                    "defaults now keep as a second sink is a tier of its own")
    ap.add_argument("--recent-pages", type=int, default=4)
    ap.add_argument("--bootstrap", type=int, default=5000)
    args = ap.parse_args()
    tiers = example_tiers(args.length, args.n, args.page_size, args.sink_pages, args.recent_pages)
    every: list[tuple[str, float]] = []
    print(f"Paired Δ vs {args.reference} by the tier of the farthest needle's page [bootstrap 95% CI] (examples)\n")
    print(f"| run | length | {' | '.join(TIERS)} |\n|---|---|" + "---|" * len(TIERS))
    for length in args.length:
        for d, run in args.run:
            diffs = [(tiers[k], v) for k, (_, v) in paired(d, run, args.reference, length).items()]
            every += diffs
            cells = split(diffs, args.bootstrap)
            print(f"| {d.name}:{run.label} | {length} | " + " | ".join(_cell(cells.get(t)) for t in TIERS) + " |")
    cells = split(every, args.bootstrap)
    print(f"| all {len(args.run)} runs | {', '.join(map(str, args.length))} | "
          + " | ".join(_cell(cells.get(t)) for t in TIERS) + " |")


def _cell(c: dict | None) -> str:
    return "-" if c is None else f"{niah.fmt_diff(c['mean'], c['ci95'])} ({c['examples']})"


if __name__ == "__main__":
    main()
