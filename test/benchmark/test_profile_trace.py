"""benchmark/serving/trace_summary.py (profile_decode.py's): what counts as host time in a scope."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "serving"))

from trace_summary import log_throughput, summarize_trace, wait_for_rows  # noqa: E402


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


def test_profile_decode_summarizes_saved_traces_without_a_server(tmp_path):
    # a subprocess: profile_decode imports serve_arms, which sets SGLang's CPU engine up before SGLang
    # is imported (this test process may have imported it already)
    import gzip
    import json
    import subprocess

    trace = {"traceEvents": [_ev("minima.kv_write", "user_annotation", 0, 4000), _ev("k", "kernel", 10, 1000)]}
    for arm in ("sglang-fp8-eager", "minima"):
        (tmp_path / f"{arm}-trace").mkdir()
        with gzip.open(tmp_path / f"{arm}-trace" / f"{arm}-TP-0.trace.json.gz", "wt") as f:
            json.dump(trace, f)
    (tmp_path / "minima-fp8-trace").mkdir()  # an arm whose trace was never written
    # the servers' logs beside the traces: the logged throughput comes with the summary
    (tmp_path / "minima.log").write_text(_log([1000.0] * 5 + [2000.0, 3000.0, 4000.0]))
    (tmp_path / "sglang-fp8-eager.log").write_text(_log([1000.0] * 5 + [4000.0, 6000.0, 8000.0]))
    script = Path(__file__).resolve().parents[2] / "benchmark" / "serving" / "profile_decode.py"

    def run(arms: str, out: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--arms", arms, "--steps", "2", "--from-traces",
                               str(tmp_path), "--work", str(tmp_path / "w"), "--out", str(tmp_path / out)],
                              capture_output=True, text=True, timeout=300)

    assert run("sglang-fp8-eager,minima", "p.json").returncode == 0
    out = json.loads((tmp_path / "p.json").read_text())
    assert [r["arm"] for r in out["results"]] == ["sglang-fp8-eager", "minima"]
    assert out["results"][1]["scopes_ms_per_step"]["minima.kv_write"] == 2.0
    md = (tmp_path / "p.md").read_text()
    assert "| minima | - | 2.0 | 0.5 |" in md  # requests decoding: not known from saved traces
    assert out["results"][1]["log_throughput"]["prefill"]["median"] == 3000.0
    assert "| minima | 3 x 256 | 3,000 [2,000-4,000] | 0.50 | - | - | - |" in md  # against the first arm's 6,000
    failed = run("minima-fp8", "q.json")
    assert failed.returncode != 0 and "no complete trace" in failed.stderr


def test_a_decode_profile_sizes_the_pool_to_its_load():
    # every request's prompt and output in whole pages; a prefill profile (one output token) keeps the
    # harness's pool, and a pool given with the servers' flags wins (a subprocess: see above)
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
    assert out.stdout.split() == ["159744", "-", "-", "256"]


def test_a_decode_profile_waits_for_every_request_to_decode(tmp_path):
    # SGLang's decode lines as the load ramps up: the wait ends at the first with the whole batch
    # running and none queued, not at a fixed time (2026-12-06: one arm profiled prefill steps)
    import threading
    import time

    def line(running: int, queued: int) -> str:
        return (f"[t] Decode batch, #running-req: {running}, #token: 9, token usage: 0.1, cuda graph: True, "
                f"gen throughput (token/s): 1.0, #queue-req: {queued}\n")

    log = tmp_path / "server.log"
    log.write_text(line(26, 0))  # before the load (the server's warm-up, say): not counted
    start = log.stat().st_size

    def ramp(lines):
        for text in lines:
            time.sleep(0.6)
            with open(log, "a") as f:
                f.write(text)

    writer = threading.Thread(target=ramp, args=([line(1, 25), line(5, 21), line(26, 0)],))
    t0 = time.time()
    writer.start()
    assert wait_for_rows(log, start, 26, timeout_s=60) == 26
    assert time.time() - t0 >= 1.5  # it waited for the third line
    writer.join()
    # a pool that never holds the batch: the running requests of the last line at the deadline
    log.write_text(line(26, 0))
    writer = threading.Thread(target=ramp, args=([line(5, 21)],))
    writer.start()
    assert wait_for_rows(log, log.stat().st_size, 26, timeout_s=2) == 5
    writer.join()
    assert wait_for_rows(tmp_path / "server.log", log.stat().st_size, 26, timeout_s=0) == 0  # no line yet
    # settling: the whole batch on more than one line before the profile starts
    log.write_text("")
    writer = threading.Thread(target=ramp, args=([line(26, 0), line(26, 0), line(26, 0)],))
    t0 = time.time()
    writer.start()
    assert wait_for_rows(log, 0, 26, timeout_s=60, lines=3) == 26
    assert time.time() - t0 >= 1.7  # the third line, not the first
    writer.join()


def _log(prefill_tok_s: list[float], decode: list[tuple[int, float]] = ()) -> str:
    """SGLang 0.5.23's scheduler lines: a partial prefill batch, full ones, then decode batches."""
    lines = ["[t] Prefill batch, #new-seq: 1, #new-token: 6, #cached-token: 0, token usage: 0.00, "
             "cuda graph: False, input throughput (token/s): 99999.0"]
    lines += [f"[t] Prefill batch, #new-seq: 2, #new-token: 256, #cached-token: 0, token usage: 0.02, #running-req: 0, "
              f"#queue-req: 6, #pending-token: 1792, cuda graph: True, input throughput (token/s): {t}" for t in prefill_tok_s]
    lines += [f"[t] Decode batch [7], #running-req: {n}, #token: 9, token usage: 0.9, cuda graph: True, "
              f"gen throughput (token/s): {t}, #queue-req: 0" for n, t in decode]
    return "\n".join(lines) + "\n"


def test_logged_throughput_counts_full_batches_before_the_profile():
    decode = [(8, 100.0)] * 5 + [(8, 300.0), (4, 9999.0), (8, 500.0), (8, 700.0)]
    log = _log([50.0] * 5 + [10.0, 20.0, 30.0, 40.0], decode)
    log += "[t] Profiling starts. Traces will be saved to: x\n" + _log([1e6] * 20)  # profiled: left out
    got = log_throughput(log)
    # prefill: the 256-token batches, the first five dropped (the 6-token batch is not a full one)
    assert got["prefill"] == {"size": 256, "batches": 4, "median": 25.0, "q1": 12.5, "q3": 37.5}
    # decode: at the most running requests (8), first five dropped; the 4-row batch left out
    assert got["decode"] == {"size": 8, "batches": 3, "median": 500.0, "q1": 300.0, "q3": 700.0}
    assert log_throughput(_log([10.0] * 7)) == {}  # two batches after the warm-up: too few for quartiles
