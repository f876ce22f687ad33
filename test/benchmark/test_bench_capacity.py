"""benchmark/serving/bench_capacity.py: each arm's KV byte budget, its rounds and its table.

The script sets up the CPU engine when imported (before any sglang import), so it is imported in a
child process here: the figures come back as JSON.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, types
from pathlib import Path
sys.path[:0] = [str(Path.cwd() / "benchmark" / "serving"), str(Path.cwd() / "test")]
import bench_capacity as bc
from minima_test_support.dummy_models import make_model

tmp = Path(sys.argv[1])
tok = tmp / "tokenizer"
tok.mkdir()
geo = {n: bc.model_geometry(make_model(n, tmp, tok)) for n in ("llama3-8b-class", "qwen3.6-27b-class")}
cuda = bc.arms("cuda", 0.1)
per_token = {name: bc.bytes_per_token(arm, geo["llama3-8b-class"], "bfloat16", 64) for name, arm in cuda.items()}
override = {
    "minima": bc.bytes_per_token(cuda["minima"], geo["llama3-8b-class"], "bfloat16", 64,
                                 ["--minima-fp8-page-fraction", "1.0"]),
    "sglang": bc.bytes_per_token(cuda["sglang"], geo["llama3-8b-class"], "bfloat16", 64, ["--kv-cache-dtype", "fp8_e4m3"]),
}
try:
    bc.bytes_per_token(cuda["minima"], geo["llama3-8b-class"], "bfloat16", 64, ["--page-size", "16"])
    page_size_refused = None
except SystemExit as e:
    page_size_refused = str(e)
rounds = bc.rounds(types.SimpleNamespace(max_concurrency="8,16", num_prompts=None, dataset="random"))
try:
    bc.rounds(types.SimpleNamespace(max_concurrency="8,16", num_prompts="8", dataset="random"))
    mismatch = None
except SystemExit as e:
    mismatch = str(e)

def result(arm, tokens, tput, tpot, out=100):
    return bc.ArmResult(arm=arm, clients=8, num_prompts=8, bytes_per_token=1, max_total_tokens=tokens,
                        startup_s=1, completed=8, output_throughput=tput, request_throughput=1, mean_ttft_ms=1,
                        median_ttft_ms=1, p99_ttft_ms=1, mean_tpot_ms=tpot, duration_s=1, peak_running_requests=8,
                        peak_queued_requests=0, output_tokens_retokenized=out)

table = bc.render([result("sglang-fp8", 1000, 100.0, 40.0), result("minima", 1820, 150.0, 32.0),
                   result("minima-lean", 3000, 0.5, 1.0, out=0), result("minima-fp8", 1000, 0.0, 0.0, out=0)])
log = "\n".join(f"[t] Decode batch, #running-req: {n}, #token: 9, token usage: 0.9, cuda graph: True, "
                f"gen throughput (token/s): {tput}, #queue-req: 0" for n, tput in ((8, 600.0), (16, 800.0), (16, 944.0), (16, 1.5)))
log += "\n[t] Decode batch [1234], #running-req: 4, #token: 9, gen throughput (token/s): 400.0, #queue-req: 0"
canary = vars(bc.parse_args(["--canary", "--server-args", "--mem-fraction-static", "0.8"]))
random_args = bc.workload_args(types.SimpleNamespace(dataset="random", input_len=59008, output_len=128), 2, 2)
canary_flags = vars(bc.parse_args(["--canary", "--output-len", "64", "--server-args", "--context-length=70000"]))
scratch = bc.render([bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "counters": {"peak_scratch_mib": 64.0}}),
                     bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__,
                                     "counters": {"peak_scratch_mib": 63.0, "scratch_reserve_mib": 64.0,
                                                 "peak_hot_pages": "40 / 2148", "converted": 90, "pressure_stale": 6,
                                                 "pressure_cached": 1, "pressure_deferred": 2, "pressure_kept": 1}})])
itl = bc.render([bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "median_itl_ms": 12.44, "p99_itl_ms": 230.5}),
                 bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "median_itl_ms": 5.8, "p99_itl_ms": 51.3,
                                 "itl_stalls": 17.0, "itl_stall_share": 0.48, "itl_stall_ms": 15.45}),
                 bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "median_itl_ms": 80.0, "p99_itl_ms": 99.0,
                                 "itl_stalls": 0.0, "itl_stall_share": 0.0, "itl_stall_ms": 297.0})])
# two requests' gaps (s) at a 5 ms step: 15 ms is three steps, not a stall; 16 and 50 ms are. A
# step longer than the gaps' upper quartile (15.5 ms here) gives way to it (50 ms a stall, 16 not); a
# failed request (no gaps) is not a request that could stall; fewer than two gaps, or a record without
# them (bench_serving without --output-details), no figure
gaps = [[0.005, 0.015, 0.05], [0.006, 0.016, 0.004, 0.004]]
stalls = [bc.stall_fields({"itls": gaps}, 5.0), bc.stall_fields({"itls": gaps}, 626.0),
          bc.stall_fields({"itls": gaps}, 0.0), bc.stall_fields({"itls": [*gaps, []]}, 5.0),
          bc.stall_fields({"itls": []}, 5.0), bc.stall_fields({"itls": [[0.05]]}, 5.0), bc.stall_fields({}, 5.0)]
prefill = bc.render([bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "prefill_batches": 66,
                                     "prefill_seqs_mean": 3.9, "prefill_queued": 7})])
import http.server, threading
seen = []
class Stub(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        seen.append((self.path, json.loads(body) if body else None))
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
stub = http.server.HTTPServer(("127.0.0.1", 0), Stub)
threading.Thread(target=stub.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{stub.server_address[1]}"
bc.warm_up(url, types.SimpleNamespace(dataset="random", input_len=6000, system_prompt_len=512))
bc.warm_up(url, types.SimpleNamespace(dataset="gsp", input_len=6000, system_prompt_len=512))
stub.shutdown()
warm = [(path, len(b["input_ids"]) if b else None, b and b["input_ids"][:3], b and b["sampling_params"]["max_new_tokens"])
        for path, b in seen]
llama = geo["llama3-8b-class"]
reserve = {name: bc.scratch_reserve(arm, llama, 64, [], "cuda") for name, arm in cuda.items()}
reserve["minima on minima_native"] = bc.scratch_reserve(cuda["minima"], llama, 64, ["--attention-backend", "minima_native"], "cuda")
reserve["minima on cpu"] = bc.scratch_reserve(cuda["minima"], llama, 64, [], "cpu")
share20 = bc.bytes_per_token(cuda["minima"], llama, "bfloat16", 64, ["--minima-fp8-page-fraction", "0.2"])
reserve["pool at 20%"] = [share20, bc.pool_tokens(6144 * 2**20, share20, reserve["minima"], 64)]
kv = {name: bc.kv_format(arm, "bfloat16") for name, arm in cuda.items()}
kv["minima k3"] = bc.kv_format(cuda["minima"], "bfloat16", ["--minima-key-bits", "3"])
print(json.dumps({"reserve": reserve, "warm": warm, "canary": canary, "canary_flags": canary_flags, "random_args": random_args, "scratch": scratch, "itl": itl, "stalls": stalls, "prefill": prefill, "kv": kv, "override": override, "page_size_refused": page_size_refused,
                  "iters": bc.decode_step(bc.decode_windows(log.splitlines()[-1])), "decode": bc.decode_step(bc.decode_windows(log)),
                  "medians": bc.decode_medians(bc.decode_windows(log)),
                  "full": bc.render([bc.ArmResult(**{**result("sglang-fp8", 10, 1.0, 1.0).__dict__, "decode_rows": 15,
                                                     "decode_medians": {"4": [8.75, 51], "15": [11.21, 205]}}),
                                      bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "decode_rows": 29,
                                                     "decode_medians": {"6": [9.42, 51], "29": [14.04, 103]}})]),
                  "median_cell": bc._step(bc.ArmResult(**{**result("minima", 10, 1.0, 1.0).__dict__, "decode_rows": 16,
                                                          "decode_step_ms": 16.95, "decode_medians": {"16": [20.0, 3]}})), "no_decode": bc.decode_step(bc.decode_windows("Prefill batch, #new-seq: 1")),
                  "geo": geo, "per_token": per_token, "cpu_arms": sorted(bc.arms("cpu", 0.1)),
                  "rounds": rounds, "mismatch": mismatch, "table": table}, default=str))
"""


