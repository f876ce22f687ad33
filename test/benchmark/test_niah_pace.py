"""benchmark/quality/niah_pace.py over synthetic answers: a group's wall is its slowest answer, a
process's pace its examples over the sum of its groups' walls, and a planned arm's seconds follow the
tasks each of its processes takes."""

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah  # noqa: E402
import niah_pace  # noqa: E402


def _answers(directory: Path, label: str, groups: list[tuple[int, list[float]]], with_group: bool = True) -> None:
    (directory / "answers").mkdir(parents=True, exist_ok=True)
    rows, i = [], 0
    for length, seconds in groups:
        first = f"niah_single_1/{length}/{i}"
        for s in seconds:
            row = {"key": f"niah_single_1/{length}/{i}", "task": "niah_single_1", "length": length, "index": i,
                   "score": 100.0, "seconds": s}
            if with_group:
                row |= {"group": first, "group_size": len(seconds)}
            rows.append(row)
            i += 1
    (directory / "answers" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_groups_wall_is_its_slowest_answer(tmp_path):
    # two groups at 1K (walls 4 s and 2 s, 5 examples), one at 2K (wall 10 s, 2 examples)
    _answers(tmp_path, "fp8@256", [(1024, [1.0, 4.0, 3.0]), (1024, [2.0, 0.5]), (2048, [10.0, 9.0])])
    assert niah_pace.paces(tmp_path, niah.Run("fp8", "256")) == {1024: (5, 6.0, 3), 2048: (2, 10.0, 2)}


def test_a_plans_seconds_follow_the_tasks_a_process_takes():
    # 8 tasks over 3 processes: one takes 3 of them; over 20, one each (niah_shards.py caps at a task a process)
    assert niah_pace.phase_seconds(2.0, 64, 3) == pytest.approx(3 * 64 / 2.0)
    assert niah_pace.phase_seconds(2.0, 64, 20) == pytest.approx(64 / 2.0)
    assert niah_pace.phase_seconds(2.0, 64, 1) == pytest.approx(8 * 64 / 2.0)


def test_the_cli_reads_gzipped_answers_and_prints_each_length_and_the_arms_total(tmp_path, capsys):
    _answers(tmp_path, "minima@256", [(1024, [2.0, 4.0]), (2048, [8.0, 8.0])])
    path = tmp_path / "answers" / "minima@256.jsonl"  # committed answers are gzipped
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    rows = niah_pace.main(["--n", "10", "--processes", "4", "--run", f"{tmp_path}:minima@256"])
    assert [(r["length"], r["pace"], r["seconds"]) for r in rows] == [(1024, 0.5, 40.0), (2048, 0.25, 80.0)]
    assert f"| {tmp_path.name}:minima@256 | all | | | | **120** |" in capsys.readouterr().out


def test_answers_without_groups_or_without_a_file_stop_by_name(tmp_path):
    _answers(tmp_path, "minima@128", [(1024, [1.0, 2.0])], with_group=False)
    with pytest.raises(SystemExit, match="minima@128: its answers name no group"):
        niah_pace.paces(tmp_path, niah.Run("minima", "128"))
    with pytest.raises(SystemExit, match="fp8@128: no answers"):
        niah_pace.paces(tmp_path, niah.Run("fp8", "128"))
