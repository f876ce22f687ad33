"""Serve arms one after another on this machine's device: start-up time, greedy outputs, one bench_serving run.

Each arm is a real server (``python -m sglang_minima.launch_server`` or SGLang's own
``python -m sglang.launch_server``) started through the e2e launcher, so the device under test
follows ``MINIMA_E2E_DEVICE`` (cpu unless set; the device harness sets cuda) and every arm gets the
same harness flags. Per arm: seconds until /health answers; greedy ``output_ids`` of fixed prompts
(one long enough that its prompt pages go Stale and decode reads TQ3 pages); one
``python -m sglang.bench_serving --dataset-name random-ids`` run; Minima's counters from
/server_info. ``--reference`` compares each arm's greedy tokens with an earlier run's (e.g. the
CPU run of the same prompts): a figure, not an assertion.

Arms:
  minima       Minima defaults (Recent/Anchor FP8, Stale TQ3 with 4-bit keys; attention: minima on GPU,
               minima_native on CPU)
  minima-k3    Minima with 3-bit Stale keys (--minima-key-bits 3): the defaults of every figure before
               2026-12-03 13:00 UTC, greedy_cpu.json's included
  minima-fp8   Minima with --minima-disable-stale (every page FP8 e4m3)
  minima-nodefer Minima with --minima-no-defer-prefill-conversion (a prompt's pages convert while it is
              prefilled: the default until 2026-12-05; the deferral's cost in throughput)
  minima-tick8 Minima with --minima-tick-min-new-pages 8 (the lifecycle tick waits for 8 new pages)
  minima-native  Minima with --attention-backend minima_native (the torch path; on GPU tensors there)
  sglang-fp8   SGLang's own FP8 KV: flashinfer attention, --kv-cache-dtype fp8_e4m3 (GPU only)
  sglang-bf16  SGLang's own path in the model dtype (flashinfer on GPU, torch_native on CPU)
  sglang-fp8-eager  sglang-fp8 without decode CUDA graphs (what an eager step costs, beside Minima's eager one)
Diagnostic arms (greedy agreement: which part of a path changes its tokens):
  minima-serial       Minima with --disable-overlap-schedule
  minima-blocking     Minima with CUDA_LAUNCH_BLOCKING=1 (no two GPU ops in flight: no stream race)
  minima-per-request  Minima with decode planned per request (--minima-attention-score-anchors)
  minima-model-dtype  Minima with hot pages in the model dtype, no Stale tier
  sglang-torch        SGLang's torch_native attention in the model dtype (a torch reference)

``--parallel`` starts the arms side by side (greedy only) and adds each pair's agreement.

  .venv/bin/python benchmark/serving/serve_arms.py --arms minima --greedy-only \\
      --out docs/results/device/greedy_cpu.json                        # CPU reference
  ARMS=sglang-fp8 bash scripts/device/run_suite.sh serve   # device harness: one arm per call
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test"))

from minima_test_support.server import e2e_device, launch  # noqa: E402

if e2e_device() == "cpu":
    from sglang_minima.cpu_engine import setup_cpu_engine

    setup_cpu_engine()  # before any sglang import; the servers it starts inherit it

DOC = "Inventory of the northern warehouse, read carefully.\n" + "".join(
    f"Shelf {i}: {i * 3 % 17} crates of item {i * 11 % 23}.\n" for i in range(60))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a long story about a lighthouse keeper. " * 12,
    DOC + "Question: How many crates are on shelf 41?\nAnswer:",
    DOC + "Question: Which item is on shelf 9? Then list shelves 50 to 59.\nAnswer:",
]
NEW_TOKENS = 48


@dataclass(frozen=True)
class Arm:
    name: str
    module: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)


def arms(device: str) -> dict[str, Arm]:
    def sglang_flags(attention: str) -> list[str]:
        # SGLang's own arms: decode CUDA graphs on (its default), prefill graphs off (start-up time).
        flags = ["--attention-backend", attention, "--cuda-graph-backend-prefill", "disabled"]
        if device == "cpu":
            flags += ["--device", "cpu", "--cuda-graph-backend-decode", "disabled"]
        return flags

    sglang = sglang_flags("flashinfer" if device == "cuda" else "torch_native")
    return {
        "minima": Arm("minima", "sglang_minima.launch_server", []),
        "minima-k3": Arm("minima-k3", "sglang_minima.launch_server", ["--minima-key-bits", "3"]),
        "minima-eager": Arm("minima-eager", "sglang_minima.launch_server", ["--cuda-graph-backend-decode", "disabled"]),
        "minima-fp8": Arm("minima-fp8", "sglang_minima.launch_server", ["--minima-disable-stale"]),
        "minima-tick8": Arm("minima-tick8", "sglang_minima.launch_server", ["--minima-tick-min-new-pages", "8"]),
        "minima-nodefer": Arm("minima-nodefer", "sglang_minima.launch_server", ["--minima-no-defer-prefill-conversion"]),
        "minima-native": Arm("minima-native", "sglang_minima.launch_server", ["--attention-backend", "minima_native"]),
        "sglang-fp8": Arm("sglang-fp8", "sglang.launch_server", sglang + ["--kv-cache-dtype", "fp8_e4m3"]),
        "sglang-bf16": Arm("sglang-bf16", "sglang.launch_server", sglang),
        "sglang-fp8-eager": Arm("sglang-fp8-eager", "sglang.launch_server",
                                sglang + ["--kv-cache-dtype", "fp8_e4m3", "--cuda-graph-backend-decode", "disabled"]),
        "minima-serial": Arm("minima-serial", "sglang_minima.launch_server", ["--disable-overlap-schedule"]),
        "minima-blocking": Arm("minima-blocking", "sglang_minima.launch_server", [], {"CUDA_LAUNCH_BLOCKING": "1"}),
        "minima-per-request": Arm("minima-per-request", "sglang_minima.launch_server",
                                  ["--minima-attention-score-anchors"]),
        "minima-model-dtype": Arm("minima-model-dtype", "sglang_minima.launch_server",
                                  ["--minima-hot-dtype", "auto", "--minima-disable-stale"]),
        "sglang-torch": Arm("sglang-torch", "sglang.launch_server", sglang_flags("torch_native")),
    }


@dataclass
class ArmResult:
    arm: str
    device: str
    flags: list[str]
    startup_s: float
    greedy: list[list[int]]
    greedy_s: float
    margins: list[list[float]] = field(default_factory=list)
    """Per prompt and step: logprob of the greedy token minus the runner-up's (nats)."""
    forced: list[dict] = field(default_factory=list)
    """Per prompt: teacher-forced logprobs and argmax over the reference's (or its own) greedy tokens."""
    bench: dict = field(default_factory=dict)
    minima: dict = field(default_factory=dict)
    agreement: dict = field(default_factory=dict)


