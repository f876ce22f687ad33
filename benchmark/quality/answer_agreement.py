"""Two NIAH runs' answers side by side, from committed answers (benchmark/quality/niah.py): on the
examples both answered, how many answers are identical and the mean score difference. Run against
itself in another call of the same command, an arm shows how much greedy answers move between
calls (batching and kernel rounding), the floor under any arm-against-arm difference.

  python benchmark/quality/answer_agreement.py --length 1024 \\
      docs/results/quality_h200:fp8@256 docs/results/quality_h200_256b:fp8@256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import niah  # noqa: E402
from pooled_delta import parse_run  # noqa: E402


def agreement(a: dict[str, dict], b: dict[str, dict], length: int | None = None) -> dict:
    """Examples both answered (of ``length``): their count, identical answers, mean score of a - b."""
    keys = sorted(k for k in a if k in b and (length is None or a[k]["length"] == length))
    if not keys:
        raise SystemExit("no example answered in both runs")
    same = sum(a[k]["answer"] == b[k]["answer"] for k in keys)
    diff = sum(a[k]["score"] - b[k]["score"] for k in keys) / len(keys)
    return {"examples": len(keys), "identical": same, "score_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=parse_run, nargs=2, metavar="DIR:ARM@CHUNK")
    ap.add_argument("--length", type=int, help="only examples of this RULER length")
    args = ap.parse_args()
    (da, ra), (db, rb) = args.runs
    r = agreement(niah.load_answers(da, ra), niah.load_answers(db, rb), args.length)
    print(f"{da}:{ra.label} vs {db}:{rb.label}: {r['examples']} examples, {r['identical']} identical answers "
          f"({100 * r['identical'] / r['examples']:.1f}%), mean score difference {r['score_diff']:+.2f} pp")


if __name__ == "__main__":
    main()
