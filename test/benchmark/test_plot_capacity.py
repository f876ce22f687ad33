"""benchmark/serving/plot_capacity.py's TPOT split: the part of a round's TPOT spent in stalls, drawn
hatched on the TPOT bar (the reading of #16 (a): prefill between decode steps, the same in every arm)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "serving"))

import plot_capacity  # noqa: E402


def test_the_stall_share_cuts_the_tpot_and_a_run_without_it_is_not_cut() -> None:
    # long_32k_1523's FP8 arm: 58.3% of its gaps in stalls
    outside, inside = plot_capacity.tpot_split({"mean_tpot_ms": 39.17, "itl_stall_share": 0.583})
    assert (round(outside, 2), round(inside, 2)) == (16.33, 22.84)
    assert plot_capacity.tpot_split({"mean_tpot_ms": 39.17, "itl_stall_share": 0.0}) == (39.17, 0.0)
    assert plot_capacity.tpot_split({"mean_tpot_ms": 39.17, "itl_stall_share": None}) is None  # before the figure
    assert plot_capacity.tpot_split({"mean_tpot_ms": None, "itl_stall_share": 0.5}) is None   # a failed round


@pytest.mark.parametrize("share", [0.583, None])
def test_a_run_plots_with_and_without_the_stall_figure(tmp_path: Path, share: float | None) -> None:
    res = {"arm": "sglang-fp8", "clients": 8, "num_prompts": 8, "output_throughput": 128.5, "mean_ttft_ms": 5931.0,
           "mean_tpot_ms": 39.17, "peak_running_requests": 8, "itl_stall_share": share}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"device": "cuda", "args": {"budget_mib": "20480"}, "results": [res]}))
    out = tmp_path / "run.png"
    subprocess.run([sys.executable, str(ROOT / "benchmark" / "serving" / "plot_capacity.py"), str(run), "--out", str(out)],
                   check=True, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
