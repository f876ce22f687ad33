"""A torch-profiler Chrome trace (what SGLang's /start_profile writes) summed per step: Minima's
profiler scopes (host time), host ops, CUDA runtime calls (where a host sync waits), GPU kernels and
the window's wall time. Pure Python: benchmark/serving/profile_decode.py reads it, test/benchmark
tests it."""

from __future__ import annotations

from collections import defaultdict

SCOPES = ("minima.plan", "minima.kernel_plan", "minima.decode_kernels", "minima.prefill_kernels", "minima.prefill_tq3",
          "minima.kv_write", "minima.lifecycle")


def summarize_trace(trace: dict, steps: int, top: int = 15) -> dict:
    """Totals per step from a Chrome trace: Minima's scopes, host ops (``cpu_op``), CUDA runtime and
    driver calls (a launch's cost, or a sync's wait), GPU kernels and the wall time of the profiled
    window (its first to last host event); and the launches of FlashInfer's ragged prefill, which
    only an extend step runs (SGLang's flashinfer and Minima's kernels attend the new tokens with it;
    their decodes read paged KV): a decode profile whose window holds any caught prefill steps. An
    extend on Minima's torch path (``minima_native``, or a step the kernels refuse) launches none."""
    ragged = 0
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
            ragged += "Ragged" in name  # BatchPrefillWithRaggedKVCacheKernel, or the SM90 one's RaggedParams
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
        "ragged_prefill_launches": ragged,
    }
