"""A torch-profiler Chrome trace (what SGLang's /start_profile writes) summed per step: Minima's
profiler scopes (host time), host ops, CUDA runtime calls (where a host sync waits), GPU kernels and
the window's wall time; the throughput the server logged before the profile, and the wait for its
decode lines to show the whole load running. Pure Python:
benchmark/serving/profile_decode.py reads it, test/benchmark tests it."""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

SCOPES = ("minima.plan", "minima.kernel_plan", "minima.decode_kernels", "minima.prefill_kernels", "minima.prefill_tq3",
          "minima.kv_write", "minima.lifecycle")


def summarize_trace(trace: dict, steps: int, top: int = 15) -> dict:
    """Totals per step from a Chrome trace: Minima's scopes, host ops (``cpu_op``), CUDA runtime and
    driver calls (a launch's cost, or a sync's wait), GPU kernels and the wall time of the profiled
    window (its first to last host event)."""
    scopes: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    gpu: dict[str, float] = defaultdict(float)
    gpu_spans: dict[str, float] = defaultdict(float)
    runtime: dict[str, float] = defaultdict(float)  # CUDA runtime / driver calls: a sync's wait shows here
    start, end = float("inf"), 0.0
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, cat, dur = ev.get("name", ""), ev.get("cat", ""), float(ev["dur"])
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu[name] += dur
            continue
        if cat == "gpu_user_annotation":  # a scope's span on the GPU timeline: not host time
            gpu_spans[name] += dur
            continue
        start, end = min(start, float(ev["ts"])), max(end, float(ev["ts"]) + dur)
        if name in SCOPES:
            scopes[name] += dur
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime[name] += dur
        elif cat == "cpu_op":
            host[name] += dur

    def per_step(d: dict[str, float]) -> dict[str, float]:
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        return {k: round(v / steps / 1000, 3) for k, v in ranked}

    return {
        "steps": steps,
        "wall_ms_per_step": round((end - start) / steps / 1000, 3) if end > start else None,
        "scopes_ms_per_step": {k: round(scopes.get(k, 0.0) / steps / 1000, 3) for k in SCOPES},
        "gpu_ms_per_step": round(sum(gpu.values()) / steps / 1000, 3),
        "scope_gpu_spans_ms_per_step": {k: round(gpu_spans.get(k, 0.0) / steps / 1000, 3) for k in SCOPES},
        "top_host_ops_ms_per_step": per_step(host),
        "top_gpu_kernels_ms_per_step": per_step(gpu),
        "top_runtime_calls_ms_per_step": per_step(runtime),
    }


DECODE_ROWS = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+),.*#queue-req: (\d+)")


def wait_for_rows(log_path: Path, start: int, batch: int, timeout_s: float, lines: int = 1) -> int:
    """Wait until ``lines`` of the server's decode lines (from byte ``start`` of its log) have shown
    ``batch`` requests running and none queued, at most ``timeout_s``; the running requests of the
    last line then (0: none yet). A fixed wait profiled prefill steps in one arm and decode steps in
    the other on 2026-12-06 (26 prompts of 4K on a Llama-class model prefill for longer than 20 s);
    ``lines`` > 1 lets the step settle after the wave's prefill (Minima: its pages converted)."""
    deadline = time.time() + timeout_s
    while True:
        with open(log_path, errors="replace") as f:
            f.seek(start)
            seen = [(int(m[1]), int(m[2])) for m in DECODE_ROWS.finditer(f.read())]
        if seen.count((batch, 0)) >= lines or time.time() >= deadline:
            return seen[-1][0] if seen else 0
        time.sleep(1)


LOG_LINE = re.compile(r"(Prefill|Decode) batch(?: \[\d+\])?, .*?#(new-token|running-req): (\d+),"
                      r".*(?:input|gen) throughput \(token/s\): ([\d.]+)")
WARM_UP = 5


def log_throughput(log_text: str) -> dict:
    """The server's logged throughput before its profile: per kind (prefill, decode), the batches at
    the largest size the log shows (new tokens, running requests) after the first WARM_UP, their
    median and quartiles in tokens/s. A kind with fewer than 3 such batches is left out."""
    text = log_text.split("Profiling starts", 1)[0]
    out = {}
    for kind in ("Prefill", "Decode"):
        rows = [(int(m[3]), float(m[4])) for m in LOG_LINE.finditer(text) if m[1] == kind]
        if not rows:
            continue
        size = max(n for n, _ in rows)
        xs = [t for n, t in rows if n == size][WARM_UP:]
        if len(xs) >= 3:
            q1, median, q3 = statistics.quantiles(xs, n=4)
            out[kind.lower()] = {"size": size, "batches": len(xs), "median": round(median, 1),
                                 "q1": round(q1, 1), "q3": round(q3, 1)}
    return out
