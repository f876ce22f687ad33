"""benchmark/quality/needle_tiers.py: the page of each needle, the tier the default policy gives it,
and the paired differences split by that tier."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

import needle_tiers  # noqa: E402


def test_needle_pages_follow_the_tokens_holding_each_answers_first_character():
    prompt = "aa bb 123 cc 456"
    # five two-or-three character tokens: 'aa', ' bb', ' 123', ' cc', ' 456'
    offsets = [(0, 2), (2, 5), (5, 9), (9, 12), (12, 16)]
    assert needle_tiers.needle_pages(offsets, prompt, ["456", "123"], 2) == [1, 2]  # tokens 2 and 4, two a page
    assert needle_tiers.needle_pages(offsets, prompt, ["123", "789"], 1) == [2]  # not in the prompt: no page


@pytest.mark.parametrize("pages, tier", [
    ([0, 9], "sink"),                  # the earliest needle decides
    ([1], "page after the sinks"),
    ([2, 3], "stale"),
    ([6], "stale"),                    # page 6 of pages 0..10: not among the last 4
    ([7], "recent"),
    ([], "not in the prompt"),
])
def test_the_farthest_needle_sets_the_tier(pages, tier):
    # 11 pages of 64 tokens (the last one partial), 1 sink page, 4 Recent pages: 7..10
    assert needle_tiers.tier(pages, 10 * 64 + 5, 64, sink_pages=1, recent_pages=4) == tier


def test_more_sinks_move_the_page_after_them():
    assert needle_tiers.tier([1], 640, 64, sink_pages=2, recent_pages=4) == "sink"
    assert needle_tiers.tier([2], 640, 64, sink_pages=2, recent_pages=4) == "page after the sinks"


def test_the_split_averages_each_tier_and_brackets_it():
    diffs = [("stale", 0.0), ("stale", -100.0), ("recent", 0.0), ("recent", 0.0), ("sink", 100.0)]
    cells = needle_tiers.split(diffs, 500)
    assert cells["stale"]["examples"] == 2 and cells["stale"]["mean"] == -50.0
    assert cells["stale"]["ci95"][0] == -100.0 and cells["stale"]["ci95"][1] == 0.0
    assert cells["recent"] == {"examples": 2, "mean": 0.0, "ci95": (0.0, 0.0)}
    assert "page after the sinks" not in cells
