"""Arms side by side at one KV byte budget: how many tokens each admits, and how it serves them.

For each arm the script derives ``--max-total-tokens`` from one byte budget, less what the server
keeps beside its pool (Minima's prefill scratch on ``minima``), and the arm's KV bytes per token (all
layers, K+V, Minima's metadata and page padding included: the cell size SGLang sizes its pool with),
starts the server, and runs ``python -m sglang.bench_serving`` against it once per round
(``--max-concurrency`` 8,24: two rounds on the same server, in order) while polling
/metrics for running and queued requests; after each round it reads the page mix and Minima's
counters from /server_info. The device is the e2e launcher's (``MINIMA_E2E_DEVICE``: cpu unless set;
the device harness sets cuda), so the same command measures the CPU and the GPU paths.

Arms (``--arms``):
  sglang-fp8    SGLang 0.5.23's own FP8 KV: flashinfer, --kv-cache-dtype fp8_e4m3 (GPU; the baseline there)
  sglang        SGLang's own path in the model dtype (torch_native on CPU: the baseline there)
  minima-fp8    Minima with Stale disabled: every page FP8
  minima        Minima's defaults (Recent/Anchor FP8, Stale TQ3)
  minima-nodefer  Minima with --minima-no-defer-prefill-conversion (prefill chunks read their own prompt's TQ3 pages)
  minima-lean   Minima with only a few FP8 pages (--minima-fp8-page-fraction --lean-fraction)
  minima-lean-strict  minima-lean with --minima-strict-hot-admission (a prompt waits for hot pages
                instead of converting a live request's sink or Recent pages)
  minima-coarse Minima's defaults with SGLang's prefill read-done fast path off (the overlap scheduler
                waits for every extend's whole forward before Minima's tick: the barrier before 2026-12-06)
  minima-pbatch Minima's defaults with --minima-pressure-batch-pages 64 (an allocation short of FP8 pages
                converts Stale and cached pages ahead, at its one device sync)

Workloads (``--dataset``): ``gsp`` is bench_serving's generated-shared-prefix (``--num-groups``
groups of ``--prompts-per-group`` prompts sharing a ``--system-prompt-len`` system prompt); ``random``
is random-ids prompts of exactly ``--input-len`` tokens (``--num-prompts`` per round, default: the
round's concurrency). ``--model`` takes a model directory or a random-weight geometry of
test/minima_test_support/dummy_models.py (e.g. ``llama3-8b-class``, served with --load-format dummy).

  .venv/bin/python benchmark/serving/bench_capacity.py --budget-mib 96 --max-concurrency 8,32   # CPU
  # the H200 (device harness): long context at equal KV bytes, non-binding then capacity-bound
  python3 benchmark/serving/bench_capacity.py --model llama3-8b-class --dataset random --input-len 32768 \\
      --output-len 256 --budget-mib 20480 --max-concurrency 8,24 --arms sglang-fp8,minima-fp8,minima --out $OUT
  # the canary (issue #16 b): 2 x 59,008-token prompts on Qwen3.6's geometry, both at once
  python3 benchmark/serving/bench_capacity.py --canary --arms sglang-fp8,minima-fp8,minima --out $OUT --name canary
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_arms  # noqa: E402  (sets up the CPU engine where the device is the CPU, before any sglang import)
from serve_arms import Arm, e2e_device, launch, resolve_model  # noqa: E402
from server_log import decode_windows, prefill_batches  # noqa: E402

from sglang_minima.config import parse_minima_argv, split_minima_argv  # noqa: E402
from sglang_minima.launch_server import prefill_scratch_reserve_for  # noqa: E402
from sglang_minima.mem_cache.tier_store import minima_cell_size  # noqa: E402

BASELINES = ("sglang-fp8", "sglang")
"""The arm ratios are taken against: the first of these that ran."""


@dataclass
class ArmResult:
    arm: str
    clients: int
    num_prompts: int
    bytes_per_token: float
    max_total_tokens: int
    startup_s: float
    completed: int
    output_throughput: float
    request_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    duration_s: float
    peak_running_requests: int
    peak_queued_requests: int
    median_itl_ms: float = 0.0
    """bench_serving's median inter-token latency: the step a client sees between two tokens, which
    the prefill chunks run between decode steps move little (they land in TPOT and the ITL's tail)."""
    p99_itl_ms: float = 0.0
    itl_stalls: float | None = None
    """Inter-token gaps longer than ``itl_stall_ms`` per request that got tokens: a prefill batch (or a
    conversion's sync) run between two of the request's decode steps (``stall_fields``). None where
    bench_serving gave fewer than two gaps, or the result predates its per-request gaps
    (``--output-details``)."""
    itl_stall_share: float | None = None
    """Their share of the round's summed inter-token time: what the stalls cost its decode."""
    itl_stall_ms: float | None = None
    """The gap that counts as a stall: STALL_STEPS of the arm's own step (``stall_fields``)."""
    decode_rows: int = 0
    decode_step_ms: float = 0.0
    """SGLang's own decode log (``Decode batch`` lines) at the round's most running requests: the
    window of highest generation throughput, as ms per step (the least disturbed by prefill chunks;
    bench_serving's TPOT counts the chunks interleaved with a request's decode)."""
    decode_medians: dict = field(default_factory=dict)
    """Per number of running requests, the median ms per step over the round's decode lines and how
    many lines there were ({rows: [ms, lines]}): a step's cost at equal rows, comparable across arms
    (the throughput ratio at a capacity-bound load is rows admitted x these steps)."""
    output_tokens_retokenized: int = -1
    """Output tokens as the client got them back: 0 when the server rejected every request (an input
    longer than the arm's capacity), although bench_serving counts those requests as completed."""
    minima: dict = field(default_factory=dict)
    """/server_info's Minima section after the round (counters cumulative since the server started)."""
    counters: dict = field(default_factory=dict)
    """Minima's counters over this round alone (``COUNTERS``), ``peak_scratch_mib``: the most
    scratch alive at once since the server started (prefill tiles and conversion staging; the decode
    kernels' split buffers are not counted), ``scratch_reserve_mib``: what the pool's sizing kept
    for the prefill's tile in SGLang's budget, and ``peak_hot_pages``: "most held at once since the
    server started / hot pages of the split" (servers that report them)."""
    prefill_batches: int = 0
    """SGLang's prefill batches in the round (its ``Prefill batch`` lines; 0 in results that predate it)."""
    prefill_seqs_mean: float = 0.0
    """The mean sequences a prefill batch ran (SGLang's ``#new-seq``: a chunked request counts once per
    chunk; bench_serving's warm-up request is in the round)."""
    prefill_queued: int = 0
    """Prefill batches after which requests still waited (``#queue-req`` > 0). An arm with room for every
    client admits requests as they arrive, in many small batches that leave no queue, each stalling the
    running decode; a capacity-bound arm admits from a full queue in fewer, larger ones (SmolLM2's
    shared-prefix load, gsp_0956: Minima 66 batches of 4.0, 7 leaving a queue; FP8 33 of 8.0, 23)."""
    kv: str = ""
    """The arm's KV format (``kv_format``); empty in results written before it was recorded."""


COUNTERS = {
    "converted": lambda s: s["retier"]["pages"],
    "promoted": lambda s: s["promote"]["pages"],
    "pressure_converted": lambda s: s["pressure_retier_pages"],
    # what those were (MinimaStats.pressure_retier_tiers): Stale (due anyway), cached, a prompt's
    # deferred pages, or pages the policy keeps FP8 (Anchor, Recent)
    "pressure_stale": lambda s: s["pressure_retier_tiers"]["stale"],
    "pressure_cached": lambda s: s["pressure_retier_tiers"]["cached"],
    "pressure_deferred": lambda s: s["pressure_retier_tiers"]["deferred"],
    "pressure_kept": lambda s: s["pressure_retier_tiers"]["anchor"] + s["pressure_retier_tiers"]["recent"],
    "allocation_syncs": lambda s: s["allocation_syncs"],
    "hot_page_reads": lambda s: s["route_hot_pages"],
    "tq3_page_reads": lambda s: s["route_tq3_pages"],
    "fallbacks": lambda s: s["fallbacks"],
}
"""Per-round figures from MinimaStats.as_dict(): each the difference of the cumulative counter."""


def server_state(url: str) -> dict:
    """The scheduler's state from /server_info (Minima's under ``minima``)."""
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]


