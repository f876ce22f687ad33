"""benchmark/quality/pooled_delta.py: replicate runs' paired differences pooled per example, and runs over
different examples put together."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

import pooled_delta  # noqa: E402


def _answers(directory: Path, label: str, scores: dict[tuple[str, int, int], float]) -> None:
    (directory / "answers").mkdir(parents=True, exist_ok=True)
    rows = [{"key": f"{t}/{n}/{i}", "task": t, "length": n, "index": i, "score": s, "routes": None}
            for (t, n, i), s in scores.items()]
    (directory / "answers" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_replicates_pool_per_example_on_the_examples_every_run_answered(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = [(t, 1024, i) for t in ("niah_single_1", "niah_multikey_1") for i in range(2)]
    _answers(a, "fp8@256", dict.fromkeys(keys, 100.0) | {("niah_single_1", 2048, 0): 100.0})
    _answers(b, "fp8@256", dict.fromkeys(keys, 100.0))
    # run a: single_1 loses 100 on example 0; run b: multikey_1 loses 100 on example 1, and b never
    # answered single_1/1024/1 (so that example is in no pooled figure); a's 2K example is filtered out
    _answers(a, "minima@256", dict.fromkeys(keys, 100.0) | {("niah_single_1", 1024, 0): 0.0, ("niah_single_1", 2048, 0): 0.0})
    _answers(b, "minima@256", {k: (0.0 if k == ("niah_multikey_1", 1024, 1) else 100.0) for k in keys
                               if k != ("niah_single_1", 1024, 1)})
    runs = [pooled_delta.paired(d, pooled_delta.niah.Run("minima", "256"), "fp8", 1024) for d in (a, b)]
    r = pooled_delta.pooled(runs, resamples=500)
    assert r["examples"] == 3 and r["tasks"] == 2
    # single_1: example 0 is -100 in a, 0 in b -> -50; multikey_1: examples 0, 1 -> 0 and -50 -> -25
    assert r["pooled"] == pytest.approx((-50 + -25) / 2)
    assert r["per_run"] == [pytest.approx(-50.0), pytest.approx(-25.0)]  # a: (-100 + 0) / 2; b: (0 - 50) / 2
    lo, hi = r["ci95"]
    assert lo <= r["pooled"] <= hi and lo < hi
    # each loss is one run's only: no example lost (or gained) in both
    assert (r["lost_in_every_run"], r["gained_in_every_run"], r["changed_in_some_runs"]) == ([], 0, 2)
    # without the length filter, run a's 2K example (-100) is a cell of its own in run a
    assert pooled_delta.paired(a, pooled_delta.niah.Run("minima", "256"), "fp8", None)["niah_single_1/2048/0"] == (
        "niah_single_1", -100.0)
    assert "niah_single_1/2048/0" not in runs[0]


def _runs_sharing_one_example(tmp_path) -> list[dict]:
    """Run a at 1K (single_1 -100, multikey_1 0), run b at 2K (single_1 -100 and 0) and on a's 1K
    single_1 example (0): one example in both runs."""
    a, b = tmp_path / "a", tmp_path / "b"
    one_k = [("niah_single_1", 1024, 0), ("niah_multikey_1", 1024, 0)]
    two_k = [("niah_single_1", 2048, 0), ("niah_single_1", 2048, 1), ("niah_single_1", 1024, 0)]
    _answers(a, "fp8@256", dict.fromkeys(one_k, 100.0))
    _answers(b, "fp8@256", dict.fromkeys(two_k, 100.0))
    _answers(a, "minima@256", {one_k[0]: 0.0, one_k[1]: 100.0})
    _answers(b, "minima@256", {two_k[0]: 0.0, two_k[1]: 100.0, two_k[2]: 100.0})
    return [pooled_delta.paired(d, pooled_delta.niah.Run("minima", "256"), "fp8", None) for d in (a, b)]


def test_disjoint_runs_put_their_examples_together_each_counted_once(tmp_path):
    # the 1K single_1 example both runs answered: a's difference stands
    runs = _runs_sharing_one_example(tmp_path)
    assert pooled_delta.pooled(runs, resamples=100)["examples"] == 1  # as replicates: the one shared key
    r = pooled_delta.together(runs, resamples=500)
    assert r["examples"] == 4 and r["tasks"] == 2
    # single_1: -100 (a, 1K), -100 and 0 (b, 2K) -> -66.7; multikey_1: 0 -> macro -33.3
    assert r["pooled"] == pytest.approx((-200 / 3 + 0) / 2)
    assert r["per_run"] == [pytest.approx(-50.0), pytest.approx(-100 / 3)]  # b has no multikey_1: its macro is single_1's
    lo, hi = r["ci95"]
    assert lo <= r["pooled"] <= hi


def test_mixed_runs_average_the_examples_they_share_and_add_the_others(tmp_path):
    # the disjoint test's runs: the 1K single_1 example both answered (a: -100, b: 0) is averaged (-50)
    # instead of taking a's alone
    runs = _runs_sharing_one_example(tmp_path)
    r = pooled_delta.averaged(runs, resamples=500)
    assert (r["examples"], r["tasks"], r["replicated"]) == (4, 2, 1)
    # single_1: -50 (1K, both), -100 and 0 (2K, b) -> -50; multikey_1: 0 -> macro -25
    assert r["pooled"] == pytest.approx(-25.0)
    assert r["per_run"] == [pytest.approx(-50.0), pytest.approx(-100 / 3)]
    assert r["pooled"] != pooled_delta.together(runs, resamples=10)["pooled"]
    lo, hi = r["ci95"]
    assert lo <= r["pooled"] <= hi
    # each task's own figure: single_1 averages -50, -100, 0 (-50); multikey_1 its one 0
    (single, (lo1, hi1)), (multikey, _) = r["per_task"]["niah_single_1"], r["per_task"]["niah_multikey_1"]
    assert single == pytest.approx(-50.0) and multikey == 0.0 and lo1 <= -50.0 <= hi1 and lo1 < hi1


def test_a_run_is_dir_arm_and_chunk():
    directory, run = pooled_delta.parse_run("docs/results/x:minima-k4@256")
    assert directory == Path("docs/results/x") and (run.arm, run.chunk) == ("minima-k4", "256")
    with pytest.raises(argparse.ArgumentTypeError, match="DIR:ARM@CHUNK"):
        pooled_delta.parse_run("minima-k4@256")


def test_replicates_count_the_examples_that_repeat_their_change(tmp_path):
    # an example lost in every run is the arm's own (a replicate cannot average it away); one lost in
    # some runs only moved between calls
    keys = [("niah_single_3", 2048, i) for i in range(5)]
    runs = []
    for name, minima in (("a", [0, 0, 100, 100, 50]), ("b", [0, 100, 100, 100, 50]), ("c", [0, 0, 100, 0, 50])):
        d = tmp_path / name
        _answers(d, "fp8@default", dict(zip(keys, [100.0, 100.0, 0.0, 100.0, 0.0])))
        _answers(d, "minima@default", dict(zip(keys, map(float, minima))))
        runs.append(pooled_delta.paired(d, pooled_delta.niah.Run("minima", "default"), "fp8", 2048))
    r = pooled_delta.pooled(runs, resamples=100)
    # example 0 lost in all three; 1 lost in a and c, unchanged in b; 2 and 4 gained in all; 3 lost in c only
    assert (r["lost_in_every_run"], r["gained_in_every_run"], r["changed_in_some_runs"]) == (
        ["niah_single_3/2048/0"], 2, 2)


def test_one_policy_against_another_subtracts_each_sides_own_call_difference(tmp_path, capsys, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    keys = [("niah_single_1", 1024, 0), ("niah_single_1", 1024, 1), ("niah_multikey_1", 1024, 0)]
    # call a: FP8 missed single_1/0, the wide window answered it (+100 there); calls b and c: the
    # defaults lost single_1/1 in b only (-100, -> -50 averaged) and multikey_1/0 in both (-100);
    # c never answered single_1/0, so that example's defaults figure is b's alone (0)
    _answers(a, "fp8@default", {k: (0.0 if k == keys[0] else 100.0) for k in keys})
    _answers(a, "wide@default", dict.fromkeys(keys, 100.0))
    for d in (b, c):
        _answers(d, "fp8@default", dict.fromkeys(keys, 100.0))
    _answers(b, "defaults@default", {keys[0]: 100.0, keys[1]: 0.0, keys[2]: 0.0})
    _answers(c, "defaults@default", {keys[1]: 100.0, keys[2]: 0.0})

    def side(d: Path, arm: str) -> dict:
        return pooled_delta.paired(d, pooled_delta.niah.Run(arm, "default"), "fp8", None)

    r = pooled_delta.versus([side(a, "wide")], [side(b, "defaults"), side(c, "defaults")], resamples=500)
    # single_1: (+100 - 0) and (0 - -50) -> +75; multikey_1: 0 - -100 -> +100; macro +87.5
    assert (r["examples"], r["tasks"], r["sides"]) == (3, 2, (3, 3))
    assert r["pooled"] == pytest.approx(87.5)
    assert r["per_task"]["niah_single_1"][0] == pytest.approx(75.0)
    with pytest.raises(SystemExit, match="both policies"):
        pooled_delta.versus([side(a, "wide")], [{"other/1024/0": ("niah_single_1", 0.0)}], resamples=10)
    monkeypatch.setattr(sys, "argv", ["pooled_delta.py", "--run", f"{a}:wide@default", "--against",
                                      f"{b}:defaults@default", "--against", f"{c}:defaults@default"])
    pooled_delta.main()
    assert "pooled: +87.50" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--lost-keys", str(tmp_path / "lost")])
    with pytest.raises(SystemExit, match="--lost-keys"):
        pooled_delta.main()
