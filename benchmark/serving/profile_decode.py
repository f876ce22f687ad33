"""Where a decode step's time goes: one serving arm's steps under the torch profiler.

Per arm (``serve_arms.arms``: e.g. ``minima``, ``minima-native``, ``sglang-fp8-eager``): start the
server, send ``--batch`` concurrent requests of ``--input-len`` random prompt tokens and
``--output-len`` greedy tokens, wait until every request decodes, ask SGLang's ``/start_profile`` for
``--steps`` forward steps (CPU + GPU activities, no stacks), and read the Chrome trace SGLang writes.
Reported per step: the host time in Minima's profiler scopes (``minima.plan``: the forward plan and
the route counters; ``minima.kernel_plan``: the wrappers' plan; ``minima.decode_kernels``: the decode
kernels' launches, all layers; ``minima.prefill_kernels``: an extend's attention, all layers, of
which ``minima.prefill_tq3`` its TQ3 prefix tiles; ``minima.kv_write``: the new tokens' FP8 writes;
``minima.lifecycle``: conversions and promotions between steps), host ops (inclusive: an op's time
contains its callees') and GPU kernels by total time, and the window's wall time per step. Beside
them, unprofiled: the throughput the server logged before the profile began (SGLang's "Prefill
batch ... input throughput" of its full prefill batches and "Decode batch ... gen throughput" at
its most running requests, the first five of each dropped as warm-up; median and quartiles), the
figure an arm's ratio is taken from (the profiler's overhead grows with the launches it records).
JSON + markdown.

  python3 benchmark/serving/profile_decode.py --arms minima,sglang-fp8-eager --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import serve_arms  # noqa: E402  (sets up the CPU engine where the device is the CPU)
from serve_arms import arms, e2e_device, launch, resolve_model  # noqa: E402
from server_log import WARM_UP, log_throughput, wait_for_rows  # noqa: E402
from trace_summary import SCOPES, summarize_trace  # noqa: E402


def _read_trace(trace_dir: Path, timeout_s: float) -> dict:
    """The trace SGLang exports after the profiled steps, once it is complete (a whole gzip stream)."""
    deadline = time.time() + timeout_s
    while True:
        for path in sorted(trace_dir.glob("*.trace.json.gz")):
            try:
                with gzip.open(path, "rt") as f:
                    return json.load(f)
            except (EOFError, OSError, json.JSONDecodeError):  # still being written
                pass
        if time.time() >= deadline:
            break
        time.sleep(2)
    raise RuntimeError(f"no complete trace in {trace_dir} after {timeout_s:.0f} s")


def _decode_load(url: str, args, stop: threading.Event) -> None:
    """``--batch`` requests decoding at once, each started again when it ends, until ``stop``; every
    prompt is new (no radix hit), so with ``--output-len 1`` the profiled steps are prefills."""
    def one(i: int) -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            ids = [(7919 * (i + args.batch * n) + 104729 * j) % 20000 + 100 for j in range(args.input_len)]
            try:
                requests.post(url + "/generate", json={
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True},
                }, timeout=900)
            except requests.RequestException:
                if not stop.is_set():
                    raise

    for i in range(args.batch):
        threading.Thread(target=one, args=(i,), daemon=True).start()


def load_tokens(batch: int, input_len: int, output_len: int, page_size: int) -> int:
    """KV tokens ``batch`` requests of ``input_len + output_len`` tokens hold at their longest, each
    rounded up to whole pages, and one request more: the pool every arm gets (without it the e2e
    servers' 32,768-token default on CUDA held 5 of 26 Llama-class requests at 4K, 2026-12-06). The
    spare request is SGLang's admission headroom: in a pool of exactly 26 such requests its prefill
    admission, which reserves the running requests' remaining output tokens, kept the 26th queued
    behind 25 (token usage 0.96), so no decode line ever showed the whole batch (2026-12-06, 17:04)."""
    return (batch + 1) * -(-(input_len + output_len) // page_size) * page_size


def server_flags(args, model_dir: Path, model_flags: list[str]) -> list[str]:
    """Every arm's server flags before its own: a decode profile's pool holds its whole load (a
    prefill profile, ``--output-len 1``, keeps the harness's default pool, as its earlier runs did)."""
    flags = ["--model-path", str(model_dir), *model_flags, "--page-size", str(args.page_size), "--dtype", args.dtype,
             "--max-running-requests", str(args.batch)]
    if args.output_len > 1 and not any(a.split("=", 1)[0] == "--max-total-tokens" for a in args.server_args):
        flags += ["--max-total-tokens", str(load_tokens(args.batch, args.input_len, args.output_len, args.page_size))]
    return flags


def profile_arm(name: str, args, work: Path) -> dict:
    arm = arms(e2e_device())[name]
    model_dir, model_flags = resolve_model(args.model, work)
    flags = server_flags(args, model_dir, model_flags)
    server = launch(flags + arm.flags + args.server_args, work / f"{name}.log", module=arm.module, env=arm.env)
    stop = threading.Event()
    try:
        start = server.log_path.stat().st_size  # the server's own warm-up decodes before the load
        _decode_load(server.url, args, stop)
        if args.output_len > 1:  # a decode profile: every request decoding, none queued
            rows, full = wait_for_rows(server.log_path, start, args.batch, args.settle_s, lines=args.settle_lines)
            if full < args.settle_lines:
                print(f"{name}: {full} of {args.settle_lines} decode lines showed all {args.batch} requests in "
                      f"{args.settle_s:.0f} s ({rows} decoding on the last); profiling now", flush=True)
        else:  # prefill steps (--output-len 1): each request ends at its first token
            time.sleep(args.settle_s)
            rows = None
        trace_dir = work / f"{name}-trace"
        r = requests.post(server.url + "/start_profile", json={
            "output_dir": str(trace_dir), "num_steps": args.steps, "activities": ["CPU", "GPU"],
            "with_stack": False, "record_shapes": False, "profile_id": name,
        }, timeout=600)
        r.raise_for_status()
        summary = summarize_trace(_read_trace(trace_dir, timeout_s=600), args.steps)
        logged = log_throughput(server.log_path.read_text(errors="replace"))
        return {"arm": name, "flags": arm.flags, "startup_s": round(server.startup_s, 1), "decode_rows": rows,
                **summary, "log_throughput": logged}
    finally:
        stop.set()
        server.stop()


def render(results: list[dict], args) -> str:
    lines = [
        f"## Step profile ({e2e_device()}; {args.batch} requests x {args.input_len} prompt tokens, {args.output_len} output, "
        f"{args.steps} steps profiled)", "",
        "| arm | requests decoding | wall ms/step | GPU busy ms/step | " + " | ".join(SCOPES) + " |",
        "|---|---|---|---|" + "---|" * len(SCOPES),
    ]
    for r in results:
        s = r["scopes_ms_per_step"]
        rows = r.get("decode_rows")  # None: a prefill profile, or a result from saved traces
        lines.append(f"| {r['arm']} | {'-' if rows is None else rows} | {r['wall_ms_per_step']} | {r['gpu_ms_per_step']} | "
                     + " | ".join(f"{s[k]:.3f}" for k in SCOPES) + " |")
    if args.output_len > 1:  # a decode profile: say so where the window caught extend steps
        lines += [f"\n**{r['arm']}: not a decode profile.** Its window holds extend steps (a wave's prefill): "
                  f"{r['ragged_prefill_launches']} launches of FlashInfer's ragged prefill."
                  for r in results if r.get("ragged_prefill_launches")]
    logged = [r for r in results if r.get("log_throughput")]
    if logged:
        lines += ["", "Unprofiled, from each server's log before its profile (full batches, first "
                  f"{WARM_UP} dropped; tokens/s, median [quartiles]; x = against the first arm):", "",
                  "| arm | prefill batches | prefill tok/s | x | decode batches | decode tok/s | x |",
                  "|---|---|---|---|---|---|---|"]
        base = logged[0]["log_throughput"]

        def cells(r: dict, kind: str) -> str:
            got = r["log_throughput"].get(kind)
            if not got:
                return "- | - | -"
            ratio = f"{got['median'] / base[kind]['median']:.2f}" if kind in base else "-"
            return (f"{got['batches']} x {got['size']} | {got['median']:,.0f} [{got['q1']:,.0f}-{got['q3']:,.0f}] "
                    f"| {ratio}")

        lines += [f"| {r['arm']} | {cells(r, 'prefill')} | {cells(r, 'decode')} |" for r in logged]
    for r in results:
        lines += ["", f"### {r['arm']}: top host ops (ms per step)", ""]
        lines += [f"- {k}: {v}" for k, v in r["top_host_ops_ms_per_step"].items()]
        if r.get("top_runtime_calls_ms_per_step"):
            lines += ["", f"### {r['arm']}: top CUDA runtime calls (ms per step; a host sync waits in these)", ""]
            lines += [f"- {k}: {v}" for k, v in r["top_runtime_calls_ms_per_step"].items()]
        if r["top_gpu_kernels_ms_per_step"]:
            lines += ["", f"### {r['arm']}: top GPU kernels (ms per step)", ""]
            lines += [f"- {k[:120]}: {v}" for k, v in r["top_gpu_kernels_ms_per_step"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="minima")
    ap.add_argument("--model", help="model directory or a dummy geometry, e.g. llama3-8b-class (default: SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="seconds of load before the profile; with --output-len > 1 the most to wait for every "
                         "request to decode (the profile starts once --settle-lines decode lines have shown them)")
    ap.add_argument("--settle-lines", type=int, default=8,
                    help="decode lines (SGLang logs one every 40 steps) with every request running before a decode "
                         "profile starts: the step after the wave's prefill has settled (Minima's pages converted)")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="flags for every arm (last)")
    ap.add_argument("--work", type=Path, default=Path(serve_arms.ROOT) / ".cache" / "profile_decode")
    ap.add_argument("--out", type=Path, required=True, help="JSON to write (markdown beside it)")
    ap.add_argument("--from-traces", type=Path, metavar="DIR",
                    help="no servers: summarize the traces a run left in DIR (<arm>-trace/, e.g. of a run whose "
                         "call ended before it summarized its last arm), --arms in that order; repeat the run's "
                         "--steps and workload flags (per-step figures and the header use them) and its device "
                         "(MINIMA_E2E_DEVICE: the arms' flags); the date is the newest of these arms' traces")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for name in tqdm(args.arms.split(","), desc="arms"):
        if args.from_traces:
            trace = summarize_trace(_read_trace(args.from_traces / f"{name}-trace", timeout_s=0), args.steps)
            log = args.from_traces / f"{name}.log"  # the run's server log, where it was kept beside the traces
            logged = log_throughput(log.read_text(errors="replace")) if log.exists() else {}
            results.append({"arm": name, "flags": arms(e2e_device())[name].flags, **trace, "log_throughput": logged})
        else:
            results.append(profile_arm(name, args, args.work))
        # written after every arm: a run cut short (a device call's limit) keeps the arms it profiled
        when = max(f.stat().st_mtime for r in results for f in (args.from_traces / f"{r['arm']}-trace").glob("*.gz")) \
            if args.from_traces else None
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when)), "device": e2e_device(),
               "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        args.out.write_text(json.dumps(out, indent=1))
        args.out.with_suffix(".md").write_text(render(results, args))
    print(render(results, args))
    return out


if __name__ == "__main__":
    main()
