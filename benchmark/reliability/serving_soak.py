"""Serving soak: a real ``python -m sglang_minima.launch_server`` under mixed traffic, then the
promises checked once the load stops. On CPU by default; on a GPU under the device harness
(``MINIMA_E2E_DEVICE=cuda``, scripts/device/env.sh; ``run_suite.sh soak``).

The server runs the embedded default model under ``SGLANG_DEBUG_MEMORY_POOL=1`` with a KV budget
small enough (``--max-total-tokens``) that every lifecycle path runs: conversions to TQ3, promotions
back to FP8, prefix-cache evictions and request retractions. For ``--duration-s`` it gets:

- ``python -m sglang.bench_serving`` rounds in the background, alternating generated-shared-prefix
  and random-ids prompts;
- nonce clients: each prompt (a shared document, per-request notes, then a few-shot "copy the code")
  carries a fresh code word its answer must echo, so an answer built from another request's KV is
  caught; the streaming ones decode on long past it, so running requests outgrow the pool;
- disconnecting clients: streams closed after a random number of chunks (SGLang aborts them);
- abort clients: requests with their own rid, cancelled by ``/abort_request`` after a random delay.

``--profile`` (default: the device the server runs on) sizes the traffic to the machine: ``cpu``
(two cores decode SmolLM2 at a few tokens/s) or ``cuda`` (hundreds of times faster: more clients,
larger bench_serving rounds, a larger pool, aborts within a second, bounded drain and idle waits).
Every flag it sets can be given explicitly. ``--wall-budget-s`` ends the load early enough that the
run, the server's start included, reports within that many seconds (a device call's limit).

Retractions: in six 2-3 minute pilots (pools of 1,024 to 2,048 tokens, conservativeness down to
0.05) decode never ran out of pages by itself: admission is bounded by the FP8 pages a prefill can
get, so the running set stays inside the pool. ``--forced-retract-interval`` turns on SGLang's own
``SGLANG_TEST_RETRACT``, which retracts one running request every N forward steps through the same
``retract_decode`` path as a real shortage.

After the load: every client came back (within the profile's drain bound), every path's counter
moved (conversions, promotions, evictions, retractions, aborts), the server goes idle with every
physical page free or held by the prefix cache and every reference count equal to its owners
(test/minima_test_support/idle.py), no answer carries another request's code (answers that miss
their own code are counted and replayed alone: the model's copy errors), and the server still answers. JSON +
markdown beside ``--out`` (written before the server stops); exit status 1 if a check failed.

  .venv/bin/python benchmark/reliability/serving_soak.py --duration-s 600 \\
      --out docs/results/reliability/serving_soak.json
  python3 benchmark/reliability/serving_soak.py --wall-budget-s 530 --out $OUT/soak/serving_soak.json  # device
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test"))

from minima_test_support.idle import assert_idle  # noqa: E402
from minima_test_support.server import Server, device_args, e2e_device, launch  # noqa: E402

WORDS = ("apple river stone cloud window garden silver orange basket candle mirror forest ladder pencil "
         "rocket violin harbor meadow").split()
COPY_SHOTS = "Copy the code.\nCode: KXT-5521\nCopy: KXT-5521\nCode: PLM-9043\nCopy: PLM-9043\n"
"""A format SmolLM2-135M copies reliably (20/20 in the pilot, with documents of up to 600 tokens before it)."""

COUNTERS = {  # path -> (Prometheus sample, labels that must match)
    "conversions": ("sglang:minima_conversion_pages_total", 'direction="retier"'),
    "promotions": ("sglang:minima_conversion_pages_total", 'direction="promote"'),
    "pressure_conversions": ("sglang:minima_pressure_retier_pages_total", ""),
    "evicted_tokens": ("sglang:evicted_tokens_total", ""),
    "retractions": ("sglang:num_retracted_requests_total", ""),
    "aborts": ("sglang:num_aborted_requests_total", ""),
    "prefix_hit_tq3_pages": ("sglang:minima_prefix_hit_pages_total", 'format="tq3"'),
}
MUST_MOVE = ("conversions", "promotions", "evicted_tokens", "retractions", "aborts")
PROFILES = {
    # Two CPU cores decode SmolLM2 at 1-5 tokens/s: a few clients keep the server full; a request
    # may wait minutes, so the waits are long and the drain outlasts every client's own timeout.
    "cpu": {"duration_s": 600, "max_total_tokens": 2048, "max_running_requests": 12, "nonce_clients": 4,
            "disconnect_clients": 1, "abort_clients": 1, "bench_prompts": 4, "bench_concurrency": 4,
            "forced_retract_interval": 40, "abort_after_s": (5.0, 30.0), "request_timeout_s": 900,
            "sample_timeout_s": 60, "drain_timeout_s": 1800, "idle_timeout_s": 300},
    # A GPU runs hundreds of forward steps a second: 4x the pool and more clients keep it under
    # pressure; a forced retraction every 500 steps (seconds apart), not every 40; aborts land
    # within a 64-token request's life; short bounds so a stuck request fails a check instead of
    # running the device call out of time.
    "cuda": {"duration_s": 420, "max_total_tokens": 8192, "max_running_requests": 32, "nonce_clients": 16,
             "disconnect_clients": 4, "abort_clients": 4, "bench_prompts": 128, "bench_concurrency": 16,
             "forced_retract_interval": 500, "abort_after_s": (0.0, 1.5), "request_timeout_s": 120,
             "sample_timeout_s": 10, "drain_timeout_s": 15, "idle_timeout_s": 20},
}
REPLAY_S = 10
"""Seconds at most for replaying missed nonce prompts after the load."""
REPORT_S = 10 + REPLAY_S
"""Seconds kept, under --wall-budget-s, for the checks after the idle wait and the report."""
LONG_DECODE_TOKENS = 256
"""Tokens a streaming nonce client decodes (past its code, ``ignore_eos``)."""
DEFAULT_SERVER_ARGS = ["--minima-recent-pages", "1", "--minima-fp8-page-fraction", "0.5", "--schedule-conservativeness", "0.3"]
"""Tuned in the pilots for a 2,048-token pool (32 pages of 64): one Recent page per request and half
the pages FP8 leave FP8 pages spare for promotions; SGLang's admission reserving 0.3x its usual
decode headroom admits more than it can finish without evicting the prefix cache."""


@dataclass
class Tally:
    """What the soak's own clients saw (updated from several threads under ``lock``)."""

    requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    nonce_checked: int = 0
    nonce_mismatches: list = field(default_factory=list)
    disconnects: int = 0
    aborts_sent: int = 0
    aborted_by_request: int = 0
    finished_before_abort: int = 0
    errors: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def note(self, name: str, item: dict) -> None:
        with self.lock:
            getattr(self, name).append(item)

    def as_dict(self) -> dict:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def metric_totals(url: str, timeout_s: float = 60) -> dict[str, float]:
    """Each path's counter, summed over its samples (SGLang's and Minima's labels)."""
    text = requests.get(url + "/metrics", timeout=timeout_s).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for path, (name, labels) in COUNTERS.items():
            if line.startswith(name + "{") and labels in line:
                totals[path] += float(line.rsplit(" ", 1)[1])
    return totals


