"""One arm's paired difference against its reference, pooled over replicate NIAH runs, from committed
answers (benchmark/quality/niah.py): on the examples every run answered for both, each example's
difference averaged over the runs, then the macro over tasks, with a bootstrap interval that
resamples examples within each task. Greedy answers differ between calls on a few percent of
examples; averaging replicates shrinks that noise where one run's interval cannot.

Each ``--run`` is ``DIR:ARM@CHUNK``; the reference is ``--reference`` at the same chunk in the same
directory (so every difference is paired within its own call). With ``--disjoint`` the runs hold
different examples (other lengths, other calls): their paired differences are put together, an
example answered by two runs counted once (the first run's), instead of averaged over replicates.
With ``--mixed`` the runs are both: each example's difference is averaged over every run that
answered it (replicates where runs share examples, the others added), e.g. a grid of lengths with
more calls at some lengths than at others. With ``--against`` (runs of another policy, from other
calls) it prints the first policy's difference from the second, example by example: each side's
differences against its own calls' reference averaged as ``--mixed`` does, then subtracted.

  python benchmark/quality/pooled_delta.py --reference fp8 --length 1024 \\
      --run docs/results/quality_h200:minima-nostale@256 --run docs/results/quality_h200_256b:minima-nostale@256 \\
      --run docs/results/quality_h200_256c:minima-k4-recent16@256
  python benchmark/quality/pooled_delta.py --reference minima-k4 --disjoint \\
      --run docs/results/quality_h200_1k_1304:minima-k4-defer@256 --run docs/results/quality_h200_2k8k_1640:minima-k4-defer@256
  python benchmark/quality/pooled_delta.py --reference fp8 --mixed \\
      --run docs/results/quality_h100_sink_1105:minima-k4-defer-sink2@default --run docs/results/quality_h100_2k_0739:minima-default@default ...
  python benchmark/quality/pooled_delta.py --reference fp8 \\
      --run docs/results/quality_h100_frontier_2254:minima-default-recent8-eqbytes@default \\
      --against docs/results/quality_h100_eqbytes_2k_1355:minima-default-eqbytes@default --against ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import niah  # noqa: E402


def parse_run(spec: str) -> tuple[Path, niah.Run]:
    directory, _, label = spec.rpartition(":")
    arm, _, chunk = label.partition("@")
    if not directory or not arm or not chunk:
        raise argparse.ArgumentTypeError(f"--run {spec!r}: give DIR:ARM@CHUNK, e.g. docs/results/quality_h200:minima@256")
    return Path(directory), niah.Run(arm, chunk)


def paired(directory: Path, run: niah.Run, reference: str, length: int | None) -> dict[str, tuple[str, float]]:
    """Example key -> (task, arm score - reference score) over the examples both answered."""
    got = niah.load_answers(directory, run)
    ref = niah.load_answers(directory, niah.Run(reference, run.chunk))
    return {k: (r["task"], r["score"] - ref[k]["score"]) for k, r in got.items()
            if k in ref and (length is None or r["length"] == length)}


def by_task(tasks: list[str], per_task: list[list[float]], resamples: int, seed: int) -> dict[str, tuple]:
    """Each task's mean difference and bootstrap 95% interval (examples resampled within it): #17's
    "no task worse than 3 pp with its interval excluding zero"."""
    return {t: (niah.macro_diff([d]), niah.macro_ci([d], resamples, seed)) for t, d in zip(tasks, per_task) if d}


def pooled(runs: list[dict[str, tuple[str, float]]], resamples: int, seed: int = 0) -> dict:
    """The macro (mean over tasks) of the per-example differences averaged over ``runs``, on the
    examples in every run, with its bootstrap 95% interval; each run's own macro there; the examples
    lost in every run (their keys), and how many gained in every run and changed in some runs only."""
    keys = sorted(set.intersection(*(set(r) for r in runs)))
    if not keys:
        raise SystemExit("no example is in every run")
    tasks = sorted({runs[0][k][0] for k in keys})

    def per_task(diff) -> list[list[float]]:  # the report's macro: over tasks, examples resampled within each
        return [[diff(k) for k in keys if runs[0][k][0] == t] for t in tasks]

    pooled_diffs = per_task(lambda k: float(np.mean([r[k][1] for r in runs])))
    signs = [{int(np.sign(r[k][1])) for r in runs} for k in keys]
    return {"examples": len(keys), "tasks": len(tasks),
            "per_run": [niah.macro_diff(per_task(lambda k, r=r: r[k][1])) for r in runs],
            "pooled": niah.macro_diff(pooled_diffs), "ci95": niah.macro_ci(pooled_diffs, resamples, seed),
            "per_task": by_task(tasks, pooled_diffs, resamples, seed),
            # whether the replicates' differences are the same examples' (the arm's own, which more
            # replicates cannot average away) or each call's (greedy answers moving between calls)
            "lost_in_every_run": [k for k, s in zip(keys, signs) if s == {-1}],
            "gained_in_every_run": sum(s == {1} for s in signs),
            "changed_in_some_runs": sum(len(s) > 1 for s in signs)}


def together(runs: list[dict[str, tuple[str, float]]], resamples: int, seed: int = 0) -> dict:
    """The macro of the runs' paired differences put together (runs over different examples; a key
    two runs share counts once, the first run's), with its bootstrap 95% interval, and each run's
    own macro."""
    return _combined(runs, lambda diffs: diffs[0], resamples, seed)


def averaged(runs: list[dict[str, tuple[str, float]]], resamples: int, seed: int = 0) -> dict:
    """The macro of every example's difference averaged over the runs that answered it (runs that
    share some examples and not others), with its bootstrap 95% interval, each run's own macro and
    how many examples more than one run answered."""
    return _combined(runs, _mean, resamples, seed)


def versus(runs: list[dict[str, tuple[str, float]]], others: list[dict[str, tuple[str, float]]], resamples: int,
           seed: int = 0) -> dict:
    """One policy against another that ran in other calls, on the examples both answered: each
    example's difference against its own call's reference, averaged over each side's runs
    (``averaged``), then the two sides' difference. The reference cancels only on average (greedy
    answers move between calls), so one policy against itself in two calls is the floor to read
    this against."""
    mine, theirs = (_per_example(side, _mean) for side in (runs, others))
    keys = [k for k in mine if k in theirs]
    if not keys:
        raise SystemExit("no example was answered by both policies")
    tasks = sorted({mine[k][0] for k in keys})
    per_task = [[mine[k][1] - theirs[k][1] for k in keys if mine[k][0] == t] for t in tasks]
    return {"examples": len(keys), "tasks": len(tasks), "sides": (len(mine), len(theirs)),
            "pooled": niah.macro_diff(per_task), "ci95": niah.macro_ci(per_task, resamples, seed),
            "per_task": by_task(tasks, per_task, resamples, seed)}


def _mean(diffs: list[float]) -> float:
    return float(np.mean(diffs))


def _gathered(runs: list[dict[str, tuple[str, float]]]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Example key -> its differences in run order, and -> its task."""
    diffs: dict[str, list[float]] = {}
    task: dict[str, str] = {}
    for r in runs:
        for k, (t, d) in r.items():
            diffs.setdefault(k, []).append(d)
            task.setdefault(k, t)
    if not diffs:
        raise SystemExit("no example was answered by both an arm and its reference")
    return diffs, task


