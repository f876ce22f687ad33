"""A device NIAH run into docs/results, kept as committed runs are: run_suite.sh niah's output (its
PACK=1 file, or the folder it packs) unpacked into DEST as niah.json, niah.md, the two PNGs and
answers/ARM@CHUNK.jsonl.gz (gzip level 9, no name or time in the header). Then the report is rebuilt
from DEST's answers with the device report's own command (niah.json's ``meta.command``, another
``--out``) and its niah.md and niah.png are compared with the device's byte for byte: a run whose
report does not rebuild from what is committed says so and exits 1, DEST left for a look.

  python benchmark/quality/niah_import.py /work/.device/12/e.tar.gz docs/results/quality_h200_256ref_2105
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def unpack(src: Path, dest: Path) -> list[Path]:
    """DEST's report, figures and gzipped answers from the run at ``src``; returns the answers written."""
    if (dest / "niah.json").exists():
        raise SystemExit(f"{dest}: holds a run already (niah.json); give a new folder")
    with tempfile.TemporaryDirectory() as tmp:
        phase = phase_folder(src, Path(tmp))
        missing = [n for n in (*REPORT, ANSWERS) if not (phase / n).exists()]
        if missing:
            raise SystemExit(f"{src}: no {', '.join(missing)} in {phase.name}/ (was the phase cut before its report?)")
        (dest / "answers").mkdir(parents=True, exist_ok=True)
        for name in (*REPORT, *FIGURES):
            if (phase / name).exists():
                shutil.copyfile(phase / name, dest / name)
        written = []
        with tarfile.open(phase / ANSWERS) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if not member.isfile() or name.parent.name != "answers" or name.suffix != ".jsonl":
                    continue
                out = dest / "answers" / (name.name + ".gz")
                out.write_bytes(gzip.compress(tar.extractfile(member).read(), compresslevel=9, mtime=0))
                written.append(out)
    if not written:
        raise SystemExit(f"{src}: {ANSWERS} holds no answers/*.jsonl")
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
    """The report files that differ when ``rebuild`` (niah.main) makes them again from DEST's answers."""
    with tempfile.TemporaryDirectory() as tmp:
        again = Path(tmp)
        shutil.copytree(dest / "answers", again / "answers")
        shutil.copyfile(dest / "niah.json", again / "niah.json")
        rebuild(report_argv(dest, again))
        return [n for n in ("niah.md", *FIGURES)
                if (dest / n).exists() and (dest / n).read_bytes() != (again / n).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run_suite.sh niah's PACK=1 file (.tar.gz) or its output folder")
    ap.add_argument("dest", type=Path, help="the new docs/results folder")
    args = ap.parse_args(argv)
    written = unpack(args.src, args.dest)
    import niah

    differs = rebuild_differs(args.dest, niah.main)
    for path in written:
        print(f"{path}: {len(gzip.decompress(path.read_bytes()).splitlines())} answers")
    if differs:
        print(f"{args.dest}: the report rebuilt from the committed answers differs in {', '.join(differs)}")
        return 1
    print(f"{args.dest}: niah.md and the figures rebuild byte for byte from the committed answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
