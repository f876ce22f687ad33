"""The real server on CPU: native and OpenAI APIs, frontend programs on the radix cache,
bench_serving, the plugin inside the scheduler process, and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

pytestmark = pytest.mark.e2e


def _generate(url: str, text: str, max_new_tokens: int = 8) -> dict:
    r = requests.post(url + "/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }, timeout=120)
    r.raise_for_status()
    return r.json()


def test_generate(default_server):
    out = _generate(default_server.url, "The capital of France is", 8)
    assert out["meta_info"]["completion_tokens"] == 8
    assert len(out["output_ids"]) == 8
    assert "Paris" in out["text"]


def test_openai_completions(default_server):
    r = requests.post(default_server.url + "/v1/completions", json={
        "model": "default", "prompt": "1, 2, 3, 4,", "max_tokens": 6, "temperature": 0,
    }, timeout=120)
    r.raise_for_status()
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["text"].strip().startswith("5")


def test_openai_chat_completions(default_server):
    r = requests.post(default_server.url + "/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0,
    }, timeout=120)
    r.raise_for_status()
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 16


def test_plugin_registered_in_scheduler_process(default_server):
    info = requests.get(default_server.url + "/server_info", timeout=30).json()
    minima = info["internal_states"][0]["minima"]
    registered = minima["plugin"]["registered"]
    # The section is produced in the scheduler process, where register() also ran (entry point).
    assert registered["pid"] == minima["plugin"]["reporting_pid"]
    assert registered["pid"] != default_server.process.pid
    assert info["radix_cache_backend"] == "minima"


FRONTEND_PROGRAM = r'''
import json, sys
import sglang as sgl

PREFIX = "You are a careful assistant. Read the whole document before answering.\n" + "".join(
    f"Section {i}: the value of item {i} is {i * 7 % 13}.\n" for i in range(40))

@sgl.function
def branches(s, question):
    s += PREFIX
    s += "Question: " + question + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Branch {i} answer:"
        f += sgl.gen("ans", max_tokens=6, temperature=0)
    s += "Summary:" + "".join(f" [{i}] " + f["ans"] for i, f in enumerate(forks))
    s += sgl.gen("final", max_tokens=6, temperature=0)

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
states = branches.run_batch([{"question": f"What is item {q}?"} for q in range(2)])
cached = [st.get_meta_info("final")["cached_tokens"] for st in states]
print(json.dumps({"cached": cached, "finals": [st["final"] for st in states]}))
'''


def test_frontend_fork_program_hits_radix_cache(default_server):
    out = subprocess.run([sys.executable, "-c", FRONTEND_PROGRAM, default_server.url],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(len(f) > 0 for f in result["finals"])
    # The shared prefix (>= 600 tokens, several pages) is served from the radix cache.
    assert max(result["cached"]) >= 512, result
    metrics = requests.get(default_server.url + "/metrics", timeout=30).text
    cached_total = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("sglang:cached_tokens_total"))
    assert cached_total > 0


def test_bench_serving_generated_shared_prefix(default_server, tmp_path):
    from sglang_minima.models import default_model_dir

    out_file = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", default_server.url, "--tokenizer", str(default_model_dir()),
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
           "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "256",
           "--gsp-question-len", "32", "--gsp-output-len", "16", "--num-prompts", "8",
           "--max-concurrency", "4", "--output-file", str(out_file), "--seed", "1"]
    env = {**os.environ, "HOME": str(tmp_path)}  # bench_serving caches prompts under ~/.cache
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    assert result["completed"] == 8
    assert result["output_throughput"] > 0
    print(f"\n[e2e] bench_serving: {result['completed']} requests, "
          f"output {result['output_throughput']:.1f} tok/s, mean TTFT {result['mean_ttft_ms']:.0f} ms")


def test_server_keeps_serving_after_bad_request(default_server):
    r = requests.post(default_server.url + "/generate", json={
        "text": "hello", "sampling_params": {"max_new_tokens": -5},
    }, timeout=60)
    assert r.status_code >= 400
    assert _generate(default_server.url, "The capital of France is", 4)["meta_info"]["completion_tokens"] == 4
