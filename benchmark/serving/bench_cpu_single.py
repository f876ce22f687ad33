"""Single-request CPU decode speed: Minima default vs Minima with Stale disabled, same run, alternating.

Starts every arm's server, one after another, and keeps all but the arm being measured stopped
(SIGSTOP to its process group: an idle SGLang CPU scheduler polls and would take a core from the
measured one); per repetition it resumes each arm in turn and sends it one fresh prompt of ``--prompt-tokens`` random token ids and streams ``--new-tokens``
greedy tokens (ignore_eos). Decode tok/s = (tokens - 1) / (last token time - first token time);
TTFT is reported beside it. The figure that matters is the ratio of medians, Minima default over
Stale disabled, measured in the same run. Greedy ``output_ids`` of every arm are kept, so arms that
compute the same thing (``--base-pythonpath``: the same policy served by an earlier checkout, e.g.
before a change of the attention op) can be compared token by token.

    PYTHONPATH=python:test .venv/bin/python benchmark/serving/bench_cpu_single.py \\
        --json docs/results/cpu_decode_serve.json [--base-pythonpath /path/to/old/python]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test"))

from minima_test_support.server import launch  # noqa: E402
from sglang_minima.cpu_engine import setup_cpu_engine  # noqa: E402

setup_cpu_engine()  # before any sglang import; SGLang's own arm inherits it (the minima launcher does its own)

VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # plain-text ids of SmolLM2's 49,152-token vocabulary


def pause(server, stop: bool) -> None:
    """Stop (or resume) every process of a server (launch() starts each in its own session)."""
    os.killpg(server.process.pid, signal.SIGSTOP if stop else signal.SIGCONT)
    if not stop:
        time.sleep(1.0)


def stream_generate(url: str, ids: list[int], new_tokens: int) -> dict:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps, last = [], None
    with requests.post(url + "/generate", json=payload, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            last = json.loads(line[5:])
            n = len(last.get("output_ids", [])) or last["meta_info"]["completion_tokens"]
            while len(stamps) < n:
                stamps.append(time.perf_counter())
    output_ids = last.get("output_ids") or []
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft_s": stamps[0] - t0,
        "decode_tok_s": (len(stamps) - 1) / decode_s if decode_s > 0 else float("nan"),
        "tokens": len(stamps),
        "output_ids": output_ids,
    }


def sglang_cpu_flags() -> list[str]:
    from sglang_minima.launch_server import CPU_DEFAULT_MAX_TOTAL_TOKENS, DEFAULT_PAGE_SIZE
    from sglang_minima.models import ensure_default_model

    return ["--model-path", str(ensure_default_model()), "--device", "cpu", "--attention-backend", "torch_native",
            "--page-size", str(DEFAULT_PAGE_SIZE), "--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS),
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--base-pythonpath", help="also serve Minima default from this package path (before/after)")
    p.add_argument("--arms", default="minima,minima-stale-off",
                   help="of minima, minima-stale-off, sglang (SGLang's own torch_native, BF16 KV) and minima-base")
    p.add_argument("--same-prompt", action="store_true",
                   help="every repetition reuses the warm-up prompt (a prefix-cache hit: no prefill, decode "
                        "over the pages as the warm-up left them, TQ3 for Minima default)")
    p.add_argument("--json", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_cpu_single"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout's SIGTERM stops the servers too
    minima = "sglang_minima.launch_server"
    arms = {  # name: (server module, flags, env)
        "minima": (minima, [], None),
        "minima-stale-off": (minima, ["--minima-disable-stale"], None),
        # SGLang's own CPU path: torch_native attention over a model-dtype (BF16) KV cache, with the
        # model, page size, KV budget and graph flags Minima's launcher gives its own CPU servers
        "sglang": ("sglang.launch_server", sglang_cpu_flags, None),
    }
    arms = {k: (module, flags() if callable(flags) else flags, env)
            for k, (module, flags, env) in arms.items() if k in args.arms.split(",")}
    if args.base_pythonpath:
        path = os.pathsep.join([args.base_pythonpath] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if x and "python" not in Path(x).name])
        arms["minima-base"] = (minima, [], {"PYTHONPATH": path})
    servers = {}
    try:
        for name, (module, flags, env) in arms.items():
            servers[name] = launch(flags, args.log_dir / f"{name}.log", env=env, module=module)
            print(f"{name}: up in {servers[name].startup_s:.0f} s", file=sys.stderr)
            pause(servers[name], True)
        rng = random.Random(0)
        prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.prompt_tokens)]
                   for _ in range(1 if args.same_prompt else args.repeats + 1)]
        prompts += [prompts[0]] * (args.repeats + 1 - len(prompts))
        runs: dict[str, list[dict]] = {name: [] for name in arms}
        try:
            for rep, ids in enumerate(prompts):  # prompt 0 warms every server up and is not timed
                for name, server in servers.items():
                    pause(server, False)
                    try:
                        r = stream_generate(server.url, ids, args.new_tokens)
                    finally:
                        pause(server, True)
                    r["repeat"] = rep
                    print(f"rep {rep} {name}: decode {r['decode_tok_s']:.2f} tok/s, ttft {r['ttft_s']:.1f} s",
                          file=sys.stderr)
                    if rep:
                        runs[name].append(r)
                    else:
                        runs[name + ":warmup"] = [r]
        except KeyboardInterrupt:  # SIGINT / SIGTERM: report the repetitions every arm completed
            done = min(len(runs[name]) for name in arms)
            runs = {k: v if k.endswith(":warmup") else v[:done] for k, v in runs.items()}
            print(f"interrupted: {done} complete repetitions", file=sys.stderr)
    finally:
        for server in servers.values():
            pause(server, False)
            server.stop()
    summary = {name: {"decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
                      "ttft_s_median": statistics.median(r["ttft_s"] for r in rs), "repeats": len(rs)}
               for name, rs in runs.items() if rs and not name.endswith(":warmup")}
    ratio = sglang_ratio = None
    if "minima" in summary and "minima-stale-off" in summary:
        ratio = summary["minima"]["decode_tok_s_median"] / summary["minima-stale-off"]["decode_tok_s_median"]
    if "minima" in summary and "sglang" in summary:
        sglang_ratio = summary["minima"]["decode_tok_s_median"] / summary["sglang"]["decode_tok_s_median"]
    agreement = {}
    if "minima-base" in runs:
        for a, b in zip(runs["minima"] + runs["minima:warmup"], runs["minima-base"] + runs["minima-base:warmup"]):
            same = sum(x == y for x, y in zip(a["output_ids"], b["output_ids"]))
            first = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
            agreement[f"repeat {a['repeat']}"] = {"equal_tokens": same, "of": len(a["output_ids"]), "first_difference": first}
    print("| arm | decode tok/s (median) | TTFT s (median) |\n|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['decode_tok_s_median']:.2f} | {s['ttft_s_median']:.1f} |")
    if ratio is not None:
        print(f"\nMinima default / Stale disabled decode: {ratio:.2f}x")
    if sglang_ratio is not None:
        print(f"Minima default / SGLang's own torch_native decode: {sglang_ratio:.2f}x")
    if agreement:
        print(f"greedy agreement minima vs minima-base: {agreement}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"2-core shared CPU ({os.cpu_count()} CPUs visible)",
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "same_prompt": args.same_prompt,
            "summary": summary, "minima_over_stale_off": ratio, "minima_over_sglang": sglang_ratio,
            "greedy_agreement_vs_base": agreement,
            "runs": runs,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
