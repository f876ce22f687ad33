"""Faults at the edges of capacity, through a real server whose whole KV pool is 1024 tokens (16
logical pages of 64): a request larger than the pool gets a clear error at once, and a client
that disconnects during its prefill leaves nothing behind (docs/results/reliability/bad_input.md)."""

from __future__ import annotations

import re
import time

import pytest
import requests

from minima_test_support.idle import assert_idle

pytestmark = pytest.mark.e2e

CAPACITY = 1024


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    from minima_test_support.server import launch

    log = tmp_path_factory.mktemp("small") / "server.log"
    server = launch(["--enable-metrics", "--max-total-tokens", str(CAPACITY), "--max-running-requests", "4"], log,
                    env={"SGLANG_DEBUG_MEMORY_POOL": "1"})
    yield server
    server.stop()


def _ids(n: int, seed: int = 0) -> list[int]:
    return [200 + (i * 7 + seed * 131) % 5000 for i in range(n)]


def _still_serving(url: str) -> None:
    r = requests.post(url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }, timeout=300)
    assert r.status_code == 200 and "Paris" in r.json()["text"], r.text[:500]


def _counter(url: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in requests.get(url + "/metrics", timeout=30).text.splitlines()
               if line.startswith(name + "{"))


@pytest.mark.parametrize("prompt_tokens", [CAPACITY + 76, 2 * CAPACITY])
def test_request_larger_than_the_pool_gets_a_clear_error_not_a_hang(small_server, prompt_tokens):
    info = requests.get(small_server.url + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["minima"]["pool"]["logical_pages"] * 64 == CAPACITY
    t0 = time.time()
    r = requests.post(small_server.url + "/generate", json={
        "input_ids": _ids(prompt_tokens), "sampling_params": {"max_new_tokens": 4},
    }, timeout=120)
    # SGLang's scheduler refuses it before any page is allocated (the context length, 8192, would allow it).
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]  # observed: "... the maximum allowed length (1018 tokens). ..."
    allowed = re.search(rf"Input length \({prompt_tokens} tokens\) exceeds the maximum allowed length \((\d+) tokens\)",
                        message)
    assert allowed and int(allowed.group(1)) < CAPACITY, message
    assert time.time() - t0 < 30
    _still_serving(small_server.url)
    assert_idle(small_server.url)


def test_client_killed_mid_prefill_frees_everything(small_server):
    url = small_server.url
    aborted = _counter(url, "sglang:num_aborted_requests_total")
    # 600 tokens: more than one prefill chunk (the FP8 pages bound each chunk), seconds of prefill on CPU.
    body = {"input_ids": _ids(600, seed=1), "stream": True,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        deadline = time.time() + 120
        while True:  # wait until its first pages are allocated, i.e. its prefill runs
            rows = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]["minima"]["memory"]["rows"]
            if rows["recent"]["pages"] + rows["anchor"]["pages"] > 0 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert rows["recent"]["pages"] + rows["anchor"]["pages"] > 0, rows
    # The stream was closed before its first token: SGLang aborts the request.
    deadline = time.time() + 120
    while _counter(url, "sglang:num_aborted_requests_total") == aborted and time.time() < deadline:
        time.sleep(0.5)
    assert _counter(url, "sglang:num_aborted_requests_total") == aborted + 1
    assert_idle(url, timeout_s=120)
    _still_serving(url)
