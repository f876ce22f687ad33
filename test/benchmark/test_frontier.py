"""benchmark/quality/frontier.py over synthetic committed runs: a point pools its runs' paired
differences (each against its own call's reference) and weighs its runs' bytes by attended tokens."""

import argparse
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import frontier  # noqa: E402
import niah  # noqa: E402

GEOMETRY = {"geometry": [3, 64], "page_size": 64, "dtype": "bfloat16", "server_args": ""}


def _run(directory: Path, label: str, scores: dict[int, float], routes: dict | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "niah.json").write_text(json.dumps({"meta": {"args": GEOMETRY}}))
    (directory / "answers").mkdir(exist_ok=True)
    rows = [{"key": f"niah_single_1/1024/{i}", "task": "niah_single_1", "length": 1024, "index": i, "score": s,
             "routes": routes, "group": f"niah_single_1/1024/{min(scores)}", "group_size": len(scores)}
            for i, s in scores.items()]
    (directory / "answers" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_point_pools_its_runs_and_weighs_their_bytes_by_attended_tokens(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, "fp8@default", dict.fromkeys(range(4), 100.0), None)
    _run(a, "minima@default", {0: 100.0, 1: 0.0, 2: 100.0, 3: 100.0},
         {"route_hot_pages": 30, "route_tq3_pages": 10, "route_hot_tokens": 1920, "route_tq3_tokens": 640})
    _run(b, "fp8@default", dict.fromkeys(range(2, 6), 100.0), None)
    _run(b, "minima@default", {2: 0.0, 3: 100.0, 4: 100.0, 5: 100.0},
         {"route_hot_pages": 0, "route_tq3_pages": 16, "route_hot_tokens": 0, "route_tq3_tokens": 1000})
    points = frontier.main(["--out", str(tmp_path / "f.png"), "--bootstrap", "200",
                            "--point", f"two runs={a}:minima@default,{b}:minima@default",
                            "--point", f"fp8 alone={a}:fp8@default"])
    two, ref = points
    # six examples: 0-1 in run a only, 2-3 in both (averaged: example 2 lost in b only counts -50), 4-5 in b only
    assert two["examples"] == 6 and two["diff_vs_ref"] == pytest.approx(-150 / 6)
    # FP8 384 bytes a token and layer (3 heads x 64 dims x K and V), TQ3 with 3-bit keys 162
    assert two["bytes_per_token"] == pytest.approx((1920 * 384 + 640 * 162 + 1000 * 162) / 3560)
    assert two["lengths"] == [1024] and two["worst_task"]["task"] == "niah_single_1"
    assert ref["bytes_per_token"] == 384 and ref["diff_vs_ref"] == 0
    assert (tmp_path / "f.png").stat().st_size > 0
    assert json.loads((tmp_path / "f.json").read_text())["points"][0]["label"] == "two runs"
    assert "| two runs | 2 | 6 | 1024 | -25.00" in (tmp_path / "f.md").read_text()
    assert two["minima"] and not ref["minima"]


def test_a_run_that_is_not_there_stops_the_figure_by_name(tmp_path):
    a = tmp_path / "a"
    _run(a, "fp8@default", dict.fromkeys(range(2), 100.0), None)
    _run(a, "minima@default", dict.fromkeys(range(2), 100.0), None)
    with pytest.raises(SystemExit, match="minima@256 has no example answered beside fp8@256"):
        frontier.main(["--out", str(tmp_path / "f.png"), "--point", f"typo={a}:minima@256"])
    with pytest.raises(SystemExit, match="holds no niah.json"):
        frontier.main(["--out", str(tmp_path / "f.png"), "--point", f"nowhere={tmp_path / 'b'}:minima@default"])
    with pytest.raises(SystemExit, match="'minima-typo' is not a niah.py arm"):
        frontier.main(["--out", str(tmp_path / "f.png"), "--point", f"arm={a}:minima-typo@default"])
    assert not (tmp_path / "f.png").exists()


def test_a_point_without_runs_is_refused_by_name():
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=DIR:ARM@CHUNK"):
        frontier.parse_point("defaults")
    assert frontier.parse_point("x=d:minima@256").runs[0][1] == niah.Run("minima", "256")


def test_names_of_nearby_points_stack_apart_and_a_lone_name_stays_at_its_point():
    # a and b at one spot, c just above them and sideways over them, d far to the right at a's height
    anchors = [(100.0, 50.0), (100.0, 50.0), (130.0, 55.0), (400.0, 50.0)]
    widths = [60.0, 60.0, 60.0, 60.0]
    heights = frontier.spread_labels(anchors, widths, gap=11)
    assert heights == [50.0, 61.0, 72.0, 50.0]  # stacked upward in anchor order; d, beside nothing, not moved
    # side by side without overlapping (the second starts past the first's end): neither moves
    assert frontier.spread_labels([(100.0, 50.0), (161.0, 52.0)], [60.0, 60.0], gap=11) == [50.0, 52.0]
    assert frontier.spread_labels([(161.0, 50.0), (100.0, 52.0)], [60.0, 60.0], gap=11) == [50.0, 52.0]
    # the last name (x 150-250) overlaps the narrow one at 220-270 (placed at 10) and the one at 90-190
    # (pushed to 22): looked at in height order it clears both (33); in placing order it would stop at 21
    heights = frontier.spread_labels([(0, 0), (0, 0), (90, 1), (220, 10), (150, 10)], [100, 100, 100, 50, 100], gap=11)
    assert heights == [0, 11, 22, 10, 33]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 300), st.floats(0, 100), st.floats(1, 120)), min_size=1, max_size=9))
def test_no_two_names_that_overlap_sideways_end_up_closer_than_the_gap(labels):
    anchors, widths = [(x, y) for x, y, _ in labels], [w for _, _, w in labels]
    heights = frontier.spread_labels(anchors, widths, gap=11)
    assert all(h >= y for h, (_, y) in zip(heights, anchors))  # names only move up
    for i in range(len(labels)):
        for j in range(i):
            if -widths[j] < anchors[j][0] - anchors[i][0] < widths[i]:
                assert abs(heights[i] - heights[j]) >= 11 - 1e-9