def counter_totals(minima: dict) -> dict[str, int]:
    """The cumulative ``COUNTERS`` of a server's /server_info ``minima`` state."""
    return {k: f(minima["stats"]) for k, f in COUNTERS.items()}


def model_geometry(model_dir: Path) -> dict:
    """The tiered KV's geometry: a hybrid model (Qwen3.6's) keeps KV in its full-attention layers only."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    if "full_attention_interval" in cfg:
        layers //= cfg["full_attention_interval"]
    return {
        "num_layers": layers,
        "num_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // heads),
    }


def _kv_cache_dtype(flags: list[str], default: str) -> str:
    """An SGLang arm's ``--kv-cache-dtype`` (the last one given: the server reads them in order)."""
    kv = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--kv-cache-dtype"]
    return kv[-1] if kv else default


def bytes_per_token(arm: Arm, geometry: dict, dtype: str, page_size: int, server_args: list[str] = ()) -> int:
    """KV bytes per token, all layers: SGLang's own cell size, or the one Minima's hook gives it, for
    the arm's flags followed by ``server_args`` (the server reads them in that order: the last wins)."""
    import torch

    flags = [*arm.flags, *server_args]
    if "--page-size" in server_args:
        raise SystemExit("--server-args: give the page size with --page-size (the budget is sized with it)")
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if arm.module != "sglang_minima.launch_server":
        fp8 = _kv_cache_dtype(flags, "auto").startswith("fp8")
        return 2 * geometry["num_kv_heads"] * geometry["head_dim"] * (1 if fp8 else dtype_bytes) * geometry["num_layers"]
    config = parse_minima_argv(split_minima_argv(flags)[0])
    return minima_cell_size(config, page_size=page_size, model_dtype_bytes=dtype_bytes, **geometry)


