"""minima_native inside real SGLang servers on CPU (``python -m sglang_minima.launch_server``).

(a) Hot pages in the model dtype, no Stale tier: greedy tokens equal SGLang's own torch_native
    server, chunked prefill, mixed chunks and radix-cache hits included.
(b) Stale enabled with one Recent page (and one Anchor page chosen by attention score): later
    prefill chunks and decode read TQ3 pages; generation completes, and its agreement with the
    FP8-only run is reported.
Both check the route counters in /server_info: pages per format, no fallback, scratch measured.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import requests

from minima_test_support.server import Server, launch
from minima_test_support.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
CHUNK = 64  # chunked prefill: a long prompt is prefilled in several extends over its cached prefix
NEW_TOKENS = 32
SHORT_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:\n"]
# Mixed chunks: decode requests ride along with the prefill chunks of the long prompts.
COMMON = ["--dtype", "float32", "--page-size", str(PAGE_SIZE), "--chunked-prefill-size", str(CHUNK),
          "--enable-mixed-chunk", "--max-total-tokens", "16384", "--skip-server-warmup"]


def _long_prompts() -> list[str]:
    """Source text from the standard library: a few hundred tokens each, the same everywhere."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8")[:1600] for name in ("heapq.py", "bisect.py", "textwrap.py")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _greedy(server: Server, prompts: list[str]) -> list[list[int]]:
    """One batched greedy /generate call (the prompts are scheduled together)."""
    r = requests.post(server.url + "/generate", json={
        "text": prompts,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }, timeout=600)
    r.raise_for_status()
    return [out["output_ids"] for out in r.json()]


def _minima_stats(server: Server) -> dict:
    info = requests.get(server.url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["minima"]["stats"]


def _serve(args: list[str], log: Path, batches: list[list[str]],
           module: str = "sglang_minima.launch_server") -> tuple[list[list[int]], dict | None]:
    """Start a server, generate greedily for each batch of prompts in turn, read Minima's stats, stop."""
    server = launch(args, log, module=module)
    try:
        tokens = [ids for prompts in batches for ids in _greedy(server, prompts)]
        stats = _minima_stats(server) if module == "sglang_minima.launch_server" else None
    finally:
        server.stop()
    return tokens, stats


def _batches() -> list[list[str]]:
    """Short and long prompts together, then prompts that extend two long ones: the second batch
    hits the radix cache and prefills its new tokens over the cached (by then partly Stale) prefix."""
    long = _long_prompts()
    return [SHORT_PROMPTS + long, [p + "\n\n# Tests\n" for p in long[:2]]]


def _assert_direct_path(stats: dict) -> None:
    assert stats["fallbacks"] == 0
    assert stats["peak_scratch_bytes"] > 0  # the torch path's decoded tiles and scores
    assert stats["route_hot_pages"] > 0 and stats["route_hot_tokens"] > 0


def test_greedy_tokens_equal_torch_native(tiny_model, tmp_path):
    batches = _batches()
    native, _ = _serve(
        ["--model-path", str(tiny_model), "--device", "cpu", "--attention-backend", "torch_native",
         "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled", *COMMON],
        tmp_path / "native.log", batches, module="sglang.launch_server",
    )
    minima, stats = _serve(
        ["--model-path", str(tiny_model), "--minima-hot-dtype", "auto", "--minima-disable-stale", *COMMON],
        tmp_path / "minima.log", batches,
    )
    assert [len(t) for t in minima] == [NEW_TOKENS] * len(native)
    assert minima == native
    _assert_direct_path(stats)
    assert stats["route_tq3_pages"] == stats["route_tq3_tokens"] == 0
    assert stats["prefix_hit_hot_pages"] > 0


def test_stale_pages_are_attended(tiny_model, tmp_path):
    batches = _batches()
    base = ["--model-path", str(tiny_model), *COMMON]
    fp8, fp8_stats = _serve([*base, "--minima-disable-stale"], tmp_path / "fp8.log", batches)
    tq3, stats = _serve([*base, "--minima-recent-pages", "1", "--minima-sink-pages", "1",
                         "--minima-anchor-pages", "1", "--minima-attention-score-anchors"],
                        tmp_path / "tq3.log", batches)
    assert [len(t) for t in tq3] == [NEW_TOKENS] * len(fp8)
    _assert_direct_path(fp8_stats)
    assert fp8_stats["route_tq3_pages"] == 0
    _assert_direct_path(stats)
    assert stats["retier"]["pages"] > 0
    assert stats["route_tq3_pages"] > 0
    assert stats["route_tq3_tokens"] == PAGE_SIZE * stats["route_tq3_pages"]  # Stale pages are full pages
    assert stats["prefix_hit_tq3_pages"] > 0  # the second batch extends over cached TQ3 pages
    total = NEW_TOKENS * len(fp8)
    same = sum(a == b for x, y in zip(fp8, tq3) for a, b in zip(x, y))
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS) for x, y in zip(fp8, tq3)]
    print(f"\n[stale] token agreement with the FP8-only run: {same}/{total} ({same / total:.1%}); "
          f"common prefix per prompt: {prefix}; route tq3 pages/tokens "
          f"{stats['route_tq3_pages']}/{stats['route_tq3_tokens']}, hot pages/tokens "
          f"{stats['route_hot_pages']}/{stats['route_hot_tokens']}")


def test_observation_window_pins_anchors_when_prefills_end(tiny_model, tmp_path):
    """--minima-anchor-window in a real server: each long prompt's last queries pick the pages kept
    hot once its chunked prefill ends (deferred conversion: no page converts before), the rest
    converts, and generation completes on the torch path without fallback."""
    batches = _batches()
    tokens, stats = _serve(["--model-path", str(tiny_model), *COMMON, "--minima-recent-pages", "1",
                            "--minima-sink-pages", "1", "--minima-anchor-pages", "2", "--minima-anchor-window", "32",
                            "--minima-defer-prefill-conversion"], tmp_path / "window.log", batches)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * sum(map(len, batches))
    _assert_direct_path(stats)
    # the three long prompts (~20-25 pages of 16 tokens each) pin two pages each; later requests may add more
    assert stats["window_anchor_pages"] >= 2 * len(_long_prompts())
    assert stats["retier"]["pages"] > 0 and stats["route_tq3_pages"] > 0
