"""benchmark/serving/trace_summary.py (profile_decode.py's): what counts as host time in a scope."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "serving"))

from minima_test_support.sglang_log import scheduler_log  # noqa: E402
from trace_summary import summarize_trace  # noqa: E402


def _ev(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_a_scope_counts_its_host_span_not_its_gpu_span():
    # The profiler writes each record_function range twice: on the host (user_annotation) and as the
    # span of the kernels it launched on the GPU timeline (gpu_user_annotation), which can be longer.
    trace = {"traceEvents": [
        _ev("minima.lifecycle", "user_annotation", 0, 1000),
        _ev("minima.lifecycle", "gpu_user_annotation", 200, 3000),
        _ev("aten::add", "cpu_op", 100, 50),
        _ev("fused_kernel", "kernel", 300, 400),
        _ev("minima.plan", "user_annotation", 1500, 500),
        _ev("cudaStreamSynchronize", "cuda_runtime", 1600, 300),
    ]}
    s = summarize_trace(trace, steps=2)
    assert s["scopes_ms_per_step"]["minima.lifecycle"] == 0.5
    assert s["scope_gpu_spans_ms_per_step"]["minima.lifecycle"] == 1.5
    assert s["scopes_ms_per_step"]["minima.plan"] == 0.25
    assert s["wall_ms_per_step"] == 1.0  # host events only: 0 .. 2000 us over 2 steps
    assert s["gpu_ms_per_step"] == 0.2
    assert s["top_host_ops_ms_per_step"] == {"aten::add": 0.025}
    assert s["top_runtime_calls_ms_per_step"] == {"cudaStreamSynchronize": 0.15}
    assert s["ragged_prefill_launches"] == 0  # no extend step in this window


def test_ragged_prefill_launches_mark_an_extend_step_in_the_window():
    # SGLang's flashinfer and Minima attend an extend's new tokens with FlashInfer's ragged prefill
    # (the SM90 kernel names its RaggedParams, the older one is BatchPrefillWithRagged...); decodes
    # read paged KV (BatchPrefillWithPagedKVCacheKernel is the tensor-core decode)
    trace = {"traceEvents": [
        _ev("BatchPrefillWithPagedKVCacheKernel<...>", "kernel", 0, 10),
        _ev("flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<RaggedParams::A>>", "kernel", 20, 10),
        _ev("BatchPrefillWithRaggedKVCacheKernel<...>", "kernel", 40, 10),
    ]}
    assert summarize_trace(trace, steps=1)["ragged_prefill_launches"] == 2


def test_profile_decode_summarizes_saved_traces_without_a_server(tmp_path):
    # a subprocess: profile_decode imports serve_arms, which sets SGLang's CPU engine up before SGLang
    # is imported (this test process may have imported it already)
    import gzip
    import json
    import subprocess

    trace = {"traceEvents": [_ev("minima.kv_write", "user_annotation", 0, 4000), _ev("k", "kernel", 10, 1000)]}
    # Minima's window also caught an extend step: FlashInfer's ragged prefill (no time, so the figures stay)
    extend = _ev("flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<RaggedParams>>", "kernel", 20, 0)
    for arm, events in (("sglang-fp8-eager", []), ("minima", [extend])):
        (tmp_path / f"{arm}-trace").mkdir()
        with gzip.open(tmp_path / f"{arm}-trace" / f"{arm}-TP-0.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": trace["traceEvents"] + events}, f)
    (tmp_path / "minima-fp8-trace").mkdir()  # an arm whose trace was never written
    # the servers' logs beside the traces: the logged throughput comes with the summary
    (tmp_path / "minima.log").write_text(scheduler_log([1000.0] * 5 + [2000.0, 3000.0, 4000.0]))
    (tmp_path / "sglang-fp8-eager.log").write_text(scheduler_log([1000.0] * 5 + [4000.0, 6000.0, 8000.0]))
    script = Path(__file__).resolve().parents[2] / "benchmark" / "serving" / "profile_decode.py"

    def run(arms: str, out: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--arms", arms, "--steps", "2", "--from-traces",
                               str(tmp_path), "--work", str(tmp_path / "w"), "--out", str(tmp_path / out), *more],
                              capture_output=True, text=True, timeout=300)

    assert run("sglang-fp8-eager,minima", "p.json").returncode == 0
    out = json.loads((tmp_path / "p.json").read_text())
    assert [r["arm"] for r in out["results"]] == ["sglang-fp8-eager", "minima"]
    assert out["results"][1]["scopes_ms_per_step"]["minima.kv_write"] == 2.0
    md = (tmp_path / "p.md").read_text()
    assert "| minima | - | 2.0 | 0.5 |" in md  # requests decoding: not known from saved traces
    assert out["results"][1]["log_throughput"]["prefill"]["median"] == 3000.0
    assert "| minima | 3 x 256 | 3,000 [2,000-4,000] | 0.50 | - | - | - |" in md  # against the first arm's 6,000
    assert "**minima: not a decode profile.** Its window holds extend steps (a wave's prefill): 1 launches" in md
    assert "sglang-fp8-eager: not a decode profile" not in md
    # a prefill profile (one output token) is made of extend steps: nothing to say
    assert run("minima", "r.json", "--output-len", "1").returncode == 0
    assert "not a decode profile" not in (tmp_path / "r.md").read_text()
    failed = run("minima-fp8", "q.json")
    assert failed.returncode != 0 and "no complete trace" in failed.stderr


def test_a_decode_profile_sizes_the_pool_to_its_load():
    # every request's prompt and output in whole pages, and one request more; a prefill profile (one
    # output token) keeps the harness's pool, and a pool given with the servers' flags wins (a
    # subprocess: see above)
    import subprocess

    code = """
import types, profile_decode as p
def flags(output_len, server_args=()):
    a = types.SimpleNamespace(page_size=64, dtype="bfloat16", batch=26, input_len=4096, output_len=output_len,
                              server_args=list(server_args))
    f = p.server_flags(a, "m", ["--load-format", "dummy"])
    return f[f.index("--max-total-tokens") + 1] if "--max-total-tokens" in f else "-"
print(flags(2048), flags(1), flags(2048, ["--max-total-tokens=5"]), p.load_tokens(2, 100, 1, 64))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2] / "benchmark" / "serving")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["165888", "-", "-", "384"]  # 27 x 6,144: one request of headroom