def scratch_reserve(arm: Arm, geometry: dict, page_size: int, server_args: list[str] = (), device: str = "cpu") -> int:
    """Bytes the arm's server keeps in its memory budget beside the KV pool: Minima's prefill scratch
    (one decoded TQ3 tile: 64 MiB at Llama-3-8B-class with ``minima``, nothing on ``minima_native``),
    from the flags the server gets, in their order (``run_arm``: the arm's, then ``--server-args``)."""
    if arm.module != "sglang_minima.launch_server":
        return 0
    return prefill_scratch_reserve_for([*arm.flags, *server_args], device, num_kv_heads=geometry["num_kv_heads"],
                                       head_dim=geometry["head_dim"], page_size=page_size)


def pool_tokens(budget_bytes: int, per_token: int, reserve: int, page_size: int) -> int:
    """The ``--max-total-tokens`` a byte budget buys: what is left after the reserve, in whole pages."""
    return int((budget_bytes - reserve) // per_token) // page_size * page_size


def kv_format(arm: Arm, dtype: str, server_args: list[str] = ()) -> str:
    """What an arm keeps its KV in, for the table: SGLang's cache dtype, or Minima's tiers with the
    Stale key width (bytes per token depend on it: 3-bit figures and 4-bit ones are not alike)."""
    flags = [*arm.flags, *server_args]
    if arm.module != "sglang_minima.launch_server":
        return _kv_cache_dtype(flags, dtype)
    config = parse_minima_argv(split_minima_argv(flags)[0])
    hot = "fp8" if config.hot_dtype != "auto" else dtype
    if config.disable_stale:
        return f"{hot} only"
    return f"{hot} {config.fp8_page_fraction:.0%} + TQ3 k{config.key_bits}"


def arms(device: str, lean_fraction: float) -> dict[str, Arm]:
    known = serve_arms.arms(device)
    lean = known["minima"].flags + ["--minima-fp8-page-fraction", str(lean_fraction)]
    chosen = {
        "sglang": Arm("sglang", known["sglang-bf16"].module, known["sglang-bf16"].flags),
        "minima-fp8": known["minima-fp8"],
        "minima": known["minima"],
        "minima-nodefer": known["minima-nodefer"],
        "minima-lean": Arm("minima-lean", "sglang_minima.launch_server", lean),
        "minima-lean-strict": Arm("minima-lean-strict", "sglang_minima.launch_server", lean + ["--minima-strict-hot-admission"]),
        # the default with SGLang's prefill read-done fast path off: the overlap scheduler's barrier is
        # then every extend's whole forward, as before the minima backend declared its reads done at
        # its plan (MinimaAttnBackend._snapshot_prefill_shared_reads): what that declaration gives
        "minima-coarse": Arm("minima-coarse", "sglang_minima.launch_server", known["minima"].flags,
                             {"SGLANG_ENABLE_PREFILL_WAR_READ_DONE": "0"}),
        # the pressure path converting ahead (one launch's worth), so fewer allocations wait on the device
        "minima-pbatch": Arm("minima-pbatch", "sglang_minima.launch_server",
                             known["minima"].flags + ["--minima-pressure-batch-pages", "64"]),
    }
    if device != "cpu":
        chosen["sglang-fp8"] = known["sglang-fp8"]
    return chosen


class Poller:
    """Peak running and queued requests (SGLang's /metrics gauges), sampled every half second."""

    def __init__(self, url: str):
        self.url, self.peak_running, self.peak_queued = url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
                    if line.startswith("sglang:num_running_reqs"):
                        self.peak_running = max(self.peak_running, int(float(line.split()[-1])))
                    elif line.startswith("sglang:num_queue_reqs"):
                        self.peak_queued = max(self.peak_queued, int(float(line.split()[-1])))
            except requests.RequestException:
                pass
            self._stop.wait(0.5)


def workload_args(args, clients: int, num_prompts: int) -> list[str]:
    if args.dataset == "gsp":
        return ["--dataset-name", "generated-shared-prefix",
                "--gsp-num-groups", str(args.num_groups), "--gsp-prompts-per-group", str(args.prompts_per_group),
                "--gsp-system-prompt-len", str(args.system_prompt_len),
                "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
                "--num-prompts", str(num_prompts), "--max-concurrency", str(clients)]
    # token ids, not their text: a random-ids prompt decoded and re-tokenized by the server grows (59,008
    # ids became 62,009 tokens on Qwen3.6's tokenizer and the canary's requests were refused, 2026-12-03)
    return ["--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0", "--tokenize-prompt",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(clients)]


def rounds(args) -> list[tuple[int, int]]:
    """(clients, prompts) per bench_serving run."""
    clients = [int(c) for c in str(args.max_concurrency).split(",")]
    if args.dataset == "gsp":
        return [(c, args.num_groups * args.prompts_per_group) for c in clients]
    prompts = [int(p) for p in args.num_prompts.split(",")] if args.num_prompts else clients
    if len(prompts) != len(clients):
        raise SystemExit(f"--num-prompts gives {len(prompts)} rounds, --max-concurrency {len(clients)}")
    return list(zip(clients, prompts))


def decode_step(windows: list[tuple[int, float]]) -> tuple[int, float]:
    """(rows, ms per decode step) from ``decode_windows``: at the most running requests, the window
    of highest generation throughput; (0, 0.0) with no decode line."""
    if not windows:
        return 0, 0.0
    rows = max(r for r, _ in windows)
    best = max(t for r, t in windows if r == rows)
    return rows, round(rows / best * 1000, 2) if best > 0 else 0.0


def decode_medians(windows: list[tuple[int, float]]) -> dict[str, list]:
    """{rows: [median ms per step, decode lines]} over ``decode_windows`` (each line a window of
    ``--decode-log-interval`` steps at that many running requests); the keys are strings, as JSON
    gives them back."""
    by_rows: dict[int, list[float]] = {}
    for rows, tput in windows:
        if tput > 0:
            by_rows.setdefault(rows, []).append(rows / tput * 1000)
    return {str(rows): [round(statistics.median(ms), 2), len(ms)] for rows, ms in sorted(by_rows.items())}


WARM_TOKENS = 4096
"""Prompt tokens of the warm-up (at most; ``--input-len`` / ``--system-prompt-len`` if shorter)."""


def warm_up(url: str, args) -> None:
    """Before the measured rounds: one prompt, then the same prompt again (a prefix hit, on the pages
    the first one's decode converted, for Minima), then a cache flush. Whatever a server builds on its
    first prefill over a cached prefix (FlashInfer's JIT modules, TileLang builds) is built here and
    not inside a round: bench_serving's own warm-up request is the first prompt of the dataset, so the
    round's first request is that hit (2026-12-05: a 55 s stall inside decode_heavy's measured run)."""
    n = min(WARM_TOKENS, args.system_prompt_len if args.dataset == "gsp" else args.input_len)
    ids = [1000 + (i * 7919) % 31000 for i in range(n)]  # inside every served vocabulary (49,152 and up)
    for _ in range(2):
        r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}, timeout=1800)
        r.raise_for_status()
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def run_arm(arm: Arm, args, model_dir: Path, model_flags: list[str], geometry: dict, work: Path,
            results: list[ArmResult]) -> None:
    """Serve one arm and append a result per round to ``results`` as each ends (a round that fails
    or is cut short keeps the rounds before it)."""
    per_token = bytes_per_token(arm, geometry, args.dtype, args.page_size, args.server_args)
    # Minima's prefill scratch is in the budget, as the server charges it (runs before 2026-12-06 evening
    # gave the pool the whole budget: at Llama-3-8B-class 64 MiB of 6 GiB, a 28th request of 6,144 at 20%)
    reserve = scratch_reserve(arm, geometry, args.page_size, args.server_args, e2e_device())
    tokens = pool_tokens(int(args.budget_mib * 2**20), per_token, reserve, args.page_size)
    common = ["--model-path", str(model_dir), *model_flags, "--dtype", args.dtype,
              "--page-size", str(args.page_size), "--max-total-tokens", str(tokens),
              "--max-running-requests", str(args.max_running_requests), "--enable-metrics"]
    if e2e_device() == "cpu":  # no graphs on CPU (the SGLang arms' own flags say so already)
        cpu = {"--device": "cpu", "--cuda-graph-backend-decode": "disabled", "--cuda-graph-backend-prefill": "disabled"}
        common += [x for flag, value in cpu.items() if flag not in arm.flags for x in (flag, value)]
    # --server-args last: a flag given there wins over the arm's own (argparse keeps the last), as
    # bytes_per_token and scratch_reserve read them
    server = launch(common + arm.flags + args.server_args, work / f"{arm.name}.log", env=arm.env, module=arm.module)
    before = None
    try:
        warm_up(server.url, args)
        minima = server_state(server.url).get("minima")
        if minima:  # the rounds' counters start after the warm-up
            before = counter_totals(minima)
        for clients, num_prompts in tqdm(rounds(args), desc=arm.name, leave=False):
            out_file = work / f"{arm.name}-c{clients}.jsonl"
            out_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", server.url,
                   "--tokenizer", str(model_dir), *workload_args(args, clients, num_prompts),
                   "--output-file", str(out_file), "--seed", "1", "--disable-tqdm", "--output-details"]
            log_start = server.log_path.stat().st_size
            with Poller(server.url) as poll, open(work / f"{arm.name}-c{clients}.bench.log", "w") as log:
                # bench_serving caches its prompts under ~/.cache
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(work)})
            bench = json.loads(out_file.read_text().strip().splitlines()[-1])
            with open(server.log_path, errors="replace") as f:
                f.seek(log_start)
                round_log = f.read()
            windows = decode_windows(round_log)
            prefills, seqs_mean, prefills_queued = prefill_batches(round_log)
            rows, step_ms = decode_step(windows)
            state = server_state(server.url)
            minima = state.get("minima", {})
            counters = {}
            if minima:
                now = counter_totals(minima)
                counters = {k: v - (before or {}).get(k, 0) for k, v in now.items()}
                before = now
                # the most decoded TQ3 (tiles, staging) alive at once so far: bounded, never a dense copy
                counters["peak_scratch_mib"] = round(minima["stats"]["peak_scratch_bytes"] / 2**20, 1)
                # what the pool's sizing kept for it in SGLang's budget (the minima backend's prefill tile)
                reserve = minima["pool"].get("prefill_scratch_reserve_bytes")
                if reserve is not None:
                    counters["scratch_reserve_mib"] = round(reserve / 2**20, 1)
                # the most hot pages held at once so far, against the hot pages the split gave
                # (--minima-fp8-page-fraction): what the workload needed of the FP8 format
                pool = minima["pool"]
                if "peak_hot_pages_held" in pool:
                    counters["peak_hot_pages"] = f'{pool["peak_hot_pages_held"]} / {pool["hot_pages"]}'
            results.append(ArmResult(
                arm=arm.name, clients=clients, num_prompts=num_prompts, bytes_per_token=per_token,
                max_total_tokens=state.get("max_total_num_tokens", tokens),
                startup_s=server.startup_s, completed=bench["completed"],
                output_throughput=bench["output_throughput"], request_throughput=bench["request_throughput"],
                mean_ttft_ms=bench["mean_ttft_ms"], median_ttft_ms=bench["median_ttft_ms"],
                p99_ttft_ms=bench["p99_ttft_ms"], mean_tpot_ms=bench["mean_tpot_ms"], duration_s=bench["duration"],
                median_itl_ms=bench["median_itl_ms"], p99_itl_ms=bench["p99_itl_ms"],
                **stall_fields(bench, step_ms),
                peak_running_requests=poll.peak_running, peak_queued_requests=poll.peak_queued,
                decode_rows=rows, decode_step_ms=step_ms, decode_medians=decode_medians(windows),
                kv=kv_format(arm, args.dtype, args.server_args),
                output_tokens_retokenized=bench.get("total_output_tokens_retokenized", -1),
                minima=minima, counters=counters, prefill_batches=prefills, prefill_seqs_mean=seqs_mean,
                prefill_queued=prefills_queued,
            ))
            write(args, geometry, results)
    finally:
        server.stop()


