"""An arm's NIAH pace on the device, from committed answers (benchmark/quality/niah.py): examples a
second for one process and its server, per length, and the seconds an arm of a planned call needs over
``--processes`` of them (run_suite.sh's NIAH_SHARDS; the server starts and the warm-up not counted).

A process sends a group of ``--concurrency`` examples at once and starts the next group when the
slowest answer is back, so a group's wall time is its slowest answer's ``seconds``, and a process's
pace is its examples over the sum of its groups' walls (for that many in flight: the largest group is
printed). The process with the most of the eight tasks (niah_shards.py's split, ceil(8 / processes))
sets a length's seconds: that many tasks times ``--n`` examples at the pace.
The paces were measured beside other arms' servers on the same GPU and CPUs; a plan with more servers
side by side than the measured call had may run slower.

  python benchmark/quality/niah_pace.py --n 64 --processes 4 \\
      --run docs/results/quality_h200_256eq_1749:minima-default-eqbytes@256 \\
      --run docs/results/quality_h200_256eq_1749:fp8@256
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import niah  # noqa: E402
import niah_shards  # noqa: E402
import pooled_delta  # noqa: E402


def paces(directory: Path, run: niah.Run) -> dict[int, tuple[int, float, int]]:
    """Length -> (examples, process-seconds, the largest group): each group's examples and its slowest
    answer's seconds. Every record counts (not one a key, as the report's load_answers keeps)."""
    answers = [json.loads(line) for line in niah.answer_lines(niah.answers_path(directory, run))]
    if not answers:
        raise SystemExit(f"--run {directory}:{run.label}: no answers at {niah.answers_path(directory, run)}[.gz]")
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in answers:
        if "group" not in r:  # answers from before 2026-12-03 name no group: their walls are unknown
            raise SystemExit(f"--run {directory}:{run.label}: its answers name no group (written before niah.py "
                             "recorded one), so the groups' wall times cannot be told apart")
        groups[r["group"]].append(r)
    out: dict[int, list] = defaultdict(lambda: [0, 0.0, 0])
    for rows in groups.values():
        cell = out[rows[0]["length"]]
        cell[0] += len(rows)
        cell[1] += max(r["seconds"] for r in rows)
        cell[2] = max(cell[2], len(rows))  # the pace holds for this many in flight (niah.py's --concurrency)
    return {length: (n, s, g) for length, (n, s, g) in sorted(out.items())}


def phase_seconds(examples_per_second: float, n: int, processes: int) -> float:
    """Seconds for one length's ``n`` examples a task over ``processes`` processes at this pace: the
    process with the most tasks (niah_shards.py's split) sets them."""
    return max(map(len, niah_shards.shares(processes))) * n / examples_per_second


def markdown(rows: list[dict], n: int, processes: int) -> str:
    head = (f"| run | length | examples | in flight | examples/s a process | seconds for {n} a task over {processes} "
            "process(es) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['length']} | {r['examples']} | {r['in_flight']} | {r['pace']:.2f} | "
                     f"{r['seconds']:.0f} |")
    totals: dict[str, float] = defaultdict(float)
    for r in rows:
        totals[r["run"]] += r["seconds"]
    lines += [f"| {run} | all | | | | **{s:.0f}** |" for run, s in totals.items()
              if sum(r["run"] == run for r in rows) > 1]  # a run of one length: its row is the total
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, type=pooled_delta.parse_run,
                    help="DIR:ARM@CHUNK, a committed niah.py output directory and one of its runs (repeat)")
    ap.add_argument("--n", type=int, default=64, help="examples a task and length in the planned call")
    ap.add_argument("--processes", type=int, default=1, help="processes the arm runs over (NIAH_SHARDS)")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="only these lengths (comma-separated)")
    args = ap.parse_args(argv)
    if args.processes < 1 or args.n < 1:
        ap.error("--processes and --n: 1 or more")
    rows = []
    for directory, run in args.run:
        for length, (n, seconds, in_flight) in paces(directory, run).items():
            if args.lengths and length not in args.lengths:
                continue
            pace = n / seconds
            rows.append({"run": f"{directory.name}:{run.label}", "length": length, "examples": n,
                         "in_flight": in_flight, "pace": pace, "seconds": phase_seconds(pace, args.n, args.processes)})
    print(markdown(rows, args.n, args.processes))
    return rows


if __name__ == "__main__":
    main()
