"""Minima-KV vs SGLang's plain path at the same KV memory budget, served side by side on CPU.

For each arm the script derives --max-total-tokens from one byte budget and the arm's bytes per
token (all layers, K+V, metadata included), starts the server, runs
``python -m sglang.bench_serving --dataset-name generated-shared-prefix`` against it while polling
/metrics for the number of running requests, reads the page mix from /server_info, and stops it.

Arms:
  sglang        SGLang 0.5.23's own path (torch_native attention, KV in the model dtype).
  minima-fp8    Minima with Stale disabled: every page FP8 (what SGLang's FP8 KV would hold).
  minima        Minima with the default tiers (Recent/Anchor FP8, Stale TQ3).
  minima-lean   Minima with only a few FP8 pages (--minima-fp8-page-fraction as given).

Usage: .venv/bin/python benchmark/serving/bench_capacity.py --budget-mib 96 [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test"))

from sglang_minima.cpu_engine import setup_cpu_engine  # noqa: E402

setup_cpu_engine()  # before any sglang import; the plain SGLang arm inherits it too

from minima_test_support.server import launch  # noqa: E402

from sglang_minima.config import MinimaConfig  # noqa: E402
from sglang_minima.mem_cache.tier_store import minima_cell_size  # noqa: E402
from sglang_minima.models import ensure_default_model  # noqa: E402


@dataclass
class Arm:
    name: str
    module: str
    flags: list[str]
    minima: dict | None  # MinimaConfig overrides; None = SGLang's own path


@dataclass
class ArmResult:
    arm: str
    bytes_per_token: float
    max_total_tokens: int
    startup_s: float
    completed: int
    output_throughput: float
    request_throughput: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    duration_s: float
    peak_running_requests: int
    minima: dict = field(default_factory=dict)


def model_geometry(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {
        "num_layers": cfg["num_hidden_layers"],
        "num_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // heads),
    }


def bytes_per_token(arm: Arm, geometry: dict, dtype: str, page_size: int) -> int:
    """KV bytes per token, all layers: SGLang's own cell size, or the one Minima's hook gives it."""
    import torch

    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if arm.minima is None:
        return 2 * geometry["num_kv_heads"] * geometry["head_dim"] * dtype_bytes * geometry["num_layers"]
    return minima_cell_size(MinimaConfig(**arm.minima), page_size=page_size, model_dtype_bytes=dtype_bytes,
                            **geometry)


def arms(lean_fraction: float) -> list[Arm]:
    plain = ["--attention-backend", "torch_native"]
    return [
        Arm("sglang", "sglang.launch_server", plain, None),
        Arm("minima-fp8", "sglang_minima.launch_server", ["--minima-disable-stale"], {"disable_stale": True}),
        Arm("minima", "sglang_minima.launch_server", [], {}),
        Arm("minima-lean", "sglang_minima.launch_server",
            ["--minima-fp8-page-fraction", str(lean_fraction)], {"fp8_page_fraction": lean_fraction}),
    ]


def poll_running(url: str, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        try:
            text = requests.get(url + "/metrics", timeout=5).text
            for line in text.splitlines():
                if line.startswith("sglang:num_running_reqs"):
                    peak[0] = max(peak[0], int(float(line.split()[-1])))
        except requests.RequestException:
            pass
        stop.wait(0.5)


def run_arm(arm: Arm, args, model_dir: Path, geometry: dict, work: Path) -> ArmResult:
    per_token = bytes_per_token(arm, geometry, args.dtype, args.page_size)
    tokens = int(args.budget_mib * 2**20 // per_token) // args.page_size * args.page_size
    common = ["--model-path", str(model_dir), "--device", "cpu", "--dtype", args.dtype,
              "--page-size", str(args.page_size), "--max-total-tokens", str(tokens),
              "--max-running-requests", str(args.max_running_requests), "--enable-metrics",
              "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    server = launch(common + arm.flags, work / f"{arm.name}.log", module=arm.module)
    try:
        stop, peak = threading.Event(), [0]
        poller = threading.Thread(target=poll_running, args=(server.url, stop, peak), daemon=True)
        poller.start()
        out_file = work / f"{arm.name}.jsonl"
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
               "--base-url", server.url, "--tokenizer", str(model_dir),
               "--dataset-name", "generated-shared-prefix",
               "--gsp-num-groups", str(args.num_groups), "--gsp-prompts-per-group", str(args.prompts_per_group),
               "--gsp-system-prompt-len", str(args.system_prompt_len),
               "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
               "--num-prompts", str(args.num_groups * args.prompts_per_group),
               "--max-concurrency", str(args.max_concurrency), "--output-file", str(out_file),
               "--seed", "1", "--disable-tqdm"]
        subprocess.run(cmd, check=True, stdout=open(work / f"{arm.name}.bench.log", "w"),
                       stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(work)})
        stop.set()
        poller.join()
        bench = json.loads(out_file.read_text().strip().splitlines()[-1])
        info = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]
        return ArmResult(
            arm=arm.name, bytes_per_token=per_token, max_total_tokens=info.get("max_total_num_tokens", tokens),
            startup_s=server.startup_s, completed=bench["completed"],
            output_throughput=bench["output_throughput"], request_throughput=bench["request_throughput"],
            mean_ttft_ms=bench["mean_ttft_ms"], p99_ttft_ms=bench["p99_ttft_ms"],
            mean_tpot_ms=bench["mean_tpot_ms"], duration_s=bench["duration"],
            peak_running_requests=peak[0], minima=info.get("minima", {}),
        )
    finally:
        server.stop()


def render(results: list[ArmResult], args) -> str:
    base = next(r for r in results if r.arm == "sglang")
    fp8 = next((r for r in results if r.arm == "minima-fp8"), None)
    lines = [
        "| arm | bytes/token | logical tokens | x SGLang | x FP8 | peak running | out tok/s | req/s | mean TTFT ms "
        "| p99 TTFT ms | mean TPOT ms | pages at end FP8/TQ3 | converted (step/pressure) | prefix-hit pages FP8/TQ3 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mix = conv = hits = "-"
        if r.minima:
            rows, stats = r.minima["memory"]["rows"], r.minima["stats"]
            hot = sum(rows[k]["pages"] for k in ("recent", "anchor", "hot_other", "held_hot"))
            mix = f"{hot}/{rows['stale']['pages'] + rows['held_tq3']['pages']}"
            conv = f"{stats['retier']['pages']}/{stats['pressure_retier_pages']}"
            hits = f"{stats['prefix_hit_hot_pages']}/{stats['prefix_hit_tq3_pages']}"
        x_fp8 = f"{r.max_total_tokens / fp8.max_total_tokens:.2f}" if fp8 else "-"
        lines.append(
            f"| {r.arm} | {r.bytes_per_token:.0f} | {r.max_total_tokens} | {r.max_total_tokens / base.max_total_tokens:.2f} "
            f"| {x_fp8} | {r.peak_running_requests} | {r.output_throughput:.1f} | {r.request_throughput:.2f} "
            f"| {r.mean_ttft_ms:.0f} | {r.p99_ttft_ms:.0f} | {r.mean_tpot_ms:.0f} | {mix} | {conv} | {hits} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, default=96.0, help="KV bytes given to every arm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--lean-fraction", type=float, default=0.1)
    ap.add_argument("--num-groups", type=int, default=4)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--arms", default="sglang,minima-fp8,minima,minima-lean")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench_serving")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--from-json", type=Path, help="re-render the table of an earlier run's serving.json")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(render([ArmResult(**r) for r in saved["results"]], args))
        return

    model_dir = ensure_default_model()
    geometry = model_geometry(model_dir)
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = [a for a in arms(args.lean_fraction) if a.name in args.arms.split(",")]
    results = [run_arm(arm, args, model_dir, geometry, args.work) for arm in tqdm(chosen, desc="arms")]
    table = render(results, args)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "geometry": geometry,
         "results": [asdict(r) for r in results]}, indent=1))
    print(f"wrote {args.out / 'serving.json'}")


if __name__ == "__main__":
    main()
