"""Summarize one device-suite phase: every test from the JUnit XML files with its outcome and time,
the serving soak's verdict and report (``soak``), the serving arms' tables.

Writes summary.md and summary.json under --out; the harness's limits go into the summary, beside
the figures they qualify.
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HARNESS_NOTE = (
    "Device harness: real SGLang 0.5.23 on the image's torch 2.11 with a torch stand-in for "
    "sglang-kernel (norm/activation in torch, sampling with --sampling-backend pytorch; "
    "scripts/device/standin). Users run the real sglang-kernel; every arm runs the same stand-in."
)


def outcomes(xml_path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") is None:  # an interrupted xdist run leaves nameless entries: no test's outcome
            continue
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "").strip().splitlines()
                break
        else:
            detail = []
        cases.append({"suite": xml_path.stem.removeprefix("junit_"), "test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0), "detail": detail[:1]})
    return cases


def soak_verdict(path: Path) -> dict:
    """The serving soak's verdict and failed checks; NOT RUN TO THE END where it wrote no report
    (a server that did not start, a run cut by the budget: its log is in logs.tar.gz)."""
    if not path.exists():
        return {"verdict": "NOT RUN TO THE END", "failed": []}
    result = json.loads(path.read_text())
    return {"verdict": "PASSED" if result["passed"] else "FAILED",
            "failed": [name for name, check in result["checks"].items() if not check["passed"]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True)
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cases = [c for f in sorted(args.work.rglob("junit_*.xml")) for c in outcomes(f)]
    counts: dict[str, dict[str, int]] = {}
    for c in cases:
        counts.setdefault(c["suite"], {}).setdefault(c["outcome"], 0)
        counts[c["suite"]][c["outcome"]] += 1
    gpu = (args.work / "gpu.txt").read_text().strip() if (args.work / "gpu.txt").exists() else ""
    lines = [f"# Device suite: {args.phase}", "",
             f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.seconds} s in this phase.",
             f"- GPU: {gpu.splitlines()[-1] if gpu else 'unknown'}", f"- {HARNESS_NOTE}", ""]
    for suite, n in counts.items():
        lines.append(f"- {suite}: " + ", ".join(f"{v} {k}" for k, v in sorted(n.items())))
    soak = soak_verdict(args.out / "serving_soak.json") if args.phase == "soak" else None
    if soak:
        failed = f" (failed: {', '.join(soak['failed'])})" if soak["failed"] else ""
        lines.append(f"- serving soak: {soak['verdict']}{failed}")
    if cases:
        lines += ["", "| suite | test | outcome | s |", "|---|---|---|---|"]
        lines += [f"| {c['suite']} | `{c['test']}` | {c['outcome']}{(': ' + c['detail'][0][:120]) if c['detail'] else ''} "
                  f"| {c['seconds']:.1f} |" for c in cases]
    for serve in sorted([*args.out.glob("serve_*.md"), *args.out.glob("greedy_*.md")]):
        lines += ["", f"## Serving arms, {serve.stem} (harness figures)", "", serve.read_text()]
    if (args.out / "serving_soak.md").exists():
        lines += ["", "## Serving soak (harness figures)", "", (args.out / "serving_soak.md").read_text()]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    (args.out / "summary.json").write_text(json.dumps(
        {"phase": args.phase, "seconds": args.seconds, "gpu": gpu, "note": HARNESS_NOTE, "counts": counts,
         "soak": soak, "tests": cases}, indent=1))
    print("\n".join(lines[:8 + len(counts) + bool(soak)]))


if __name__ == "__main__":
    main()