def minima_section(url: str, timeout_s: float = 60) -> dict:
    return requests.get(url + "/server_info", timeout=timeout_s).json()["internal_states"][0]["minima"]


class Prompts:
    """Nonce prompts: one of a few shared documents (prefix-cache hits, shared Anchor pages), notes
    of random length (mixed prompt lengths, a distinct tail), then the copy task with a fresh code."""

    def __init__(self, seed: int, num_docs: int = 4):
        self.rng = random.Random(seed)
        self.docs = []
        for g in range(num_docs):
            r = random.Random(seed * 1000 + g)
            n = r.randint(5, 40)  # ~70 to ~500 tokens
            self.docs.append(" ".join(f"Shelf {i} holds {r.randint(2, 90)} {r.choice(WORDS)}s." for i in range(n)))
        self.lock = threading.Lock()
        self.codes: set[str] = set()  # every code handed out: a wrong answer holding another's is a leak

    def foreign(self, code: str, answer: str) -> list[str]:
        """Codes of other requests in ``answer``."""
        with self.lock:
            return [c for c in self.codes if c != code and c in answer]

    def make(self, short: bool = False) -> tuple[str, str]:
        """(prompt, code); ``short``: the document's first dozen sentences and no notes (~150 tokens)."""
        with self.lock:
            r = self.rng
            code = "".join(r.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3)) + f"-{r.randint(1000, 9999)}"
            self.codes.add(code)
            notes = "" if short else " ".join(r.choice(WORDS) for _ in range(r.randint(0, 150)))
            doc = r.choice(self.docs)
        if short:
            doc = ".".join(doc.split(".")[:12]) + "."
        return f"{doc}\n\nNotes: {notes}\n\n{COPY_SHOTS}Code: {code}\nCopy:", code


