"""benchmark/kernels/plot_graph_splits.py's ``score``: today's graph split rule against the best count of
each swept row, the figure a change of ``heuristics.graph_splits`` is judged by."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))

import plot_graph_splits  # noqa: E402


def _row(batch: int, context: int, ms: dict[int, float]) -> dict:
    # x_fp8: the time over FlashInfer FP8's, here over a 2.0 ms FP8 decode
    return {"batch": batch, "context": context, "sweep": {str(n): {"ms": t, "x_fp8": t / 2.0} for n, t in ms.items()}}


def test_score_takes_the_rules_count_against_each_rows_best() -> None:
    # Llama-3-8B-class, 4-bit keys, 132 SMs: 64 rows take one TQ3 split at any context, 12 rows of a
    # 34,816-token graph 4 (1.5 waves), 9 rows 3 (one wave)
    run = {"geometry": "32q/8kv/128", "pages": 512, "key_bits": 4, "rows": [
        _row(64, 131072, {1: 2.0, 2: 1.0}),  # the rule's 1 split: 2x the best
        _row(12, 34816, {2: 1.0, 4: 1.0}),  # the rule's 4: the best
        _row(9, 34816, {3: 3.0, 6: 1.5}),  # the rule's 3: 2x
        _row(9, 34816, {2: 1.0, 6: 1.0}),  # the rule's 3 not swept: left out, named
    ]}
    scored = plot_graph_splits.score([run], num_sms=132)
    assert scored["cases"] == 3
    assert math.isclose(scored["x_best_geomean"], 4 ** (1 / 3))
    assert (scored["rule_ms"], scored["best_ms"]) == (2.0 + 1.0 + 3.0, 1.0 + 1.0 + 1.5)
    assert scored["worst"]["x_best"] == 2.0 and scored["worst"]["batch"] == 64  # the first of the two 2x rows
    assert scored["unswept"] == [{"geometry": "32q/8kv/128", "pages": 512, "batch": 9, "context": 34816, "splits": [3, 1]}]


def test_the_rule_is_taken_at_each_rows_own_context() -> None:
    # one sweep file with rows at several contexts (graph_splits_0446_70p.json has three): 12
    # Llama-class rows take 2 TQ3 splits captured at 6,400 tokens and 4 (1.5 waves) at 131,072, so a
    # row read at the file's longest context would be marked and scored at the wrong count
    run = {"geometry": "32q/8kv/128", "pages": 70, "key_bits": 4, "rows": [
        _row(12, 6400, {2: 1.0, 4: 3.0}),
        _row(12, 131072, {2: 3.0, 4: 1.0}),
    ]}
    assert [plot_graph_splits.rule_splits(run, row, 132) for row in run["rows"]] == [(2, 1), (4, 1)]
    # the figure's marks: each row circled at its own context's count (before, both at 131,072's 4)
    assert plot_graph_splits.circles(run, 132) == [(12, 6400, 2, 0.5), (12, 131072, 4, 0.5)]
    assert plot_graph_splits.score([run], num_sms=132)["x_best_geomean"] == 1.0
