"""benchmark/quality/perplexity.py's report: the paired NLL difference and the perplexity ratio
from per-window JSONL (no server is started)."""

import json
import math
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah  # noqa: E402
import perplexity  # noqa: E402


def _write(out: Path, label: str, windows: dict[int, list[float]], tq3_tokens: int) -> None:
    (out / "nll").mkdir(parents=True, exist_ok=True)
    routes = {"route_hot_pages": 0, "route_tq3_pages": 0, "route_hot_tokens": 0, "route_tq3_tokens": tq3_tokens,
              "retier_pages": 2 if tq3_tokens else 0}
    (out / "nll" / f"{label}.jsonl").write_text("".join(
        json.dumps({"window": w, "tokens": len(n), "nll": n, "seconds": 0.1, "routes": routes}) + "\n"
        for w, n in windows.items()))


def test_ratio_is_exp_of_the_token_weighted_mean_difference(tmp_path):
    _write(tmp_path, "minima-nostale@128", {0: [1.0, 2.0], 1: [3.0, 3.0, 3.0]}, 0)
    _write(tmp_path, "minima@128", {0: [1.2, 2.2], 1: [3.0, 3.0, 3.3]}, 64)
    _write(tmp_path, "minima-k4@128", {0: [1.0, 2.0]}, 0)  # one window, and it read no TQ3 page
    args = Namespace(out=tmp_path, reference="minima-nostale", chunk="128", bootstrap=200, device="cpu", window=3,
                     text="essays")
    runs = [niah.Run(a, "128") for a in ("minima-nostale", "minima", "minima-k4")]
    rows = {r["run"]: r for r in perplexity.report(runs, args)["rows"]}
    m = rows["minima@128"]
    assert math.isclose(m["delta_nll"], 0.7 / 5)  # (0.2 + 0.2 + 0.3) over 5 tokens, not the windows' mean 0.15
    assert math.isclose(m["ppl_ratio_pct"], 100 * (math.exp(0.14) - 1))
    assert m["delta_nll_ci"][0] <= m["delta_nll"] <= m["delta_nll_ci"][1]
    assert (m["tq3_tokens_read"], m["pages_converted"], m["windows_without_tq3"]) == (128, 4, 0)
    k4 = rows["minima-k4@128"]
    assert k4["delta_nll"] == 0.0 and k4["windows_without_tq3"] == 1  # reported, not hidden
    assert math.isclose(rows["minima-nostale@128"]["perplexity"], math.exp(12.0 / 5))


def test_agreement_counts_equal_positions_first_divergence_and_identical_generations():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]  # identical; differs at 1; differs at 0
    a = perplexity.agreement(got, ref, resamples=200)
    assert math.isclose(a["token_agreement"], (4 + 3 + 3) / 12)
    assert a["first_divergence_mean"] == (4 + 1 + 0) / 3 and a["identical_generations"] == 1
    assert (a["generations"], a["generated_tokens"]) == (3, 12)
    assert a["token_agreement_ci"][0] <= a["token_agreement"] <= a["token_agreement_ci"][1]
    assert perplexity.agreement([[7, 7]], [[7, 7]], resamples=10)["token_agreement_ci"] == [1.0, 1.0]