STALL_STEPS = 3.0
"""An inter-token gap this many decode steps long is a stall: a step's time varies by less (a decode
window's best against its median: 5.15 / 7.11 ms at SmolLM2's 64 rows, gsp_0956), and a prefill batch
between two steps takes about ten (51 ms there, the p99 gap in both arms)."""


def stall_fields(bench: dict, step_ms: float) -> dict:
    """ArmResult's stall fields from a bench_serving record's per-request gaps (``itls``, seconds).
    The step: the best decode window's (``decode_step_ms``), or the gaps' upper quartile where that is
    shorter (a short round's few decode lines span its prefill: 626 ms a step against 80 ms gaps in a
    16-token CPU round). bench_serving spreads a streamed chunk's gap over its tokens, so a server with
    ``--stream-interval`` > 1 hides stalls from this."""
    per_request = [req for req in bench.get("itls") or [] if req]  # a failed request has none
    gaps = [g * 1000 for req in per_request for g in req]
    if len(gaps) < 2:
        return {"itl_stalls": None, "itl_stall_share": None, "itl_stall_ms": None}
    quartile = statistics.quantiles(gaps, n=4, method="inclusive")[2]
    threshold = STALL_STEPS * (min(step_ms, quartile) if step_ms > 0 else quartile)
    stalls = [g for g in gaps if g > threshold]
    total = sum(gaps)
    return {"itl_stalls": round(len(stalls) / len(per_request), 2),
            "itl_stall_share": round(sum(stalls) / total, 3) if total else 0.0, "itl_stall_ms": round(threshold, 2)}


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}" if den else "-"


