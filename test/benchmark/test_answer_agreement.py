"""benchmark/quality/answer_agreement.py: two runs' answers compared on the examples both answered."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

import answer_agreement  # noqa: E402


def _answers(directory: Path, label: str, rows: dict[tuple[int, int], tuple[str, float]]) -> None:
    (directory / "answers").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"key": f"niah_single_1/{n}/{i}", "task": "niah_single_1", "length": n, "index": i,
                         "answer": answer, "score": score}) + "\n" for (n, i), (answer, score) in rows.items()]
    (directory / "answers" / f"{label}.jsonl").write_text("".join(lines))


def test_identical_answers_and_the_score_difference_on_shared_examples(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _answers(a, "fp8@256", {(1024, 0): (" 42.", 100.0), (1024, 1): (" 7", 100.0), (1024, 2): (" 9", 0.0),
                            (2048, 0): (" 1", 100.0)})
    _answers(b, "fp8@256", {(1024, 0): (" 42.", 100.0), (1024, 1): (" 7 and", 0.0), (2048, 0): (" 2", 0.0)})
    load = answer_agreement.niah.load_answers
    run = answer_agreement.niah.Run("fp8", "256")
    got = answer_agreement.agreement(load(a, run), load(b, run), 1024)
    # 1024/2 is only in a; of the two shared, one answer is identical; a - b = (0 + 100) / 2
    assert got == {"examples": 2, "identical": 1, "same_score": 1, "score_diff": pytest.approx(50.0)}
    every = answer_agreement.agreement(load(a, run), load(b, run))
    assert every == {"examples": 3, "identical": 1, "same_score": 1, "score_diff": pytest.approx(200 / 3)}
    # " 7 and" continues " 7": identical when a stop token may differ
    assert answer_agreement.agreement(load(a, run), load(b, run), 1024, prefix=True)["identical"] == 2
    with pytest.raises(SystemExit, match="no example"):
        answer_agreement.agreement(load(a, run), load(b, run), 4096)


def test_an_emulation_record_is_compared_on_the_served_keys(tmp_path):
    served = tmp_path / "served"
    _answers(served, "minima-k4@256", {(1024, 0): (" 42.", 100.0), (1024, 1): (" 7", 100.0)})
    record = {"examples": ["niah_single_1/1024/1", "niah_single_1/1024/0", "niah_single_1/1024/5"],
              "results": {"k4@256": {"answers": [" 7\nThe grass", " 41.", " 3"], "scores": [100.0, 0.0, 0.0]}}}
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(record))
    name, emulated = answer_agreement.parse_any(f"{probe}:k4@256")
    assert emulated["niah_single_1/1024/5"] == {"answer": " 3", "score": 0.0, "task": "niah_single_1", "length": 1024}
    _, got = answer_agreement.parse_any(f"{served}:minima-k4@256")
    r = answer_agreement.agreement(emulated, got, 1024, prefix=True)
    # two shared examples: 1 continues the server's answer, 0 differs; scores 0 - 100 on 0
    assert r == {"examples": 2, "identical": 1, "same_score": 1, "score_diff": pytest.approx(-50.0)}
    with pytest.raises(SystemExit, match="no mode 'k4@all'"):
        answer_agreement.parse_any(f"{probe}:k4@all")
