"""What small prefill chunks cost an arm beyond what it costs at the default chunk, from committed
NIAH answers (benchmark/quality/niah.py): on the examples both chunk sizes answered for the arm and
its reference, the paired difference (arm - reference at the small chunk) - (arm - reference at the
default chunk), with a bootstrap interval over examples, overall and per task.

At the default chunk a prompt of up to 8K tokens is prefilled at once, so only decode reads its Stale
pages; at a small chunk its later chunks read them too. The excess is that second cost, if the two
runs' noise allows (answers from different calls differ on a few percent of examples).

  python benchmark/quality/chunk_excess.py --arm minima-k4 --default-dir docs/results/quality_h200 \\
      --small-dir docs/results/quality_h200_256b --small-chunk 256
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import niah  # noqa: E402


def excess(default_dir: Path, small_dir: Path, arm: str, reference: str, small_chunk: str) -> dict[str, list[float]]:
    """Per task (and "all"): each shared example's (arm - ref)@small - (arm - ref)@default."""
    runs = [niah.load_answers(d, niah.Run(a, c)) for d, c in ((default_dir, "default"), (small_dir, small_chunk))
            for a in (arm, reference)]
    keys = sorted(set.intersection(*(set(r) for r in runs)))
    out: dict[str, list[float]] = defaultdict(list)
    for k in keys:
        a_def, r_def, a_small, r_small = (r[k]["score"] for r in runs)
        e = (a_small - r_small) - (a_def - r_def)
        out["all"].append(e)
        out[runs[0][k]["task"]].append(e)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", required=True)
    ap.add_argument("--reference", default="fp8")
    ap.add_argument("--default-dir", type=Path, required=True)
    ap.add_argument("--small-dir", type=Path, required=True)
    ap.add_argument("--small-chunk", default="256")
    ap.add_argument("--bootstrap", type=int, default=5000)
    args = ap.parse_args()
    rows = excess(args.default_dir, args.small_dir, args.arm, args.reference, args.small_chunk)
    if not rows:
        raise SystemExit("no example was answered by both arms at both chunk sizes")
    print(f"{args.arm} vs {args.reference}: excess at chunk {args.small_chunk} over the default chunk (pp)")
    for task, diffs in sorted(rows.items(), key=lambda kv: kv[0] != "all"):
        lo, hi = niah.bootstrap_ci(diffs, args.bootstrap, 0)
        print(f"  {task}: {sum(diffs) / len(diffs):+.1f} [{lo:+.1f}, {hi:+.1f}] (n={len(diffs)})")


if __name__ == "__main__":
    main()
