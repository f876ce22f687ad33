"""benchmark/quality/niah_import.py: a device NIAH run (run_suite.sh niah's PACK=1 file) into a results
folder as committed runs are kept, and the check that its report rebuilds from what is committed."""

import gzip
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah_import  # noqa: E402

COMMAND = "python benchmark/quality/niah.py --report-only --out /tmp/w/d/niah --arms fp8 --n 2"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _pack(path: Path, answers: dict[str, bytes], report: dict[str, bytes] | None = None) -> Path:
    """A PACK=1 file as run_suite.sh makes it: niah/ with the report, the figures and the answers' tar."""
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as t:
        for name, data in answers.items():
            _add(t, f"answers/{name}", data)
    files = {"niah.json": json.dumps({"meta": {"command": COMMAND, "args": {"device": "cuda"}}}).encode(),
             "niah.md": b"| table |\n", "niah.png": b"png", "niah-answers.tar.gz": inner.getvalue(),
             "logs.tar.gz": b"logs"} if report is None else report
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            _add(t, f"niah/{name}", data)
    return path


def test_the_pack_unpacks_as_committed_runs_are_kept(tmp_path):
    rows = b'{"key": "niah_single_1/1024/0"}\n{"key": "niah_single_1/1024/1"}\n'
    pack = _pack(tmp_path / "niah.tar.gz", {"fp8@256.jsonl": rows, "minima@256.jsonl": rows[:31]})
    dest = tmp_path / "quality_h200_x"
    written = niah_import.unpack(pack, dest)
    assert sorted(p.name for p in written) == ["fp8@256.jsonl.gz", "minima@256.jsonl.gz"]
    assert gzip.decompress((dest / "answers" / "fp8@256.jsonl.gz").read_bytes()) == rows
    assert (dest / "answers" / "fp8@256.jsonl.gz").read_bytes()[4:8] == b"\0\0\0\0"  # no time in the header
    assert sorted(p.name for p in dest.iterdir()) == ["answers", "niah.json", "niah.md", "niah.png"]
    with pytest.raises(SystemExit, match="holds a run already"):
        niah_import.unpack(pack, dest)


def test_a_pack_cut_before_its_report_is_named(tmp_path):
    pack = _pack(tmp_path / "niah.tar.gz", {}, report={"niah.md": b"", "logs.tar.gz": b""})
    with pytest.raises(SystemExit, match="no niah.json found"):
        niah_import.unpack(pack, tmp_path / "a")
    pack = _pack(tmp_path / "n2.tar.gz", {}, report={"niah.json": b"{}", "niah.md": b""})
    with pytest.raises(SystemExit, match="no niah-answers.tar.gz"):
        niah_import.unpack(pack, tmp_path / "b")


def test_the_rebuild_takes_the_device_command_with_another_out_and_compares_bytes(tmp_path):
    niah_import.unpack(_pack(tmp_path / "niah.tar.gz", {"fp8@256.jsonl": b"{}\n"}), tmp_path / "d")
    seen = []

    def same(argv):  # a rebuild that writes what the device wrote
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        (out / "niah.md").write_bytes(b"| table |\n")
        (out / "niah.png").write_bytes(b"png")

    assert niah_import.rebuild_differs(tmp_path / "d", same) == []
    assert seen[0][:2] == ["--report-only", "--out"] and seen[0][2] != "/tmp/w/d/niah"
    assert seen[0][-2:] == ["--device", "cuda"]  # the device's, not this machine's default

    def other(argv):
        same(argv)
        (Path(argv[argv.index("--out") + 1]) / "niah.md").write_bytes(b"| another table |\n")

    assert niah_import.rebuild_differs(tmp_path / "d", other) == ["niah.md"]