def _itl(r: ArmResult) -> str:
    if not r.median_itl_ms:
        return "-"
    stalls = "" if r.itl_stalls is None else f"; {r.itl_stalls:.2f} ({r.itl_stall_share:.0%}) > {r.itl_stall_ms:g} ms"
    return f"{r.median_itl_ms:.1f} / {r.p99_itl_ms:.1f}{stalls}"


def _prefills(r: ArmResult) -> str:
    return f"{r.prefill_batches} ({r.prefill_seqs_mean:.1f}; {r.prefill_queued})" if r.prefill_batches else "-"


def _step(r: ArmResult) -> str:
    if not r.decode_rows:
        return "-"
    median = r.decode_medians.get(str(r.decode_rows))
    return f"{r.decode_step_ms}{f' / {median[0]}' if median else ''} @ {r.decode_rows}"


def full_batch(r: ArmResult) -> tuple[float, float] | None:
    """(generation tok/s at the round's most running requests, from the median decode line there; the
    share of the round's decode lines at that batch): the steady state the end-to-end figure dilutes
    with the round's tail, its last requests decoding at a few rows. None without decode lines."""
    median = r.decode_medians.get(str(r.decode_rows))
    if not median or not median[0]:
        return None
    lines = sum(n for _, n in r.decode_medians.values())
    return r.decode_rows / median[0] * 1000, median[1] / lines