def _stream_events(response):
    for line in response.iter_lines():
        if line.startswith(b"data:") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data:"):])


def nonce_client(url: str, prompts: Prompts, tally: Tally, deadline: float, stream: bool, timeout_s: float) -> None:
    """Streaming ones send short prompts and decode long past the code (``ignore_eos``): several are
    admitted at once and grow until decode runs out of pages and SGLang retracts one; the answer
    must still start with its code."""
    sampling = ({"max_new_tokens": LONG_DECODE_TOKENS, "ignore_eos": True} if stream else {"max_new_tokens": 12})
    while time.time() < deadline:
        text, code = prompts.make(short=stream)
        body = {"text": text, "stream": stream, "sampling_params": {**sampling, "temperature": 0}}
        tally.add(requests=1)
        try:
            with requests.post(url + "/generate", json=body, stream=stream, timeout=timeout_s) as r:
                if r.status_code != 200:
                    tally.note("errors", {"client": "nonce", "status": r.status_code, "body": r.text[:300]})
                    continue
                out = None
                for out in (_stream_events(r) if stream else [r.json()]):
                    pass
        except requests.RequestException as e:
            tally.note("errors", {"client": "nonce", "error": repr(e)[:300]})
            continue
        if not out or "meta_info" not in out:
            tally.note("errors", {"client": "nonce", "last_event": str(out)[:300]})
            continue
        meta = out["meta_info"]
        tally.add(completed=1, prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
                  nonce_checked=1)
        if code not in out["text"][: len(code) + 4]:
            tally.note("nonce_mismatches", {"code": code, "answer": out["text"], "stream": stream,
                                            "foreign_codes": prompts.foreign(code, out["text"]),
                                            "prompt_tokens": meta["prompt_tokens"], "cached": meta.get("cached_tokens"),
                                            "prompt": text})


def nonce_check(checked: int, misses: list[dict], codes_handed_out: int, replay: dict) -> dict:
    """An answer built from another request's KV shows that request's code: every code handed out
    is searched for in every miss. A miss without one is the model's copy error (SmolLM2-135M
    reading compressed pages), counted and replayed alone, not a leak. No answer checked: no evidence."""
    return {"passed": checked > 0 and not any(m["foreign_codes"] for m in misses), "checked": checked,
            "with_another_requests_code": sum(bool(m["foreign_codes"]) for m in misses),
            "codes_handed_out": codes_handed_out, "missed_own_code": len(misses), "replayed": replay["replayed"],
            "replay_same_miss": replay["same_miss"], "replay_echoed": replay["echoed"]}