def test_budgets_rounds_and_ratios(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the tiered KV's geometry: a hybrid model keeps KV in its full-attention layers only (every 4th)
    assert got["geo"]["llama3-8b-class"] == {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
    assert got["geo"]["qwen3.6-27b-class"] == {"num_layers": 16, "num_kv_heads": 4, "head_dim": 256}
    per = got["per_token"]
    assert per["sglang-fp8"] == 2 * 8 * 128 * 32  # K+V, one byte each, all layers
    assert per["sglang"] == 2 * per["sglang-fp8"]  # bf16
    assert per["minima-fp8"] == per["sglang-fp8"]  # Stale disabled: every page FP8, nothing else
    # defaults: a quarter of the pages FP8, the rest TQ3 with 4-bit keys (0.25 * 256 + 0.75 * (64 + 48 + 6)
    # bytes per head and layer; 3-bit keys, the 2026-12-02 H200 run's: 35,968)
    assert per["minima"] == 39_040 and per["minima-nodefer"] == per["minima"]
    assert per["minima-lean"] < per["minima"]
    assert per["minima-lean-strict"] == per["minima-lean"]  # strict admission: the same bytes, prompts wait
    assert per["minima-coarse"] == per["minima"]  # the same server, SGLang's barrier at the whole extend
    assert per["minima-pbatch"] == per["minima"]  # the same pool, the pressure path converting ahead
    # what each server keeps beside its pool, in the budget: Minima's prefill tile on `minima` (8 heads x
    # 16,384 tokens x 128 x 4 bytes), nothing for SGLang's arms, minima_native or the CPU
    reserve = got["reserve"]
    minima_arms = {"minima", "minima-fp8", "minima-nodefer", "minima-lean", "minima-lean-strict", "minima-coarse",
                   "minima-pbatch"}
    assert {name: reserve[name] for name in minima_arms} == dict.fromkeys(minima_arms, 64 * 2**20)
    assert reserve["sglang-fp8"] == reserve["sglang"] == 0
    assert reserve["minima on minima_native"] == reserve["minima on cpu"] == 0
    # 6 GiB at a 20% share (37,274 bytes a token): 171,008 tokens, 27 requests of 6,144 (28 without the reserve)
    assert reserve["pool at 20%"] == [37_274, 171_008]
    assert "sglang-fp8" not in got["cpu_arms"]  # SGLang's FP8 KV does not start on this CPU
    assert got["rounds"] == [[8, 8], [16, 16]]
    # at the most running requests (16), the fastest window: 16 rows / 944 tok/s
    assert got["decode"] == [16, 16.95] and got["no_decode"] == [0, 0.0]
    # the median per row count: 16 rows over 800, 944 and 1.5 tok/s -> 20.0 ms a step (the middle line)
    assert got["medians"] == {"4": [10.0, 1], "8": [13.33, 1], "16": [20.0, 3]}
    assert got["median_cell"] == "16.95 / 20.0 @ 16"  # as read back from JSON (str keys)
    assert "--num-prompts gives 1 rounds, --max-concurrency 2" in got["mismatch"]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")] for line in got["table"].splitlines()[2:]}
    minima = rows["minima"]
    assert minima[4] == "?"  # a result without its KV format (older JSON): said so, not guessed
    assert minima[7] == "1.82"  # admitted tokens vs the FP8 baseline
    assert minima[11] == "1.50"  # output throughput vs the baseline
    assert minima[15] == "1.25"  # baseline TPOT / Minima's: > 1 is faster
    assert "minima-lean (no output: every request rejected)" in rows
    zero = rows["minima-fp8 (no output: every request rejected)"]  # a TPOT of 0: no ratio, no crash
    assert zero[15] == "-" and zero[11] == "0.00"
    # bench_serving's median / p99 inter-token latency beside TPOT ("-" where a result predates it)
    assert minima[16] == "-" and got["itl"].splitlines()[2].split("|")[16].strip() == "12.4 / 230.5"
    # and the gaps over three decode steps, per request, with their share of the summed gaps: the
    # prefill batches (or syncs) run between a request's steps
    assert got["itl"].splitlines()[3].split("|")[16].strip() == "5.8 / 51.3; 17.00 (48%) > 15.45 ms"
    assert got["itl"].splitlines()[4].split("|")[16].strip() == "80.0 / 99.0; 0.00 (0%) > 297 ms"
    s = got["stalls"]
    assert s[0] == {"itl_stalls": 1.0, "itl_stall_share": 0.66, "itl_stall_ms": 15.0}
    assert s[1] == s[2] == {"itl_stalls": 0.5, "itl_stall_share": 0.5, "itl_stall_ms": 46.5}
    assert s[3] == s[0]
    assert s[4] == s[5] == s[6] == {"itl_stalls": None, "itl_stall_share": None, "itl_stall_ms": None}
    # the KV column: SGLang's cache dtype, Minima's tiers with the Stale key width (its bytes depend on it)
    assert got["kv"]["sglang-fp8"] == "fp8_e4m3" and got["kv"]["sglang"] == "bfloat16"
    assert got["kv"]["minima-fp8"] == "fp8 only"
    assert got["kv"]["minima"] == "fp8 25% + TQ3 k4" and got["kv"]["minima k3"] == "fp8 25% + TQ3 k3"
    assert got["kv"]["minima-lean"] == "fp8 10% + TQ3 k4"
    # the last columns: the most decoded TQ3 alive at once (a bounded tile, not a dense copy of the
    # cache), then the most hot pages held at once against the split's
    assert got["scratch"].splitlines()[0].endswith(
        "| peak scratch MiB since start / kept in the budget | peak hot pages held / hot pages "
        "| prefill batches (mean sequences; leaving a queue) |")
    assert got["scratch"].splitlines()[2].endswith("| 64.0 | - | - |") and rows["minima"][-4] == "-"
    assert got["scratch"].splitlines()[3].endswith("| 63.0 / 64.0 | 40 / 2148 | - |")  # a server that reports them
    # the round's prefill batches and the requests each admitted ("-" in results that predate them)
    assert got["prefill"].splitlines()[2].endswith("| 66 (3.9; 7) |")
    # conversions, and those made for want of a free hot page by what they were ("-": not a Minima
    # server; the total alone: a result written before the breakdown)
    assert got["scratch"].splitlines()[3].split("|")[19].strip() == "90 (6 / 1 / 2 / 1)"
    assert got["scratch"].splitlines()[2].split("|")[19].strip() == "-"
    # the steady state beside the end-to-end figure: rows / the median step at the most running
    # requests, and the share of the round's decode lines there (decode_heavy_0211's servers); "-"
    # without decode lines
    full = [line.split("|")[18].strip() for line in got["full"].splitlines()[2:]]
    assert full == ["1,338 (1.00) / 80%", "2,066 (1.54) / 67%"]
    assert rows["minima"][18] == "-"
    # --canary: #16's (b) workload, the context room for the prompt and its output, other flags kept
    c = got["canary"]
    assert (c["model"], c["dataset"], c["input_len"], c["output_len"]) == ("qwen3.6-27b-class", "random", 59008, 128)
    assert (c["max_concurrency"], c["num_prompts"], c["max_running_requests"]) == ("2", "2", 2)
    assert c["server_args"] == ["--mem-fraction-static", "0.8", "--context-length", "59264"]
    assert c["budget_mib"] == 4096.0
    # random prompts go as token ids: their text re-tokenized grows past the canary's context (the H200, 2026-12-03)
    assert "--tokenize-prompt" in got["random_args"] and got["random_args"][got["random_args"].index("--random-input-len") + 1] == "59008"
    # a flag beside --canary wins over its preset, in either spelling
    c = got["canary_flags"]
    assert (c["output_len"], c["input_len"], c["server_args"]) == (64, 59008, ["--context-length=70000"])
    # flags given to every arm count in its budget: the server reads them after the arm's own
    assert got["override"]["minima"] == per["minima-fp8"] and got["override"]["sglang"] == per["sglang-fp8"]
    assert "--page-size" in got["page_size_refused"]
    # the warm-up: a prompt of at most 4,096 ids (gsp: the system prompt's length), the same prompt again
    # (the prefix hit), a cache flush; then the rounds
    ids = [1000, 1000 + 7919, 1000 + (2 * 7919) % 31000]
    assert got["warm"] == [["/generate", 4096, ids, 16], ["/generate", 4096, ids, 16], ["/flush_cache", None, None, None],
                           ["/generate", 512, ids, 16], ["/generate", 512, ids, 16], ["/flush_cache", None, None, None]]
    assert got["iters"] == [4, 10.0]  # SGLang's line with LOG_FORWARD_ITERS: "Decode batch [N], ..."


def test_runs_of_separate_calls_render_as_one_table(tmp_path):
    # one arm a device call (the 128-prompt decode-bound load): the Minima arm's ratios against the
    # FP8 arm of another file, as if one run had measured both
    def run(arm, tokens, tput):
        return {"arm": arm, "clients": 64, "num_prompts": 128, "bytes_per_token": 1, "max_total_tokens": tokens,
                "startup_s": 1, "completed": 128, "output_throughput": tput, "request_throughput": 1,
                "mean_ttft_ms": 1, "median_ttft_ms": 1, "p99_ttft_ms": 1, "mean_tpot_ms": 1, "duration_s": 1,
                "peak_running_requests": 1, "peak_queued_requests": 0, "output_tokens_retokenized": 1}

    load = {"model": "llama3-8b-class", "input_len": "4096", "budget_mib": "6144.0", "arms": "minima-lean"}

    def table(fp8_args: dict) -> subprocess.CompletedProcess:
        (tmp_path / "m.json").write_text(json.dumps({"device": "cuda", "args": load,
                                                     "results": [run("minima-lean", 181_376, 1_700.0)]}))
        (tmp_path / "f.json").write_text(json.dumps({"device": "cuda", "args": fp8_args,
                                                     "results": [run("sglang-fp8", 98_304, 1_250.0)]}))
        out = subprocess.run([sys.executable, str(ROOT / "benchmark" / "serving" / "bench_capacity.py"), "--from-json",
                              str(tmp_path / "m.json"), str(tmp_path / "f.json")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    out = table({**load, "arms": "sglang-fp8"})  # the arms differ, the load does not: no warning
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")] for line in out.stdout.splitlines()[2:]}
    assert rows["minima-lean"][7] == "1.85" and rows["minima-lean"][11] == "1.36"
    assert rows["sglang-fp8"][11] == "1.00"
    assert rows["minima-lean"][-2] == "-"  # results written before the prefill-batch column: said so
    assert "differ" not in out.stderr
    # runs of unlike loads: still one table, and a warning naming what differs
    out = table({**load, "input_len": "32768"})
    assert "the runs differ in input_len (32768 / 4096)" in out.stderr