def _full_batch(r: ArmResult, base: ArmResult) -> str:
    got, ref = full_batch(r), full_batch(base)
    if got is None:
        return "-"
    return f"{got[0]:,.0f} ({_ratio(got[0], ref[0]) if ref else '-'}) / {got[1]:.0%}"


def _converted(c: dict) -> str:
    """Pages converted in the round, and those converted for want of a free hot page by what they were."""
    if "converted" not in c:
        return "-"
    if "pressure_kept" not in c:  # a result written before the breakdown
        return str(c["converted"])
    return f"{c['converted']} ({c['pressure_stale']} / {c['pressure_cached']} / {c['pressure_deferred']} / {c['pressure_kept']})"


def render(results: list[ArmResult]) -> str:
    """One row per round and arm; "x base" is the ratio to the round's baseline arm (BASELINES),
    "base / arm TPOT" > 1 where the arm decodes faster."""
    lines = [
        "| clients | prompts | arm | KV | bytes/token | logical tokens | x base | peak running | peak queued | out tok/s "
        "| x base | mean TTFT ms | p99 TTFT ms | mean TPOT ms | base / arm TPOT "
        "| median / p99 ITL ms; stalls per request (their share of the gaps) > the gap counted | decode step ms @ rows (best window / median) "
        "| full-batch tok/s (x base) / decode lines at full batch "
        "| converted (under pressure: Stale / cached / deferred / Anchor or Recent) | TQ3 page reads | fallbacks "
        "| peak scratch MiB since start / kept in the budget "
        "| peak hot pages held / hot pages | prefill batches (mean sequences; leaving a queue) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = [b for b in results if (b.clients, b.num_prompts) == (r.clients, r.num_prompts)]
        base = next((b for name in BASELINES for b in same if b.arm == name), r)
        c = r.counters
        arm = r.arm + (" (no output: every request rejected)" if r.output_tokens_retokenized == 0 else "")
        lines.append(
            f"| {r.clients} | {r.num_prompts} | {arm} | {r.kv or '?'} | {r.bytes_per_token:,.0f} | {r.max_total_tokens:,} "
            f"| {_ratio(r.max_total_tokens, base.max_total_tokens)} | {r.peak_running_requests} | {r.peak_queued_requests} "
            f"| {r.output_throughput:,.1f} | {_ratio(r.output_throughput, base.output_throughput)} "
            f"| {r.mean_ttft_ms:,.0f} | {r.p99_ttft_ms:,.0f} | {r.mean_tpot_ms:.1f} "
            f"| {_ratio(base.mean_tpot_ms, r.mean_tpot_ms)} "
            f"| {_itl(r)} "
            f"| {_step(r)} | {_full_batch(r, base)} | {_converted(c)} "
            f"| {c.get('tq3_page_reads', '-')} | {c.get('fallbacks', '-')} | {c.get('peak_scratch_mib', '-')}"
            f"{' / ' + str(c['scratch_reserve_mib']) if 'scratch_reserve_mib' in c else ''} "
            f"| {c.get('peak_hot_pages', '-')} "
            f"| {_prefills(r)} |")
    return "\n".join(lines)


CANARY = dict(model="qwen3.6-27b-class", dataset="random", input_len=59008, output_len=128, max_concurrency="2",
              num_prompts="2", max_running_requests=2, budget_mib=4096.0)
"""``--canary``'s workload, issue #16's (b): defaults, so a flag given beside it still wins."""


def canary_context(args) -> None:
    """The canary's --context-length unless one is given: the prompt, its output and a page of slack each side."""
    if not any(a.split("=")[0] == "--context-length" for a in args.server_args):
        args.server_args = [*args.server_args, "--context-length", str(args.input_len + args.output_len + 2 * args.page_size)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, default=96.0, help="KV bytes given to every arm")
    ap.add_argument("--model", help="model directory or a dummy geometry (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--lean-fraction", type=float, default=0.1)
    ap.add_argument("--dataset", choices=("gsp", "random"), default="gsp")
    ap.add_argument("--num-groups", type=int, default=4)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=192)
    ap.add_argument("--input-len", type=int, default=2048, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", help="random: prompts per round, comma-separated (default: its clients)")
    ap.add_argument("--max-concurrency", default="64", help="clients per round, comma-separated (rounds run in order)")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--arms", default="sglang,minima-fp8,minima,minima-lean")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="flags for every arm (last)")
    ap.add_argument("--work", type=Path, default=serve_arms.ROOT / ".cache" / "bench_serving")
    ap.add_argument("--out", type=Path, default=serve_arms.ROOT / "docs" / "results")
    ap.add_argument("--name", default="serving", help="the results' file name: <out>/<name>.json and .md")
    ap.add_argument("--from-json", type=Path, nargs="+",
                    help="re-render the table of earlier runs' JSON: several (one arm a device call, say) in one "
                         "table, each round's ratios against its baseline arm wherever that was measured")
    ap.add_argument("--canary", action="store_true",
                    help="issue #16's canary (b): Qwen3.6's geometry (random weights), 2 requests x 59,008 prompt "
                         "tokens, 128 out, both at once, a budget both fit in as FP8 (4 GiB): defaults that flags beside it override")
    if ap.parse_known_args(argv)[0].canary:
        ap.set_defaults(**CANARY)
    args = ap.parse_args(argv)
    if args.canary:
        canary_context(args)
    return args


WORKLOAD_ARGS = ("model", "dataset", "input_len", "output_len", "system_prompt_len", "question_len", "num_groups",
                 "prompts_per_group", "budget_mib", "max_running_requests", "page_size", "dtype", "server_args")
"""What two runs must share for their arms to stand in one table (besides the device)."""


def workload_differences(runs: list[dict]) -> list[str]:
    """The device and the ``WORKLOAD_ARGS`` in which saved runs differ (a run without a value: not compared)."""
    differ = []
    for key in ("device", *WORKLOAD_ARGS):
        values = {str(run.get(key) if key == "device" else run.get("args", {}).get(key)) for run in runs}
        values.discard("None")
        if len(values) > 1:
            differ.append(f"{key} ({' / '.join(sorted(values))})")
    return differ


def main() -> None:
    args = parse_args()
    if args.from_json:
        saved = [json.loads(path.read_text()) for path in args.from_json]
        if len(saved) > 1 and (differ := workload_differences(saved)):
            print(f"bench_capacity.py --from-json: the runs differ in {', '.join(differ)}: their ratios compare unlike loads",
                  file=sys.stderr)
        print(render([ArmResult(**r) for run in saved for r in run["results"]]))
        return
    known = arms(e2e_device(), args.lean_fraction)
    names = args.arms.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench_capacity.py: --arms: unknown {unknown} on {e2e_device()}; choose from {sorted(known)}")
    rounds(args)  # a bad --num-prompts / --max-concurrency pair fails before any server starts
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, model_flags = resolve_model(args.model, args.work)
    geometry = model_geometry(model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[ArmResult] = []
    for name in tqdm(names, desc="arms"):
        try:
            run_arm(known[name], args, model_dir, model_flags, geometry, args.work, results)
        except (RuntimeError, subprocess.CalledProcessError) as e:  # one arm that fails must not lose the others
            print(f"arm {name} failed: {e}"[-4000:], flush=True)
    write(args, geometry, results)
    print(render(ordered(results, args)))
    print(f"wrote {args.out / (args.name + '.json')}")


def ordered(results: list[ArmResult], args) -> list[ArmResult]:
    """By round (clients, prompts), then in --arms order: each round's arms side by side."""
    names = args.arms.split(",")
    return sorted(results, key=lambda r: (r.clients, r.num_prompts, names.index(r.arm)))


def write(args, geometry: dict, results: list[ArmResult]) -> None:
    """JSON + markdown of what is measured so far (after every round: a call cut short keeps it)."""
    results = ordered(results, args)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": e2e_device(),
         "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
         "geometry": geometry, "results": [asdict(r) for r in results]}, indent=1))
    if results:
        (args.out / f"{args.name}.md").write_text(render(results) + "\n")


if __name__ == "__main__":
    main()
