"""Minima's tiers through the real server with the default model: Stale (TQ3) pages are created,
attended and shared as prefix hits; concurrent requests with aborts leave no page behind."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.e2e


def _minima(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["minima"]


SEQUENTIAL_PROGRAM = r'''
import json, sys
import sglang as sgl

DOC = "Inventory of the northern warehouse, read carefully.\n" + "".join(
    f"Shelf {i}: {i * 3 % 17} crates of item {i * 11 % 23}.\n" for i in range(60))

@sgl.function
def ask(s, question):
    s += DOC + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=12, temperature=0)

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
first = ask.run(question="How many crates are on shelf 4?")
first_answer = first["answer"]  # run() executes in the background: wait before the second program
second = ask.run(question="Which item is on shelf 9?")
print(json.dumps({"answers": [first_answer, second["answer"]],
                  "cached": second.get_meta_info("answer")["cached_tokens"]}))
'''


def test_prefix_hits_on_tq3_pages(default_server):
    """The first program's document pages go Stale while it decodes; the second hits them as TQ3."""
    before = _minima(default_server.url)["stats"]
    out = subprocess.run([sys.executable, "-c", SEQUENTIAL_PROGRAM, default_server.url],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(a.strip() for a in result["answers"])
    after = _minima(default_server.url)["stats"]
    assert after["retier"]["pages"] > before["retier"]["pages"]
    assert after["route_tq3_pages"] > before["route_tq3_pages"]
    assert after["prefix_hit_tq3_pages"] > before["prefix_hit_tq3_pages"], (before, after)
    assert result["cached"] >= 64 * (after["prefix_hit_tq3_pages"] - before["prefix_hit_tq3_pages"])
    assert after["fallbacks"] == 0 and after["peak_scratch_bytes"] > 0  # tiles decoded from TQ3 pages
    # the document's pages were all hot at once (written, then converted at a later tick), and the TQ3
    # pool held at least the pages the second program hit
    pool, hits = _minima(default_server.url)["pool"], after["prefix_hit_tq3_pages"] - before["prefix_hit_tq3_pages"]
    assert result["cached"] // 64 <= pool["peak_hot_pages_held"] <= pool["hot_pages"]
    assert hits <= pool["peak_tq3_pages_held"] <= pool["tq3_pages"]


@pytest.mark.parametrize("flags,option,delta", [
    # the mean key: H x D fp16 more a page
    (["--minima-key-center"], {"key_center": True}, lambda h, p, d: h * d * 2),
    # no zero point: H x P fp16 fewer
    (["--minima-value-code", "lloyd-max"], {"value_code": "lloyd-max"}, lambda h, p, d: -h * p * 2),
    # one more bit a value element: H x P x D / 8 bytes more
    (["--minima-value-bits", "4"], {"value_bits": 4}, lambda h, p, d: h * p * d // 8),
], ids=["key_center", "lloyd_max_values", "4bit_values"])
def test_layout_options_serve(tmp_path, flags, option, delta):
    """``--minima-key-center`` / ``--minima-value-code lloyd-max`` / ``--minima-value-bits 4``: TQ3
    pages carry the option's fields (the pool's page bytes say so), later prefill chunks and the
    decode read them, and the programs answer with no fallback (on CPU the torch path; on CUDA the
    values' options take it too, page-centered keys the kernels)."""
    from minima_test_support.server import launch

    from sglang_minima.codec.layout import TQ3PageLayout

    server = launch([*flags, "--chunked-prefill-size", "128"], tmp_path / "layout.log")
    try:
        pool = _minima(server.url)["pool"]
        h, p, d = pool["num_kv_heads"], pool["page_size"], pool["head_dim"]
        layout = TQ3PageLayout(h, p, d, 4, **option)
        assert (pool["tq3_key_bits"], pool["tq3_key_center"], pool["tq3_value_code"], pool["tq3_value_bits"]) == (
            4, layout.key_center, layout.value_code, layout.value_bits)
        assert pool["tq3_page_bytes_per_layer"] == layout.page_bytes
        assert layout.page_bytes - TQ3PageLayout(h, p, d, 4).page_bytes == delta(h, p, d)
        out = subprocess.run([sys.executable, "-c", SEQUENTIAL_PROGRAM, server.url],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert all(a.strip() for a in json.loads(out.stdout.strip().splitlines()[-1])["answers"])
        stats = _minima(server.url)["stats"]
        assert stats["retier"]["pages"] > 0 and stats["route_tq3_pages"] > 0 and stats["fallbacks"] == 0
    finally:
        server.stop()


def _stream(url: str, text: str, max_new_tokens: int, abort_after: int | None, results: list, i: int) -> None:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    chunks, completion_tokens = 0, 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks += 1
                # A chunk may carry several tokens: count tokens from the response's own meta.
                completion_tokens = json.loads(line[len(b"data:"):])["meta_info"]["completion_tokens"]
                if abort_after is not None and chunks >= abort_after:
                    break  # closing the stream makes SGLang abort the request
    results[i] = completion_tokens


def test_concurrent_requests_with_aborts_leave_no_pages(default_server):
    url = default_server.url
    prompt = "Write a long story about a lighthouse keeper. " * 40  # ~400 tokens: several pages
    results: list[int | None] = [None] * 6
    threads = [threading.Thread(target=_stream, args=(url, f"{i}. {prompt}", 48, 3 if i % 2 else None, results, i))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert all(r is not None for r in results), results
    assert all(results[i] == 48 for i in range(0, 6, 2)), results  # the ones not aborted finished
    assert all(results[i] < 48 for i in range(1, 6, 2)), results
    # Idle again: SGLang's own idle check (available + evictable + protected == total) runs in the
    # scheduler and would kill it on a leak; the server must still serve and account every byte.
    deadline = time.time() + 120
    while time.time() < deadline:
        info = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
        if info["minima"]["memory"]["rows"]["held_hot"]["pages"] == 0 and info["minima"]["memory"]["rows"]["held_tq3"]["pages"] == 0:
            break
        time.sleep(1)
    memory = info["minima"]["memory"]
    assert memory["accounted_bytes"] == memory["allocated_bytes"]
    assert memory["rows"]["held_hot"]["pages"] == 0 and memory["rows"]["held_tq3"]["pages"] == 0
    r = requests.post(url + "/generate", json={"text": "The capital of France is",
                                               "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    assert requests.get(url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("tick_pages", [1, 8], ids=["tick-every-page", "tick-every-8-pages"])
def test_few_fp8_pages_admit_long_prompts_without_crashing(tmp_path, tick_pages):
    """With 10% FP8 pages a batch of long prompts needs more new pages than there are FP8 pages:
    admission must chunk and defer by the FP8 pages left (then convert), never fail allocation;
    also when the lifecycle ticks only every 8 new pages (--minima-tick-min-new-pages), where the
    short FP8 pool must bring the tick forward and the allocator's pressure path does the rest."""
    from concurrent.futures import ThreadPoolExecutor

    from minima_test_support.server import launch

    server = launch(["--minima-fp8-page-fraction", "0.1", "--max-total-tokens", "8192",
                     "--max-running-requests", "8", "--minima-tick-min-new-pages", str(tick_pages)],
                    tmp_path / "lean.log", env={"SGLANG_DEBUG_MEMORY_POOL": "1"})
    try:
        info = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["minima"]
        assert info["pool"]["hot_pages"] * 64 < 6 * 900  # the batch below cannot all be FP8 at once

        def ask(i: int) -> dict:
            text = f"Request {i}. " + " ".join(f"word{i}_{j}" for j in range(300))  # ~900 tokens
            r = requests.post(server.url + "/generate", json={
                "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            }, timeout=900)
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(ask, range(6)))
        assert all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
        stats = _minima(server.url)["stats"]
        assert stats["retier"]["pages"] + stats["pressure_retier_pages"] > 0
        assert stats["prefill_hot_deferrals"] > 0  # put off to a later step by the FP8 pages, not refused
        assert stats["lifecycle_ticks"] > 0
        # every page boundary ticks by default; every 8 pages, some steps' ticks wait
        assert (stats["lifecycle_ticks_deferred"] > 0) == (tick_pages > 1)
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.stop()
