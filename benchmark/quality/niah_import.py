"""A device NIAH run into docs/results, kept as committed runs are: run_suite.sh niah's output (its
PACK=1 file, or the folder it packs) unpacked into DEST as niah.json, niah.md, the two PNGs and
answers/ARM@CHUNK.jsonl.gz for each run the report covers (gzip level 9, no time in the header). Then
the report is rebuilt from those answers with the device report's own command (niah.json's
``meta.command``, another ``--out``) and its niah.md and figures are compared with the device's byte for
byte. Only a run that rebuilds becomes DEST; one that does not (or whose rebuild fails) stays in
DEST.part for a look, and the command exits 1.

  python benchmark/quality/niah_import.py /work/.device/12/d/niah.tar.gz docs/results/quality_h200_256ref_2105
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import niah  # noqa: E402

REPORT = ("niah.json", "niah.md")
FIGURES = ("niah.png", "niah_frontier.png")
ANSWERS = "niah-answers.tar.gz"  # run_suite.sh niah: the answers folder, packed beside the report


def phase_folder(src: Path, scratch: Path) -> Path:
    """The folder holding the run's niah.json: ``src`` itself, or the one its PACK=1 file unpacks to."""
    if src.is_file():
        with tarfile.open(src) as tar:
            tar.extractall(scratch, filter="data")
        found = sorted(p.parent for p in scratch.rglob("niah.json"))
    else:
        found = [src] if (src / "niah.json").exists() else sorted(p.parent for p in src.rglob("niah.json"))
    if len(found) != 1:
        raise SystemExit(f"{src}: {'no' if not found else len(found)} niah.json found (one run at a time)")
    return found[0]


def report_runs(meta: dict) -> list[niah.Run]:
    return [niah.Run(arm, chunk) for chunk in meta["args"]["chunked_prefill_sizes"] for arm in meta["args"]["arms"]]


def unpack(src: Path, dest: Path) -> dict[Path, int]:
    """``dest``'s report, figures and gzipped answers from the run at ``src``; returns each answers file
    written and how many answers it holds.
    Only the report's runs: the pack also holds what NIAH_DIR seeded (other arms, committed .jsonl.gz)."""
    with tempfile.TemporaryDirectory() as tmp:
        phase = phase_folder(src, Path(tmp) / "pack")
        missing = [n for n in (*REPORT, ANSWERS) if not (phase / n).exists()]
        if missing:
            raise SystemExit(f"{src}: no {', '.join(missing)} in {phase.name}/ (was the phase cut before its report?)")
        answers = Path(tmp) / "answers"
        with tarfile.open(phase / ANSWERS) as tar:
            tar.extractall(answers, filter="data")
        meta = json.loads((phase / "niah.json").read_text())["meta"]
        found = {run: niah.answer_lines(niah.answers_path(answers, run)) for run in report_runs(meta)}
        if not any(found.values()):
            raise SystemExit(f"{src}: {ANSWERS} holds no answers of {', '.join(r.label for r in found)}")
        (dest / "answers").mkdir(parents=True)
        for name in (*REPORT, *FIGURES):
            if (phase / name).exists():
                shutil.copyfile(phase / name, dest / name)
        written = {}
        for run, lines in found.items():
            if lines:  # (.jsonl where the call appended, else the .gz it was seeded with: answer_lines' rule)
                out = dest / "answers" / (niah.answers_path(dest, run).name + ".gz")
                data = "".join(line + "\n" for line in lines).encode()
                out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
                written[out] = len(lines)
    return written


def report_argv(dest: Path, out: Path) -> list[str]:
    """The device report's niah.py arguments (niah.json's ``meta.command``) with ``--out`` set to ``out``,
    and its ``--device`` (the device's default, cuda, is not this machine's)."""
    meta = json.loads((dest / "niah.json").read_text())["meta"]
    words = shlex.split(meta["command"])[2:]
    if "--report-only" not in words or "--out" not in words:
        raise SystemExit(f"{dest}/niah.json: meta.command is not a niah.py --report-only command: {' '.join(words)}")
    words[words.index("--out") + 1] = str(out)
    return words if "--device" in words else [*words, "--device", meta["args"]["device"]]


def rebuild_differs(dest: Path, rebuild: Callable[[list[str]], object]) -> list[str]:
    """The report files that differ when ``rebuild`` (niah.main) makes them again from ``dest``'s answers."""
    with tempfile.TemporaryDirectory() as tmp:
        again = Path(tmp)
        shutil.copytree(dest / "answers", again / "answers")
        shutil.copyfile(dest / "niah.json", again / "niah.json")
        with contextlib.redirect_stdout(io.StringIO()):  # the report's tables: the verdict is what matters here
            rebuild(report_argv(dest, again))
        return [n for n in ("niah.md", *FIGURES)
                if (dest / n).exists() and (dest / n).read_bytes() != (again / n).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run_suite.sh niah's PACK=1 file (.tar.gz) or its output folder")
    ap.add_argument("dest", type=Path, help="the new docs/results folder")
    args = ap.parse_args(argv)
    part = args.dest.with_name(args.dest.name + ".part")
    for d in (args.dest, part):
        if d.exists() and any(d.iterdir()):
            raise SystemExit(f"{d}: exists and is not empty; give a new folder (or remove it)")
    for path, answers in unpack(args.src, part).items():
        print(f"{path.name}: {answers} answers")
    try:
        differs = rebuild_differs(part, niah.main)
    except (Exception, SystemExit) as e:  # e.g. no RULER examples here: the run is kept, unchecked
        print(f"{part}: the report could not be rebuilt ({type(e).__name__}: {e}); left there unchecked")
        return 1
    if differs:
        print(f"{part}: the report rebuilt from the answers differs in {', '.join(differs)}; left there for a look")
        return 1
    if args.dest.exists():
        args.dest.rmdir()  # empty (checked above)
    part.rename(args.dest)
    print(f"{args.dest}: niah.md and the figures rebuild byte for byte from the committed answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