def resolve_model(name: str | None, work: Path) -> tuple[Path, list[str]]:
    """(model directory, the flags it needs): the embedded model, a directory, or a dummy geometry."""
    from sglang_minima.models import ensure_default_model

    if name is None:
        return ensure_default_model(), []
    from minima_test_support.dummy_models import GEOMETRIES, make_model

    if name in GEOMETRIES:
        return make_model(name, work / "models", ensure_default_model()), ["--load-format", "dummy"]
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model: {name!r} is neither a model directory nor one of {sorted(GEOMETRIES)}")
    return path, []


def greedy(url: str) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of every prompt, and at each step the margin (nats) between the chosen token's
    logprob and the runner-up's: where two arms part, a small margin says a near tie (rounding), a
    large one a different computation."""
    outs, margins = [], []
    for prompt in PROMPTS:
        r = requests.post(url + "/generate", json={
            "text": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }, timeout=600)
        r.raise_for_status()
        out = r.json()
        outs.append(out["output_ids"])
        top = out["meta_info"]["output_top_logprobs"]
        margins.append([round(t[0][0] - t[1][0], 4) for t in top])
    return outs, margins


def teacher_forced(url: str, tokenizer, tokens: list[list[int]]) -> list[dict]:
    """Each prompt followed by ``tokens`` (the reference's greedy output) in one prefill: per position,
    the logprob this arm gives the reference token and the token it would have chosen. Unlike free
    greedy runs, one near tie does not make every later position differ."""
    out = []
    for prompt, toks in zip(PROMPTS, tokens):
        ids = tokenizer(prompt).input_ids
        r = requests.post(url + "/generate", json={
            # SGLang gives no logprob for the first position it reports: start one before the output
            "input_ids": ids + toks, "return_logprob": True, "logprob_start_len": len(ids) - 1,
            "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }, timeout=600)
        r.raise_for_status()
        meta = r.json()["meta_info"]
        out.append({"logprobs": [t[0] for t in meta["input_token_logprobs"][1:]],
                    "argmax": [t[0][1] for t in meta["input_top_logprobs"][1:]]})
    return out


def forced_agreement(got: list[dict], ref_tokens: list[list[int]], ref: list[dict] | None) -> dict:
    """Share of positions whose argmax is the reference token; logprob differences to the reference."""
    hits = sum(a == t for g, toks in zip(got, ref_tokens) for a, t in zip(g["argmax"], toks))
    result = {"argmax_equal": hits, "positions": sum(len(t) for t in ref_tokens)}
    if ref:
        diffs = [abs(a - b) for g, r in zip(got, ref) for a, b in zip(g["logprobs"], r["logprobs"])]
        result |= {"max_abs_dlogprob": round(max(diffs), 4), "mean_abs_dlogprob": round(sum(diffs) / len(diffs), 5)}
    return result


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt: tokens until the first difference; overall: share of positions equal."""
    prefix = []
    for a, b in zip(got, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    same = sum(x == y for a, b in zip(got, ref) for x, y in zip(a, b))
    total = sum(min(len(a), len(b)) for a, b in zip(got, ref))
    return {"identical_prompts": sum(a == b for a, b in zip(got, ref)), "prompts": len(ref),
            "common_prefix_tokens": prefix, "positions_equal": same, "positions": total}


def bench_serving(url: str, tokenizer: Path, args, work: Path, name: str) -> dict:
    out_file = work / f"{name}.bench.jsonl"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--tokenizer", str(tokenizer), "--dataset-name", "random-ids",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--seed", "1", "--output-file", str(out_file)]
    with open(work / f"{name}.bench.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "HOME": str(work)})  # bench_serving caches prompts under ~/.cache
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    keep = ("completed", "duration", "output_throughput", "input_throughput", "request_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "total_input_tokens", "total_output_tokens")
    return {k: result[k] for k in keep if k in result}


def run_arm(arm: Arm, args, reference: dict | None) -> ArmResult:
    flags = ["--model-path", str(args.model), "--dtype", args.dtype, "--page-size", str(args.page_size),
             "--enable-metrics", *args.server_args, *arm.flags]
    server = launch(flags, args.work / f"{arm.name}.log", env=arm.env, module=arm.module)
    try:
        t0 = time.time()
        outs, margins = greedy(server.url)
        result = ArmResult(arm.name, e2e_device(), flags, server.startup_s, outs, time.time() - t0, margins)
        forced_tokens = reference["greedy"] if reference else outs
        result.forced = teacher_forced(server.url, AutoTokenizer.from_pretrained(args.model), forced_tokens)
        if reference is not None:
            result.agreement = agreement(outs, reference["greedy"])
            result.agreement["forced"] = forced_agreement(result.forced, forced_tokens, reference.get("forced"))
        if not args.greedy_only:
            result.bench = bench_serving(server.url, args.model, args, args.work, arm.name)
        info = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]
        if "minima" in info:
            result.minima = {k: info["minima"][k] for k in ("stats", "pool") if k in info["minima"]}
        return result
    finally:
        server.stop()


def render(results: list[ArmResult]) -> str:
    lines = ["| arm | device | start s | greedy identical | positions equal | forced argmax equal "
             "| max / mean abs dlogprob | out tok/s | req/s "
             "| mean TTFT ms | p99 TTFT ms | mean TPOT ms | TQ3 pages read | pages converted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b, s = r.agreement, r.bench, r.minima.get("stats", {})
        agree = f"{a['identical_prompts']}/{a['prompts']}" if a else "-"
        pos = f"{a['positions_equal']}/{a['positions']}" if a else "-"
        f = a.get("forced", {})
        forced = f"{f['argmax_equal']}/{f['positions']}" if f else "-"
        dlp = f"{f['max_abs_dlogprob']} / {f['mean_abs_dlogprob']}" if "max_abs_dlogprob" in f else "-"
        def fmt(key: str, spec: str, b=b) -> str:
            return format(b[key], spec) if key in b else "-"

        lines.append(
            f"| {r.arm} | {r.device} | {r.startup_s:.0f} | {agree} | {pos} | {forced} | {dlp} "
            f"| {fmt('output_throughput', '.1f')} "
            f"| {fmt('request_throughput', '.2f')} | {fmt('mean_ttft_ms', '.0f')} | {fmt('p99_ttft_ms', '.0f')} "
            f"| {fmt('mean_tpot_ms', '.1f')} | {s.get('route_tq3_pages', '-')} "
            f"| {s.get('retier', {}).get('pages', '-')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="minima,sglang-fp8")
    ap.add_argument("--model", type=Path, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="flags for every arm (last)")
    ap.add_argument("--greedy-only", action="store_true", help="no bench_serving run")
    ap.add_argument("--parallel", action="store_true", help="arms side by side, greedy only; pairwise agreement")
    ap.add_argument("--reference", type=Path, help="an earlier run's JSON: greedy agreement with its first arm")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "serve_arms")
    ap.add_argument("--out", type=Path, required=True, help="JSON to write (markdown beside it)")
    args = ap.parse_args()
    if args.model is None:
        from sglang_minima.models import ensure_default_model

        args.model = ensure_default_model()
    known = arms(e2e_device())
    unknown = [a for a in args.arms.split(",") if a not in known]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {sorted(known)}")
    reference = None
    if args.reference:
        reference = json.loads(args.reference.read_text())["results"][0]
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[ArmResult] = []
    names = args.arms.split(",")
    if args.parallel:
        args.greedy_only = True
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {pool.submit(run_arm, known[n], args, reference): n for n in names}
            for future in tqdm(as_completed(futures), total=len(futures), desc="arms"):
                try:
                    results.append(future.result())
                except Exception as e:  # one arm that does not start must not lose the others
                    print(f"arm {futures[future]} failed: {e}"[:4000])
                write(args.out, results)
    else:
        for name in tqdm(names, desc="arms"):
            results.append(run_arm(known[name], args, reference))
            write(args.out, results)  # after every arm: a call cut short keeps what it measured
    print(render(results))
    print(f"wrote {args.out}")


def pairwise(results: list[ArmResult]) -> str:
    """Positions equal between every two arms' greedy tokens (same prompts, same length)."""
    names = [r.arm for r in results]
    lines = ["| positions equal | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in results:
        cells = []
        for b in results:
            g = agreement(a.greedy, b.greedy)
            cells.append(f"{g['positions_equal']}/{g['positions']}")
        lines.append(f"| {a.arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: Path, results: list[ArmResult]) -> None:
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "results": [asdict(r) for r in results]}, indent=1))
    text = render(results)
    if len(results) > 1 and not any(r.bench for r in results):
        text += "\n\n" + pairwise(results)
    out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
