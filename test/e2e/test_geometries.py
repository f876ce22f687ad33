"""Real geometries on the GPU: random-weight models (``--load-format dummy``) served by Minima.

Llama-3-8B-class (32q/8kv/128, 32 layers) and Qwen3.6-27B's hybrid (Gated DeltaNet layers and 16
full-attention layers of 24q/4kv/256: only those are Minima's pool). A prompt of 2,000 random ids
and 16 new tokens: its prompt pages go Stale and decode reads them as TQ3. The weights are random,
so only the serving path is checked, not the answers.
"""

from __future__ import annotations

import random

import pytest
import requests

from minima_test_support.dummy_models import make_model, serve_flags
from minima_test_support.server import launch

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

FULL_ATTENTION = {"llama3-8b-class": (32, 8, 128), "qwen3.6-27b-class": (16, 4, 256)}  # layers, kv heads, dim


@pytest.mark.parametrize("name", sorted(FULL_ATTENTION))
def test_dummy_geometry_serves_with_tq3_pages(name, tmp_path):
    from sglang_minima.models import ensure_default_model

    model = make_model(name, tmp_path / "models", ensure_default_model())
    server = launch(serve_flags(model), tmp_path / "server.log")
    try:
        rng = random.Random(0)
        ids = [rng.randrange(100, 49000) for _ in range(2000)]
        r = requests.post(server.url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        }, timeout=600)
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == 16
        minima = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["minima"]
        pool, stats = minima["pool"], minima["stats"]
        assert (pool["num_layers"], pool["num_kv_heads"], pool["head_dim"]) == FULL_ATTENTION[name]
        assert stats["retier"]["pages"] > 0 and stats["route_tq3_pages"] > 0, stats
        print(f"\n[e2e] {name}: up in {server.startup_s:.0f}s, {stats['retier']['pages']} pages converted, "
              f"{stats['route_tq3_pages']} TQ3 page reads")
    finally:
        server.stop()
