"""Greedy output through Minima (hot pages in the model dtype, no Stale tier) equals Hugging Face."""

from __future__ import annotations

import pytest
import requests

from minima_test_support.server import launch
from minima_test_support.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox"]
NEW_TOKENS = 24


def _hf_greedy(model, ids):
    """Plain argmax decoding (generate()'s min_new_tokens would mask EOS, which ignore_eos keeps)."""
    import torch

    out = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_greedy_matches_transformers(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [_hf_greedy(model, tok(prompt, return_tensors="pt").input_ids) for prompt in PROMPTS]

    # model-dtype hot pages: the torch path on every device (the GPU kernels read FP8 pages)
    server = launch(["--model-path", str(model_dir), "--dtype", "float32", "--page-size", "16",
                     "--attention-backend", "minima_native", "--minima-hot-dtype", "auto", "--minima-disable-stale"],
                    tmp_path_factory.mktemp("parity") / "server.log")
    try:
        for prompt, want in zip(PROMPTS, expected):
            r = requests.post(server.url + "/generate", json={
                "text": prompt,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            }, timeout=120)
            r.raise_for_status()
            assert r.json()["output_ids"] == want, prompt
    finally:
        server.stop()
