"""How `run_suite.sh niah` splits each arm's RULER tasks over processes and servers (NIAH_SHARDS).

An arm's pace on the device is the host's step, one server's: more processes an arm answer faster.
One count serves every arm, or a default and counts per arm, so that an arm answering at Minima's
256-token pace gets more processes than those answering at FP8's (2026-12-07: the defaults' three
took 266 s for 8K's 512 examples at 256-token chunks, FP8's three 114 s):

  NIAH_SHARDS=2                                        every arm over two processes
  NIAH_SHARDS=1,minima-default-aggressive-eqbytes=4    one process an arm, four for that one

A process takes a round-robin share of the eight tasks (``--tasks``: five processes take 2, 2, 2, 1, 1,
no faster than four); niah.py appends a group of
answers at a time, so an arm's processes share its answers file. ``python3 niah_shards.py SPEC ARMS``
prints one line a process: the arm, then its flags (none for an arm in one process). niah_pace.py reads
an arm's pace from committed answers and the seconds it needs over N processes.
"""

from __future__ import annotations

import sys

from ruler_data import TASKS


def counts(spec: str, arms: list[str]) -> dict[str, int]:
    """Processes per arm from NIAH_SHARDS: ``N`` or ``N,arm=M,...``."""
    default, *overrides = spec.split(",")

    def count(text: str, what: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise SystemExit(f"NIAH_SHARDS={spec}: {what} {text!r} is not a count of processes (1 or more)")
        return int(text)

    out = dict.fromkeys(arms, count(default, "the default"))
    for entry in overrides:
        arm, sep, n = entry.partition("=")
        if not sep:
            raise SystemExit(f"NIAH_SHARDS={spec}: {entry!r}: give ARM=COUNT after the default")
        if arm not in out:
            raise SystemExit(f"NIAH_SHARDS={spec}: {arm!r} is not one of NIAH_ARMS ({','.join(arms)})")
        out[arm] = count(n, arm)
    return out


def shares(n: int, tasks: tuple[str, ...] = tuple(TASKS)) -> list[tuple[str, ...]]:
    """The tasks of each of an arm's ``n`` processes: tasks[s::n] in process s (n at most one a task)."""
    n = min(n, len(tasks))
    return [tasks[s::n] for s in range(n)]


def plan(spec: str, arms: list[str], tasks: tuple[str, ...] = tuple(TASKS)) -> list[tuple[str, str]]:
    """(arm, niah.py flags) per process, its ``shares``; an arm in one process gets no flag (every task)."""
    processes = []
    for arm, n in counts(spec, arms).items():
        split = shares(n, tasks)
        processes += [(arm, "")] if len(split) == 1 else [(arm, "--tasks " + ",".join(share)) for share in split]
    return processes


if __name__ == "__main__":
    spec, arms = sys.argv[1], [a for a in sys.argv[2].split(",") if a]
    for arm, flags in plan(spec, arms):
        print(f"{arm} {flags}".rstrip())
