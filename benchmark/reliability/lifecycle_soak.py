"""The page-lifecycle state machine at scale: >= 100k random operations outside CI.

Runs test/mem_cache/test_lifecycle_property.py's ``Lifecycle`` (append, step, convert, promote,
prefix hit, finish, evict, abort, reads by forwards in flight; the ownership invariants after every operation, the
attention-vs-dense check every ``--attention-every`` operations) with
many more examples and longer runs than CI's profile (15 x 30), and records how many operations
ran, how long it took and the seed, as JSON + markdown.

  .venv/bin/python benchmark/reliability/lifecycle_soak.py --examples 1250 --steps 100 --attention-every 50 \\
      --out docs/results/reliability/lifecycle_soak.json

Many examples of 100 operations rather than few long ones: every example starts from an empty pool
and walks through fills, conversions and evictions again, and the per-operation checks stay cheap
(at 500 operations an example the invariant checks over the grown state ran at ~20 operations/s on
2 cores, against ~70 here).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "test"), str(ROOT / "test" / "mem_cache")]

from sglang_minima.cpu_engine import setup_cpu_engine  # noqa: E402

setup_cpu_engine()  # the test modules import SGLang-free code, but keep the CI environment

from test_lifecycle_property import Lifecycle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=1250)
    ap.add_argument("--steps", type=int, default=100, help="operations per example (hypothesis may stop earlier)")
    ap.add_argument("--attention-every", type=int, default=50,
                    help="check attention against the dense reference every N operations (ownership: always)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "reliability" / "lifecycle_soak.json")
    args = ap.parse_args()
    Lifecycle.attention_every = args.attention_every
    t0 = time.time()
    done = threading.Event()
    with tqdm(total=args.examples * args.steps, desc="operations", unit="op") as bar:
        def progress() -> None:  # hypothesis runs the machine in this thread: follow its counter
            while not done.wait(1.0):
                bar.update(Lifecycle.steps_run - bar.n)

        threading.Thread(target=progress, daemon=True).start()
        try:
            run_state_machine_as_test(Lifecycle, settings=settings(
                max_examples=args.examples, stateful_step_count=args.steps, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck), print_blob=True))
        finally:
            done.set()
            bar.update(Lifecycle.steps_run - bar.n)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.node()}",
        "command": " ".join(sys.argv), "examples": args.examples, "steps_per_example": args.steps,
        "operations": Lifecycle.steps_run, "attention_every": args.attention_every, "seconds": round(time.time() - t0, 1), "failures": 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(
        f"# Lifecycle property test at scale\n\n- {result['date']}, `{result['command']}`\n"
        f"- {result['operations']} operations over {args.examples} examples (at most {args.steps} each), "
        f"ownership invariants after every operation, attention against the dense reference every "
        f"{args.attention_every}, {result['seconds']} s, no failure.\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