def _per_example(runs: list[dict[str, tuple[str, float]]], reduce) -> dict[str, tuple[str, float]]:
    """Example key -> (task, its differences reduced to one by ``reduce``)."""
    diffs, task = _gathered(runs)
    return {k: (task[k], reduce(d)) for k, d in diffs.items()}


def _combined(runs: list[dict[str, tuple[str, float]]], reduce, resamples: int, seed: int) -> dict:
    """The runs' examples together, each example's differences (in run order) reduced to one by
    ``reduce``: ``together``'s first run's, ``averaged``'s mean."""
    diffs, task = _gathered(runs)
    tasks = sorted(set(task.values()))
    per_task = [[reduce(diffs[k]) for k in diffs if task[k] == t] for t in tasks]
    return {"examples": len(diffs), "tasks": len(tasks), "replicated": sum(len(d) > 1 for d in diffs.values()),
            "per_run": [niah.macro_diff([[d for t2, d in r.values() if t2 == t] for t in tasks]) for r in runs],
            "pooled": niah.macro_diff(per_task), "ci95": niah.macro_ci(per_task, resamples, seed),
            "per_task": by_task(tasks, per_task, resamples, seed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=parse_run, action="append", required=True, metavar="DIR:ARM@CHUNK")
    ap.add_argument("--reference", default="fp8")
    ap.add_argument("--length", type=int, help="only examples of this RULER length")
    ap.add_argument("--bootstrap", type=int, default=5000)
    ap.add_argument("--lost-keys", type=Path, metavar="FILE",
                    help="replicates: write the keys of the examples lost in every run, one a line "
                         "(stale_probe.py --keys @FILE runs them in the emulation)")
    ap.add_argument("--per-task", action="store_true", help="also each task's pooled difference and interval")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--against", type=parse_run, action="append", metavar="DIR:ARM@CHUNK",
                      help="another policy's runs (other calls): the first policy's difference from it, per example")
    mode.add_argument("--disjoint", action="store_true",
                      help="the runs hold different examples: put their differences together (not replicates)")
    mode.add_argument("--mixed", action="store_true",
                      help="the runs share some examples: each example's difference averaged over the runs that answered it")
    args = ap.parse_args()
    runs = [paired(d, run, args.reference, args.length) for d, run in args.run]
    if args.against:
        if args.lost_keys:
            raise SystemExit("--lost-keys: give two or more replicate runs, not --against")
        r = versus(runs, [paired(d, run, args.reference, args.length) for d, run in args.against], args.bootstrap)
        print(f"{r['examples']} examples both policies answered (the runs {r['sides'][0]}, the --against runs "
              f"{r['sides'][1]}; {r['tasks']} tasks); macro Δ of the runs against the --against runs, each side "
              f"against {args.reference} in its own calls:")
        print(f"  pooled: {r['pooled']:+.2f} [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]")
        if args.per_task:
            for task, (mean, (lo, hi)) in r["per_task"].items():
                print(f"    {task}: {mean:+.2f} [{lo:+.2f}, {hi:+.2f}]")
        return
    r = (together if args.disjoint else averaged if args.mixed else pooled)(runs, args.bootstrap)
    where = ("in the runs together" if args.disjoint else
             f"in the runs together, {r['replicated']} of them in more than one" if args.mixed else f"in all {len(runs)} runs")
    print(f"{r['examples']} examples {where} ({r['tasks']} tasks); macro Δ vs {args.reference}:")
    for (d, run), m in zip(args.run, r["per_run"]):
        none = "no example" + (f" of length {args.length}" if args.length else "")
        print(f"  {d}:{run.label}: {none if m is None else f'{m:+.2f}'}")
    print(f"  pooled: {r['pooled']:+.2f} [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]")
    if args.per_task:
        for task, (mean, (lo, hi)) in r["per_task"].items():
            flag = "  <- worse than 3 pp, interval below zero" if mean < -3 and hi < 0 else ""
            print(f"    {task}: {mean:+.2f} [{lo:+.2f}, {hi:+.2f}]{flag}")
    if not (args.disjoint or args.mixed) and len(runs) > 1:
        print(f"  examples that lost in every run: {len(r['lost_in_every_run'])}, gained in every run: "
              f"{r['gained_in_every_run']}, changed in some runs only: {r['changed_in_some_runs']}")
        if args.lost_keys:
            args.lost_keys.write_text("".join(k + "\n" for k in r["lost_in_every_run"]))
    elif args.lost_keys:
        raise SystemExit("--lost-keys: give two or more replicate runs (not --disjoint or --mixed)")


if __name__ == "__main__":
    main()
