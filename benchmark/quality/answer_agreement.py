"""Two NIAH runs' answers side by side, from committed answers (benchmark/quality/niah.py): on the
examples both answered, how many answers are identical and the mean score difference. Run against
itself in another call of the same command, an arm shows how much greedy answers move between
calls (batching and kernel rounding), the floor under any arm-against-arm difference. A run may
also be the emulation's record (benchmark/quality/stale_probe.py ``--out``), named ``RUN.json:MODE``:
how closely the emulation answers what the server answered on the same examples.

  python benchmark/quality/answer_agreement.py --length 1024 \\
      docs/results/quality_h200:fp8@256 docs/results/quality_h200_256b:fp8@256
  python benchmark/quality/answer_agreement.py probe.json:k4@256 docs/results/quality_h200_1k_1304:minima-k4@256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import niah  # noqa: E402
from pooled_delta import parse_run  # noqa: E402


def agreement(a: dict[str, dict], b: dict[str, dict], length: int | None = None, prefix: bool = False) -> dict:
    """Examples both answered (of ``length``): their count, identical answers (with ``prefix``, also
    one answer continuing the other: a run that stopped at a different stop token), equal scores, and
    the mean score of a - b."""
    keys = sorted(k for k in a if k in b and (length is None or a[k]["length"] == length))
    if not keys:
        raise SystemExit("no example answered in both runs")

    def same(x: str, y: str) -> bool:
        return x == y or (prefix and (x.startswith(y) or y.startswith(x)))

    return {
        "examples": len(keys),
        "identical": sum(same(a[k]["answer"], b[k]["answer"]) for k in keys),
        "same_score": sum(a[k]["score"] == b[k]["score"] for k in keys),
        "score_diff": sum(a[k]["score"] - b[k]["score"] for k in keys) / len(keys),
    }


def probe_answers(path: Path, mode: str) -> dict[str, dict]:
    """The emulation's answers of one mode (stale_probe.py's record, complete or cut) keyed as the
    server's: ``task/length/index``."""
    rec = json.loads(Path(path).read_text())
    if mode not in rec["results"]:
        raise SystemExit(f"{path}: no mode {mode!r} (modes: {sorted(rec['results'])})")
    r = rec["results"][mode]
    return {key: {"answer": a, "score": s, "task": key.split("/")[0], "length": int(key.split("/")[1])}
            for key, a, s in zip(rec["examples"], r["answers"], r["scores"])}


def parse_any(spec: str) -> tuple[str, dict[str, dict]]:
    """``DIR:ARM@CHUNK`` (a served run's answers) or ``RUN.json:MODE`` (the emulation's) -> its answers."""
    path, _, label = spec.rpartition(":")
    if path.endswith(".json"):
        return spec, probe_answers(Path(path), label)
    directory, run = parse_run(spec)
    return spec, niah.load_answers(directory, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=parse_any, nargs=2, metavar="DIR:ARM@CHUNK|RUN.json:MODE")
    ap.add_argument("--length", type=int, help="only examples of this RULER length")
    ap.add_argument("--prefix", action="store_true",
                    help="an answer that continues the other counts as identical (the emulation stops at "
                         "the tokenizer's EOS only, the server at every stop token of the model)")
    args = ap.parse_args()
    (na, a), (nb, b) = args.runs
    r = agreement(a, b, args.length, args.prefix)
    print(f"{na} vs {nb}: {r['examples']} examples, {r['identical']} identical answers "
          f"({100 * r['identical'] / r['examples']:.1f}%), {r['same_score']} equal scores, mean score difference {r['score_diff']:+.2f} pp")


if __name__ == "__main__":
    main()