def replay_misses(url: str, tally: Tally, limit: int, timeout_s: float) -> dict:
    """Send the first ``limit`` missed prompts again, one at a time on the idle server: a miss the
    model repeats alone is its own answer, not another request's KV (its pages' formats may differ
    from the loaded run's, so a miss that does not repeat proves nothing either way)."""
    replays, deadline = [], time.time() + REPLAY_S
    for miss in tally.nonce_mismatches[:limit]:
        if time.time() > deadline:
            break
        body = {"text": miss["prompt"], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        try:
            answer = requests.post(url + "/generate", json=body,
                                   timeout=min(timeout_s, max(1.0, deadline - time.time()))).json()["text"]
        except (requests.RequestException, KeyError, ValueError) as e:
            replays.append({"code": miss["code"], "error": repr(e)[:200]})
            continue
        head = len(miss["code"]) + 4
        replays.append({"code": miss["code"], "answer": answer, "same_miss": answer[:head] == miss["answer"][:head],
                        "echoed": miss["code"] in answer[:head]})
    return {"replayed": len(replays), "same_miss": sum(r.get("same_miss", False) for r in replays),
            "echoed": sum(r.get("echoed", False) for r in replays), "replays": replays}


def disconnect_client(url: str, prompts: Prompts, tally: Tally, deadline: float, rng: random.Random,
                      timeout_s: float) -> None:
    while time.time() < deadline:
        text, _ = prompts.make()
        body = {"text": text, "stream": True,
                "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
        tally.add(requests=1)
        keep = rng.randint(1, 8)
        try:
            with requests.post(url + "/generate", json=body, stream=True, timeout=timeout_s) as r:
                for i, _ in enumerate(_stream_events(r), 1):
                    if i >= keep:
                        break  # closing the stream: SGLang aborts the request
            tally.add(disconnects=1)
        except requests.RequestException as e:
            tally.note("errors", {"client": "disconnect", "error": repr(e)[:300]})


def abort_client(url: str, prompts: Prompts, tally: Tally, deadline: float, rng: random.Random, name: str,
                 after_s: tuple[float, float], timeout_s: float) -> None:
    i = 0
    while time.time() < deadline:
        i += 1
        rid = f"soak-{name}-{i}"
        text, _ = prompts.make()
        result: dict = {}

        def generate() -> None:
            body = {"text": text, "rid": rid,
                    "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
            try:
                result["response"] = requests.post(url + "/generate", json=body, timeout=timeout_s)
            except requests.RequestException as e:
                result["error"] = repr(e)[:300]

        tally.add(requests=1)
        worker = threading.Thread(target=generate)
        worker.start()
        worker.join(rng.uniform(*after_s))  # queued, in prefill or decoding by then
        requests.post(url + "/abort_request", json={"rid": rid}, timeout=60)
        tally.add(aborts_sent=1)
        worker.join(timeout_s)
        response = result.get("response")
        if response is None:
            tally.note("errors", {"client": "abort", "error": result.get("error")})
            continue
        reason = (response.json().get("meta_info", {}).get("finish_reason") or {}) if response.ok else {}
        if reason.get("type") == "abort":
            tally.add(aborted_by_request=1)
        elif response.ok:
            tally.add(finished_before_abort=1)
        else:  # SGLang answers an aborted non-streaming request with an error status and its reason
            tally.add(aborted_by_request=1)


def bench_rounds(server: Server, model_dir: str, work: Path, deadline: float, seed: int, rounds: list,
                 prompts: int, concurrency: int) -> None:
    """bench_serving rounds of ``prompts`` at ``concurrency`` until the deadline, alternating
    shared-prefix and random-ids prompts; the round still running at the deadline is stopped (its
    open requests are aborted by the server)."""
    groups = max(2, prompts // 16)  # shared prefixes: 2 of 2 prompts on CPU, 16 prompts each in larger rounds
    datasets = [
        ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
         "--gsp-prompts-per-group", str(prompts // groups),
         "--gsp-system-prompt-len", "384", "--gsp-question-len", "96", "--gsp-output-len", "48"],
        ["--dataset-name", "random-ids", "--random-input-len", "512", "--random-output-len", "192",
         "--random-range-ratio", "0.2"],
    ]
    n = 0
    while time.time() < deadline:
        out = work / f"bench_{n}.jsonl"
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", server.url,
               "--tokenizer", model_dir, *datasets[n % 2], "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency), "--warmup-requests", "0", "--seed", str(seed + n),
               "--output-file", str(out), "--disable-tqdm"]
        with open(work / f"bench_{n}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(work)})
            while proc.poll() is None and time.time() < deadline:
                time.sleep(1)
            stopped = proc.poll() is None
            if stopped:
                proc.terminate()
            proc.wait()
        summary = json.loads(out.read_text().strip().splitlines()[-1]) if out.exists() and not stopped else {}
        rounds.append({"dataset": datasets[n % 2][1], "rc": proc.returncode, "stopped_at_deadline": stopped,
                       **{k: summary.get(k) for k in ("completed", "total_input_tokens", "total_output_tokens",
                                                      "duration")}})
        n += 1


def check_still_serving(url: str, prompts: Prompts, timeout_s: float) -> dict:
    text, code = prompts.make()
    try:
        r = requests.post(url + "/generate", json={
            "text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}, timeout=timeout_s)
    except requests.RequestException as e:  # a hung server fails the check, the report is still written
        return {"status": None, "code": code, "answer": repr(e)[:300]}
    return {"status": r.status_code, "code": code, "answer": r.json().get("text") if r.ok else r.text[:300]}


def hardware(device: str) -> str:
    """The machine, for the report: on CUDA the GPU (from nvidia-smi: no CUDA context in this
    process) and whether SGLang's sglang-kernel is the device harness's torch stand-in."""
    host = f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}"
    if device != "cuda":
        return host
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        gpu = "unknown GPU"
    spec = importlib.util.find_spec("sgl_kernel")  # the servers this process starts import the same one
    standin = spec is not None and Path(spec.origin).is_relative_to(ROOT / "scripts" / "device" / "standin")
    harness = ("; device harness: norm/activation in its torch stand-in for sglang-kernel "
               "(scripts/device/standin), sampling in torch" if standin else "")
    return f"{gpu}; host {host}{harness}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default=e2e_device(),
                    help="traffic and waits sized for the machine (default: the server's device, "
                         "MINIMA_E2E_DEVICE or cpu); every flag left out below takes its value")
    ap.add_argument("--duration-s", type=float, help="seconds of load")
    ap.add_argument("--wall-budget-s", type=float,
                    help="end the load early enough that the report is written this many seconds after the "
                         "launch, the server's start included (the drain and idle bounds and 10 s kept after it)")
    ap.add_argument("--max-total-tokens", type=int, help="the whole KV pool, logical tokens")
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--nonce-clients", type=int, help="even-numbered ones stream and decode long")
    ap.add_argument("--disconnect-clients", type=int)
    ap.add_argument("--abort-clients", type=int)
    ap.add_argument("--abort-after-s", type=float, nargs=2, metavar=("MIN", "MAX"),
                    help="an abort client cancels its request this long after sending it (uniform)")
    ap.add_argument("--bench-prompts", type=int, help="prompts per bench_serving round")
    ap.add_argument("--bench-concurrency", type=int, help="bench_serving's --max-concurrency")
    ap.add_argument("--server-args", default=" ".join(DEFAULT_SERVER_ARGS),
                    help="further server flags, one string (default: the pilot's tuning)")
    ap.add_argument("--forced-retract-interval", type=int,
                    help="SGLang's SGLANG_TEST_RETRACT: retract one running request every N forward steps "
                         "(0: off). The pilots never ran out of decode pages on their own (see the results)")
    ap.add_argument("--replay-misses", type=int, default=16,
                    help="nonce answers that missed their code, sent again alone after the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "serving_soak")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "reliability" / "serving_soak.json")
    args = ap.parse_args(argv)
    for name, value in PROFILES[args.profile].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def load_seconds(args: argparse.Namespace, elapsed_s: float) -> float:
    """The load's length, ``elapsed_s`` after the launch (the server up): under --wall-budget-s what
    is left once the drain, the idle wait and the report have their bounds."""
    if not args.wall_budget_s:
        return args.duration_s
    left = args.wall_budget_s - elapsed_s - args.drain_timeout_s - args.idle_timeout_s - REPORT_S
    return max(0.0, min(args.duration_s, left))


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    server_args = ["--enable-metrics", "--max-total-tokens", str(args.max_total_tokens),
                   "--max-running-requests", str(args.max_running_requests), *shlex.split(args.server_args)]
    t_start = time.time()
    env = {"SGLANG_DEBUG_MEMORY_POOL": "1"}
    if args.forced_retract_interval:
        env |= {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(args.forced_retract_interval)}
    server = launch(server_args, args.work / "server.log", env=env)
    try:
        load_s = load_seconds(args, time.time() - t_start)  # the start took what it took: the load gets the rest
        result = soak(server, args, [*server_args, *device_args(server_args)], load_s)
        result |= {"server_env": env, "wall_s": round(time.time() - t_start, 1)}
        write(result, args.out)  # before the stop: a slow shutdown cannot cost the report
    finally:
        server.stop()
    print(json.dumps({k: result[k] for k in ("counters", "checks", "passed")}, indent=1))
    sys.exit(0 if result["passed"] else 1)


def soak(server: Server, args, server_args: list[str], load_s: float) -> dict:
    url = server.url
    info = requests.get(url + "/server_info", timeout=60).json()
    before = metric_totals(url)
    prompts, tally, rounds = Prompts(args.seed), Tally(), []
    rng = random.Random(args.seed)
    deadline = time.time() + load_s
    wait = args.request_timeout_s
    threads = [threading.Thread(name="bench_serving", daemon=True, target=bench_rounds,
                                args=(server, info["model_path"], args.work, deadline, args.seed, rounds,
                                      args.bench_prompts, args.bench_concurrency))]
    threads += [threading.Thread(name=f"nonce-{i}", daemon=True, target=nonce_client,
                                 args=(url, prompts, tally, deadline, i % 2 == 0, wait))
                for i in range(args.nonce_clients)]
    threads += [threading.Thread(name=f"disconnect-{i}", daemon=True, target=disconnect_client,
                                 args=(url, prompts, tally, deadline, random.Random(rng.random()), wait))
                for i in range(args.disconnect_clients)]
    threads += [threading.Thread(name=f"abort-{i}", daemon=True, target=abort_client,
                                 args=(url, prompts, tally, deadline, random.Random(rng.random()), f"a{i}",
                                       args.abort_after_s, wait))
                for i in range(args.abort_clients)]
    for t in threads:
        t.start()
    worst_mismatch = 0  # reference-count mismatches seen between steps while loaded
    samples, unanswered = 0, []  # a sample the server does not answer in time fails a check, not the run
    with tqdm(total=int(load_s), desc="soak", unit="s") as bar:
        while time.time() < deadline:
            time.sleep(min(10.0, max(0.0, deadline - time.time())))
            samples += 1
            try:
                minima = minima_section(url, args.sample_timeout_s)
                moved = {k: int(v - before[k]) for k, v in metric_totals(url, args.sample_timeout_s).items()}
            except requests.RequestException as e:
                unanswered.append({"at_s": round(time.time() - deadline + load_s), "error": repr(e)[:200]})
                continue
            worst_mismatch = max(worst_mismatch, minima["references"]["mismatched_pages"])
            bar.update(min(int(load_s), int(time.time() - (deadline - load_s))) - bar.n)
            bar.set_postfix(req=tally.requests, conv=moved["conversions"], prom=moved["promotions"],
                            evict=moved["evicted_tokens"], retr=moved["retractions"], abort=moved["aborts"])
    drain_start = time.time()
    for t in threads:  # each finishes the request it has open
        t.join(max(0.0, drain_start + args.drain_timeout_s - time.time()))
    drain_s = time.time() - drain_start

    stuck = [t.name for t in threads if t.is_alive()]
    checks: dict[str, dict] = {
        "samples_answered": {"passed": not unanswered, "samples": samples, "unanswered": unanswered[:5]},
        "clients_drained": {"passed": not stuck, "seconds": round(drain_s, 1), "still_waiting": stuck},
    }
    try:
        idle = assert_idle(url, timeout_s=args.idle_timeout_s)
        checks["idle"] = {"passed": True, "rows": {k: v["pages"] for k, v in idle["memory"]["rows"].items()}}
    except AssertionError as e:
        idle = minima_section(url)
        checks["idle"] = {"passed": False, "error": str(e)[:500]}
    after = metric_totals(url)
    counters = {k: after[k] - before[k] for k in COUNTERS}
    for path in MUST_MOVE:
        checks[f"{path}>0"] = {"passed": counters[path] > 0, "value": counters[path]}
    mismatched = idle["references"]["mismatched_pages"]
    checks["references_equal_owners"] = {"passed": mismatched == 0 and worst_mismatch == 0,
                                         "at_idle": mismatched, "worst_while_loaded": worst_mismatch}
    stats = idle["stats"]
    failed = stats["retier"]["failed_pages"] + stats["promote"]["failed_pages"]
    checks["no_failed_conversion"] = {"passed": failed == 0, "value": failed}
    replay = replay_misses(url, tally, args.replay_misses, args.sample_timeout_s)
    checks["no_answer_from_another_request"] = nonce_check(tally.nonce_checked, tally.nonce_mismatches,
                                                           len(prompts.codes), replay)
    checks["no_client_error"] = {"passed": not tally.errors, "value": len(tally.errors)}
    serving = check_still_serving(url, prompts, wait)
    checks["still_serving"] = {"passed": serving["status"] == 200 and serving["code"] in serving["answer"], **serving}
    log = server.log()
    checks["no_traceback_in_server_log"] = {"passed": "Traceback" not in log, "value": log.count("Traceback")}
    bench_done = [r for r in rounds if r.get("completed") is not None]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(deadline - load_s)),
        "device": info["device"],
        "machine": hardware(info["device"]),
        "command": " ".join(sys.argv),
        "profile": args.profile,
        "server_args": server_args,
        "server": {k: info.get(k) for k in ("attention_backend", "cuda_graph_backend_decode", "disable_cuda_graph",
                                            "dtype", "disable_overlap_schedule", "chunked_prefill_size")},
        "duration_s": round(load_s, 1),
        "duration_asked_s": args.duration_s,
        "drain_s": round(drain_s, 1),
        "startup_s": round(server.startup_s, 1),
        "clients": {"nonce": args.nonce_clients, "disconnect": args.disconnect_clients, "abort": args.abort_clients,
                    "abort_after_s": args.abort_after_s, "bench_serving_prompts": args.bench_prompts,
                    "bench_serving_concurrency": args.bench_concurrency, "request_timeout_s": wait},
        "soak_clients": tally.as_dict(),
        "bench_serving": {
            "rounds": len(rounds), "stopped_at_deadline": sum(r["stopped_at_deadline"] for r in rounds),
            "failed_rounds": sum(r["rc"] != 0 and not r["stopped_at_deadline"] for r in rounds),
            "completed": sum(r["completed"] for r in bench_done),
            "input_tokens": sum(r["total_input_tokens"] for r in bench_done),
            "output_tokens": sum(r["total_output_tokens"] for r in bench_done),
            "per_round": rounds,
        },
        "counters": counters,
        "minima_stats": stats,
        "pool": idle["pool"],
        "miss_replays": replay["replays"],
        "checks": checks,
        "passed": all(c["passed"] for c in checks.values()),
    }


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    c, b, s = result["soak_clients"], result["bench_serving"], result["minima_stats"]
    who = result["clients"]
    requests_total = c["requests"] + b["completed"]
    server = ", ".join(f"{name} {value}" for name, value in result["server"].items() if value is not None)
    lines = [
        f"# Serving soak ({result['device'].upper()})", "",
        f"- {result['date']}; {result['machine']}; {result['profile']} profile; {result['duration_s']:.0f} s of load, "
        f"{result['drain_s']} s to drain, {result['wall_s']} s from the launch to this report "
        f"(the server started in {result['startup_s']} s).",
        f"- `{result['command']}`",
        f"- server: `python -m sglang_minima.launch_server {' '.join(result['server_args'])}` with "
        f"`{' '.join(f'{k}={v}' for k, v in result['server_env'].items())}` (the default model, "
        f"SmolLM2-135M-Instruct; launcher defaults otherwise: {server}).",
        f"- **{'PASSED' if result['passed'] else 'FAILED'}**", "",
        "## Traffic", "",
        "| source | requests | completed | prompt tokens | output tokens |", "|---|---|---|---|---|",
        f"| bench_serving ({b['rounds']} rounds of {who['bench_serving_prompts']}, {who['bench_serving_concurrency']} "
        f"at once, shared-prefix / random-ids; "
        f"{b['stopped_at_deadline']} stopped at the deadline, not counted) | "
        f"{b['completed']} | {b['completed']} | {b['input_tokens']} | {b['output_tokens']} |",
        f"| soak clients ({who['nonce']} nonce, {who['disconnect']} disconnecting, {who['abort']} aborting) | "
        f"{c['requests']} | {c['completed']} | "
        f"{c['prompt_tokens']} | {c['completion_tokens']} |",
        f"| total | {requests_total} | | | |", "",
        f"Soak clients: {c['nonce_checked']} nonce answers checked, {len(c['nonce_mismatches'])} missed their own "
        f"code ({sum(bool(m['foreign_codes']) for m in c['nonce_mismatches'])} with another request's); "
        f"{c['disconnects']} streams closed mid-way; {c['aborts_sent']} `/abort_request` calls "
        f"({c['aborted_by_request']} aborted, {c['finished_before_abort']} had finished first); "
        f"{len(c['errors'])} client errors; bench_serving rounds failed: {b['failed_rounds']}.", "",
        "## Paths taken (counter increase over the soak)", "",
        "| path | counter | increase |", "|---|---|---|",
        *[f"| {k} | `{COUNTERS[k][0]}{{{COUNTERS[k][1]}}}` | {v:g} |" for k, v in result["counters"].items()],
        "", f"Minima stats at the end: {s['retier']['batches']} conversion batches / {s['retier']['pages']} pages "
        f"({s['pressure_retier_pages']} under allocation pressure: "
        f"{', '.join(f'{n} {tier}' for tier, n in s.get('pressure_retier_tiers', {}).items())}), "
        f"{s['promote']['batches']} promotion batches / "
        f"{s['promote']['pages']} pages, {s['route_tq3_pages']} TQ3 and {s['route_hot_pages']} FP8 page reads, "
        f"{s['prefix_hit_tq3_pages']} TQ3 / {s['prefix_hit_hot_pages']} FP8 prefix-hit pages, "
        f"peak scratch {s['peak_scratch_bytes']} bytes, {s['fallbacks']} fallbacks.", "",
        "## Checks after the load", "", "| check | passed | observed |", "|---|---|---|",
        *[f"| {k} | {'yes' if v['passed'] else '**no**'} | "
          f"{json.dumps({x: y for x, y in v.items() if x != 'passed'})[:300]} |" for k, v in result["checks"].items()],
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
