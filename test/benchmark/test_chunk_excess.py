"""benchmark/quality/chunk_excess.py: an arm's excess loss at small chunks, paired per example."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

from chunk_excess import excess  # noqa: E402


def _answers(root: Path, label: str, scores: dict[int, float], task: str = "niah_single_1") -> None:
    (root / "answers").mkdir(parents=True, exist_ok=True)
    rows = [{"key": f"{task}/1024/{i}", "task": task, "length": 1024, "index": i, "score": s} for i, s in scores.items()]
    (root / "answers" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_excess_pairs_each_example_over_both_chunk_sizes_and_only_shared_ones(tmp_path):
    default, small = tmp_path / "default", tmp_path / "small"
    _answers(default, "fp8@default", {0: 100, 1: 100, 2: 0, 3: 100})
    _answers(default, "minima@default", {0: 100, 1: 0, 2: 0, 3: 100})
    _answers(small, "fp8@256", {0: 100, 1: 100, 2: 100})  # example 3 not answered at 256: left out
    _answers(small, "minima@256", {0: 0, 1: 0, 2: 100})
    out = excess(default, small, "minima", "fp8", "256")
    # example 0: (0-100) - (100-100) = -100; 1: (0-100) - (0-100) = 0; 2: (100-100) - (0-0) = 0
    assert out["all"] == [-100, 0, 0] and out["niah_single_1"] == [-100, 0, 0]
