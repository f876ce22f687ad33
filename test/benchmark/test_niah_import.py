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

import niah  # noqa: E402
import niah_import  # noqa: E402

ROWS = b'{"key": "niah_single_1/1024/0"}\n{"key": "niah_single_1/1024/1"}\n'
META = {"command": "python benchmark/quality/niah.py --report-only --out /tmp/w/d/niah --arms fp8,minima --n 2",
        "args": {"device": "cuda", "arms": ["fp8", "minima"], "chunked_prefill_sizes": ["256"]}}


def _tar(files: dict[str, bytes], path: Path | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    if path is not None:
        path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _pack(path: Path, answers: dict[str, bytes], meta: dict = META, **drop) -> Path:
    """A PACK=1 file as run_suite.sh makes it: niah/ with the report, the figures and the answers' tar."""
    files = {"niah.json": json.dumps({"meta": meta}).encode(), "niah.md": b"| table |\n", "niah.png": b"png",
             "niah-answers.tar.gz": _tar({f"answers/{n}": d for n, d in answers.items()}), "logs.tar.gz": b"logs"}
    _tar({f"niah/{n}": d for n, d in files.items() if n not in drop.get("without", ())}, path)
    return path


def test_the_reports_runs_unpack_as_committed_runs_are_kept(tmp_path):
    # fp8 answered in the call (.jsonl); minima had nothing left, so only its seeded .gz is there;
    # another arm seeded by NIAH_DIR is not the report's
    pack = _pack(tmp_path / "niah.tar.gz", {"fp8@256.jsonl": ROWS, "minima@256.jsonl.gz": gzip.compress(ROWS.splitlines(keepends=True)[0]),
                                            "bf16@256.jsonl.gz": gzip.compress(ROWS)})
    dest = tmp_path / "quality_h200_x"
    written = niah_import.unpack(pack, dest)
    assert sorted(p.name for p in written) == ["fp8@256.jsonl.gz", "minima@256.jsonl.gz"]
    assert gzip.decompress((dest / "answers" / "fp8@256.jsonl.gz").read_bytes()) == ROWS
    assert gzip.decompress((dest / "answers" / "minima@256.jsonl.gz").read_bytes()) == ROWS.splitlines(keepends=True)[0]
    assert (dest / "answers" / "fp8@256.jsonl.gz").read_bytes()[4:8] == b"\0\0\0\0"  # no time in the header
    assert sorted(p.name for p in dest.iterdir()) == ["answers", "niah.json", "niah.md", "niah.png"]


def test_a_folder_unpacks_like_its_pack(tmp_path):
    folder = tmp_path / "out" / "niah"
    folder.mkdir(parents=True)
    (folder / "niah.json").write_text(json.dumps({"meta": META}))
    (folder / "niah.md").write_bytes(b"| table |\n")
    _tar({"answers/fp8@256.jsonl": ROWS}, folder / "niah-answers.tar.gz")
    assert [p.name for p in niah_import.unpack(tmp_path / "out", tmp_path / "d")] == ["fp8@256.jsonl.gz"]


def test_a_pack_cut_before_its_report_is_named(tmp_path):
    pack = _pack(tmp_path / "n1.tar.gz", {}, without=("niah.json",))
    with pytest.raises(SystemExit, match="no niah.json found"):
        niah_import.unpack(pack, tmp_path / "a")
    pack = _pack(tmp_path / "n2.tar.gz", {}, without=("niah-answers.tar.gz",))
    with pytest.raises(SystemExit, match="no niah-answers.tar.gz"):
        niah_import.unpack(pack, tmp_path / "b")
    pack = _pack(tmp_path / "n3.tar.gz", {"bf16@256.jsonl": ROWS})
    with pytest.raises(SystemExit, match="holds no answers of fp8@256, minima@256"):
        niah_import.unpack(pack, tmp_path / "c")
    assert not (tmp_path / "c").exists()  # nothing half-written


def _rebuild(table: bytes, seen: list):
    def rebuild(argv):  # a stand-in for niah.main --report-only
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        assert (out / "answers" / "fp8@256.jsonl.gz").exists()  # it reads a copy of the unpacked answers
        (out / "niah.md").write_bytes(table)
        (out / "niah.png").write_bytes(b"png")
    return rebuild


def test_the_rebuild_takes_the_device_command_with_another_out_and_compares_bytes(tmp_path):
    niah_import.unpack(_pack(tmp_path / "niah.tar.gz", {"fp8@256.jsonl": ROWS}), tmp_path / "d")
    seen = []
    assert niah_import.rebuild_differs(tmp_path / "d", _rebuild(b"| table |\n", seen)) == []
    assert seen[0][:2] == ["--report-only", "--out"] and seen[0][-2:] == ["--device", "cuda"]
    assert niah_import.rebuild_differs(tmp_path / "d", _rebuild(b"| another table |\n", [])) == ["niah.md"]
    # a command that names its device keeps it, once
    meta = META | {"command": META["command"] + " --device cpu"}
    niah_import.unpack(_pack(tmp_path / "n2.tar.gz", {"fp8@256.jsonl": ROWS}, meta), tmp_path / "e")
    assert niah_import.report_argv(tmp_path / "e", tmp_path)[-2:] == ["--device", "cpu"]


def test_only_a_run_that_rebuilds_becomes_dest(tmp_path, monkeypatch):
    pack = _pack(tmp_path / "niah.tar.gz", {"fp8@256.jsonl": ROWS})
    dest = tmp_path / "quality_h200_x"
    monkeypatch.setattr(niah, "main", _rebuild(b"| another table |\n", []))
    assert niah_import.main([str(pack), str(dest)]) == 1
    assert not dest.exists() and (tmp_path / "quality_h200_x.part" / "niah.md").exists()
    with pytest.raises(SystemExit, match="quality_h200_x.part: exists and is not empty"):
        niah_import.main([str(pack), str(dest)])
    monkeypatch.setattr(niah, "main", _rebuild(b"| table |\n", []))
    assert niah_import.main([str(pack), str(tmp_path / "quality_h200_y")]) == 0
    assert (tmp_path / "quality_h200_y" / "answers" / "fp8@256.jsonl.gz").exists()
    assert not (tmp_path / "quality_h200_y.part").exists()
    with pytest.raises(SystemExit, match="quality_h200_y: exists and is not empty"):
        niah_import.main([str(pack), str(tmp_path / "quality_h200_y")])
