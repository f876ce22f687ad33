"""Where a CPU decode step's time goes: py-spy samples of a real server's scheduler while it decodes.

Starts ``python -m sglang_minima.launch_server`` on CPU (the e2e launcher's flags plus ``--flags``),
sends one prompt of ``--prompt-tokens`` random token ids, and once the first token has streamed
back (prefill done) samples the scheduler process with py-spy for ``--seconds`` while it decodes.
Reported: the share of samples in which each function is on the stack (inclusive) and on top of it
(self), for the functions named in ``FOCUS`` and the top ones overall. JSON + markdown.

Needs py-spy (``pip install py-spy``; not a dependency of the package) and ptrace rights.

    PYTHONPATH=python:test .venv/bin/python benchmark/serving/profile_cpu_decode.py --prompt-tokens 6000 \\
        --out docs/results/cpu_decode_profile_6k.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test"))

from minima_test_support.server import launch  # noqa: E402

# Where a decode step can spend its time: the attention op per format, the plan, the lifecycle, the model.
FOCUS = {
    "TQ3 + FP8 attention (lut_mixed_batch_decode)": "lut_mixed_batch_decode",
    "TQ3 pages (lut_tq3_batch_decode)": "lut_tq3_batch_decode",
    "FP8 pages (lut_hot_batch_decode)": "lut_hot_batch_decode",
    "forward plan (plan_forward)": "plan_forward",
    "lifecycle (flush_pending_backups)": "flush_pending_backups",
    "KV write (set_kv_buffer)": "set_kv_buffer",
    "attention layers (LlamaAttention.forward: projections, rotary, attention)": "LlamaAttention.forward",
    "attention backend (_decode_batch)": "_decode_batch",
    "the whole forward (ModelRunner.forward)": "ModelRunner.forward",
    "sampling (sample)": "sample",
}


def _scheduler_pid(server_pid: int) -> int:
    """The pid of the server's scheduler (SGLang titles it ``sglang::scheduler``)."""
    import psutil  # an SGLang dependency

    for child in psutil.Process(server_pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
            return child.pid
    raise RuntimeError(f"no sglang::scheduler process under {server_pid}")


def summarize(collapsed: str, top: int = 25) -> dict:
    """py-spy's raw (collapsed) stacks -> inclusive and self shares per function name."""
    inclusive: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        for name in set(names):
            inclusive[name] += n
        self_time[names[-1]] += n
    share = lambda c: round(100.0 * c / max(total, 1), 1)  # noqa: E731
    return {
        "samples": total,
        "focus_inclusive_pct": {label: share(sum(v for k, v in inclusive.items() if k == fn or k.endswith("." + fn)))
                                for label, fn in FOCUS.items()},
        "top_inclusive_pct": {k: share(v) for k, v in inclusive.most_common(top)},
        "top_self_pct": {k: share(v) for k, v in self_time.most_common(top)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--new-tokens", type=int, default=400, help="enough to outlast --seconds of decoding")
    p.add_argument("--seconds", type=int, default=30)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--flags", default="", help="more server flags, e.g. --minima-disable-stale")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/profile_cpu_decode"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resummarize", action="store_true", help="recompute --out's shares from its saved raw samples")
    args = p.parse_args()
    if args.resummarize:
        result = json.loads(args.out.read_text())
        result.update(summarize((args.log_dir / "pyspy.txt").read_text()))
        _write(args.out, result)
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    server = launch(args.flags.split(), args.log_dir / "server.log")
    try:
        rng = random.Random(0)
        ids = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        first = threading.Event()
        tokens: list[float] = []

        def stream() -> None:
            payload = {"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}}
            with requests.post(server.url + "/generate", json=payload, stream=True, timeout=3600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                        tokens.append(time.perf_counter())
                        first.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        if not first.wait(timeout=3600):
            raise RuntimeError("no first token within an hour")
        raw = args.log_dir / "pyspy.txt"
        n0 = len(tokens)
        subprocess.run([py_spy, "record", "--pid", str(_scheduler_pid(server.process.pid)), "--duration",
                        str(args.seconds), "--rate", str(args.rate), "--format", "raw", "--output", str(raw),
                        "--nonblocking"], check=True, capture_output=True)
        decoded = len(tokens) - n0
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(sys.argv),
            "prompt_tokens": args.prompt_tokens,
            "flags": args.flags,
            "tokens_decoded_while_sampling": decoded,
            "decode_tok_s_while_sampling": round(decoded / args.seconds, 2),
            **summarize(raw.read_text()),
        }
    finally:
        server.stop()
    _write(args.out, result)


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# CPU decode profile ({result['prompt_tokens']}-token prompt, {result['samples']} samples, "
             f"{result['decode_tok_s_while_sampling']} tok/s while sampled)", "",
             "| where | % of samples (inclusive) |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["focus_inclusive_pct"].items()]
    lines += ["", "| function (self) | % |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in list(result["top_self_pct"].items())[:15]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
