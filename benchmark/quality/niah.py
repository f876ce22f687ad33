"""RULER NIAH over HTTP: Minima's KV arms against SGLang's own BF16 and FP8 KV, on the same examples.

For each run (an arm at one ``--chunked-prefill-size``) the script starts the server (or uses a URL
given with ``--url ARM=URL``) and sends the examples greedily over ``/generate`` in groups of
``--concurrency`` examples of one task and length, all of a group at once. Each request carries its
example's key as SGLang's ``extra_key``, which namespaces the radix tree: an example never reads
another example's cached pages (RULER's haystacks share long prefixes), so its answer does not depend
on what ran before it or beside it, and the radix cache is flushed before each group. Minima's route
counters are read from ``/server_info`` (``internal_states[0].minima.stats``) around each group: the
page mix the group actually attended (with ``--concurrency 1``, each example's). A Minima cell whose
examples never read a TQ3 page is marked: it says nothing about TQ3.

Resumable: answers are appended to ``OUT/answers/<arm>@<chunk>.jsonl`` group by group, groups in
index-major order (a run stopped early, e.g. by ``--time-budget-s``, has covered every task and length
evenly); a rerun skips the examples already answered (a run with nothing left to do is not even
launched). Committed answers are gzipped (``<arm>@<chunk>.jsonl.gz``, a tenth of the bytes: the
device harness carries the working tree): they are read as they are, and a rerun that resumes one
unpacks it to the ``.jsonl`` it appends to (the ``.jsonl``, a superset, wins where both exist).
Several processes may answer different arms into one OUT side by side (``--port``); then
``--report-only`` over all of them. Then the
report: RULER's string_match_all per task and length, paired differences against the reference
arm (``--reference``, FP8 by default) with bootstrap 95% intervals over examples, macro scores,
and the page mix; written as ``OUT/niah.json``, ``OUT/niah.md`` and ``OUT/niah.png``.

Arms (``--arms``):
  bf16               SGLang's own path, KV in the model dtype (``--dtype``); on CUDA its flashinfer backend.
  fp8                SGLang's own path with ``--kv-cache-dtype fp8_e4m3`` (not on CPU: SGLang's CPU
                     FP8 KV needs Intel AMX; there minima-nostale is the FP8 arm and the reference).
  minima-nostale     Minima with ``--minima-disable-stale``: every page FP8 e4m3.
  minima-default     Minima at the launcher's defaults, whatever they are at the commit that runs it.
  minima-lmv         minima-default with ``--minima-value-code lloyd-max`` (Stale values coded as 3-bit keys
                     are, one fp16 scale: 16 bits per value element per token fewer); the torch path serves
                     it, so on CUDA pair it with minima-native.
  minima-v4          minima-default with ``--minima-value-bits 4`` (Stale values on a 16-level grid: 1 bit more
                     per value element); the torch path serves it, so on CUDA pair it with minima-native.
  <arm>-eqbytes      any arm that converts pages, in the FP8 arm's KV bytes (``--max-total-tokens`` scaled by
                     FP8's bytes per token over the arm's), where every other arm gets the same logical tokens.
  minima-native      minima-default on the torch path (``--attention-backend minima_native``).
  minima             Minima (Recent 4 pages, 1 sink page) with 3-bit Stale keys (``--minima-key-bits 3``, the
                     launcher's default until 2026-12-03: every arm below but minima-k4 pins it, so that
                     each name keeps meaning what its committed answers ran).
  minima-k4          The defaults of 2026-12-03 to 12-05: 4-bit Stale keys, one sink page, a prompt's pages
                     converted while it is prefilled. Every Minima arm but minima-default pins the last
                     two (``--minima-sink-pages 1 --minima-no-defer-prefill-conversion``) unless it names them.
  minima-aggressive  minima with one Recent page, one sink page, no Anchor budget.
  minima-default-aggressive  the defaults with one Recent page, one sink page, no Anchor budget (#17's aggressive
                     arm on today's 4-bit keys and deferred conversion).
  minima-default-recentN  the defaults with N Recent pages (4, 8, 16, 32); minima-default-sink4 with four sink
                     pages: #17's frontier on today's defaults (frontier.py puts the runs on one figure).
                     N = 4 pins today's default: beside minima-default, a replicate that measures a
                     session's own noise floor.
  minima-defer       minima plus ``--minima-defer-prefill-conversion``.
  minima-recentN     minima with N Recent pages (8, 16, 32: 512 to 2,048 tokens at page size 64).
  minima-sink4       minima with four sink pages.
  minima-anchor8     minima with an Anchor budget of eight pages per request (filled by age and structure).
  minima-k4-recentN  minima-k4 with N Recent pages (8, 16).
  minima-k4-defer    minima-k4 plus ``--minima-defer-prefill-conversion``.
  minima-k4-sink2    minima-k4 with two sink pages.
  minima-k4-defer-sink2  both: the launcher's defaults since 2026-12-05.
  minima-native-nostale  minima-nostale on the torch path (``--attention-backend minima_native``).

The frontier: every run's macro score against the KV bytes per token it attended (per layer, from
the route counters' hot and TQ3 token reads and the codec's page accounting), in the report and in
OUT/niah_frontier.png.

Usage:
  python benchmark/quality/niah.py --out docs/results/quality_cpu --smoke
  python benchmark/quality/niah.py --device cuda --lengths 1024,2048,4096,8192 --n 64 --concurrency 32 \\
      --chunked-prefill-sizes default,256 --out docs/results/quality_h200
  python benchmark/quality/niah.py --report-only --out docs/results/quality_cpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import requests
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "test"))

from minima_test_support.server import e2e_device  # noqa: E402
from ruler_data import TASKS, Example, generate, string_match_all  # noqa: E402

ROUTE_KEYS = ("route_hot_pages", "route_tq3_pages", "route_hot_tokens", "route_tq3_tokens")
SMOKE_TASKS = tuple(TASKS)
DEFAULT_PORT = 31717
GPU_ARMS = "bf16,fp8,minima-nostale,minima-k4,minima,minima-aggressive"
CPU_ARMS = "bf16,minima-nostale,minima-k4,minima,minima-aggressive"


@dataclass(frozen=True)
class ArmSpec:
    name: str
    module: str
    flags: tuple[str, ...]
    equal_bytes: bool = False
    """Size the pool at the FP8 arm's KV bytes (more logical tokens: what a user gets in the same memory)
    instead of every arm's same logical tokens, which gives Minima's hot pages a smaller pool."""

    @property
    def is_minima(self) -> bool:
        return self.module == "sglang_minima.launch_server"

    def config(self, extra_flags: Sequence[str] = ()):
        """The MinimaConfig this arm's server runs, ``extra_flags`` (``--server-args``) after its own as the
        launcher reads them (the last value of a flag wins)."""
        from sglang_minima.config import parse_minima_argv, split_minima_argv

        return parse_minima_argv(split_minima_argv([*self.flags, *extra_flags])[0])

    def tq3_layout(self, heads: int, page_size: int, dim: int, extra_flags: Sequence[str] = ()):
        """The TQ3 page layout this arm's server runs (code widths, page-centered keys, value code)."""
        from sglang_minima.mem_cache.tier_store import config_layout

        return config_layout(self.config(extra_flags), heads, page_size, dim)

    @property
    def converts(self) -> bool:
        """Whether this arm is meant to read TQ3 pages (so a run that read none is no evidence)."""
        return self.is_minima and "--minima-disable-stale" not in self.flags


K3 = ("--minima-key-bits", "3")
WINDOW4 = ("--minima-anchor-pages", "4", "--minima-anchor-window", "64")


def _pinned(arm: ArmSpec) -> ArmSpec:
    """The arm with the tier policy every Minima arm but minima-default ran before the defaults moved
    (2026-12-05: two sink pages, the deferred conversion) where it names neither: so each arm keeps
    meaning what its committed answers ran."""
    if not arm.is_minima:
        return arm
    pin = () if "--minima-sink-pages" in arm.flags else ("--minima-sink-pages", "1")
    if not {"--minima-defer-prefill-conversion", "--minima-no-defer-prefill-conversion"} & set(arm.flags):
        pin += ("--minima-no-defer-prefill-conversion",)
    return replace(arm, flags=(*pin, *arm.flags))


ARMS: dict[str, ArmSpec] = {
    a.name: a
    for a in (
        ArmSpec("bf16", "sglang.launch_server", ()),
        ArmSpec("fp8", "sglang.launch_server", ("--kv-cache-dtype", "fp8_e4m3")),
        ArmSpec("minima-default", "sglang_minima.launch_server", ()),
        # the defaults with lloyd-max value codes (served by the torch path: minima_native on CUDA too),
        # and the defaults on that path, its pair on CUDA
        ArmSpec("minima-lmv", "sglang_minima.launch_server", ("--minima-value-code", "lloyd-max")),
        ArmSpec("minima-v4", "sglang_minima.launch_server", ("--minima-value-bits", "4")),
        ArmSpec("minima-native", "sglang_minima.launch_server", ("--attention-backend", "minima_native")),
        # the defaults with prefill admission that never converts a live request's sink or Recent pages
        ArmSpec("minima-strict", "sglang_minima.launch_server", ("--minima-strict-hot-admission",)),
        # the defaults with a smaller FP8 share of the pool (a default candidate: at 25% a Llama-class
        # token costs 1/1.68 of FP8's, short of #16 (c)'s 1.7x): the smaller hot pool converts more
        # pages under pressure, which is what these arms measure
        *(ArmSpec(f"minima-fp8share{n}", "sglang_minima.launch_server", ("--minima-fp8-page-fraction", f"0.{n}"))
          for n in (15, 20)),
        # 20% with strict admission: a prompt waits for hot pages instead of converting sink or Recent ones
        ArmSpec("minima-fp8share20-strict", "sglang_minima.launch_server",
                ("--minima-fp8-page-fraction", "0.2", "--minima-strict-hot-admission")),
        # the defaults with page-centered keys (minima-k4-center below carries the pinned older policy)
        ArmSpec("minima-default-center", "sglang_minima.launch_server", ("--minima-key-center",)),
        # #17's aggressive arm on the defaults (minima-aggressive below pins 3-bit keys and one sink page):
        # one Recent page, one sink page, no Anchor budget
        ArmSpec("minima-default-aggressive", "sglang_minima.launch_server",
                ("--minima-recent-pages", "1", "--minima-sink-pages", "1", "--minima-anchor-pages", "0")),
        # #17's frontier on the defaults: Recent windows of 256 (the default, pinned) to 2,048 tokens, four
        # sink pages (the defaults: two); the minima-recent<n> and minima-sink4 below pin 3-bit keys
        *(ArmSpec(f"minima-default-recent{n}", "sglang_minima.launch_server", ("--minima-recent-pages", str(n)))
          for n in (4, 8, 16, 32)),
        ArmSpec("minima-default-sink4", "sglang_minima.launch_server", ("--minima-sink-pages", "4")),
    )
} | {
    a.name: _pinned(a)
    for a in (
        ArmSpec("minima-nostale", "sglang_minima.launch_server", ("--minima-disable-stale",)),
        ArmSpec("minima", "sglang_minima.launch_server", K3),
        ArmSpec("minima-k4", "sglang_minima.launch_server", ()),
        ArmSpec("minima-aggressive", "sglang_minima.launch_server",
                (*K3, "--minima-recent-pages", "1", "--minima-sink-pages", "1", "--minima-anchor-pages", "0")),
        ArmSpec("minima-defer", "sglang_minima.launch_server", (*K3, "--minima-defer-prefill-conversion")),
        *(ArmSpec(f"minima-recent{n}", "sglang_minima.launch_server", (*K3, "--minima-recent-pages", str(n)))
          for n in (8, 16, 32)),
        ArmSpec("minima-sink4", "sglang_minima.launch_server", (*K3, "--minima-sink-pages", "4")),
        ArmSpec("minima-anchor8", "sglang_minima.launch_server", (*K3, "--minima-anchor-pages", "8")),
        # the two levers together: 4-bit keys (the defaults) and a longer Recent window
        *(ArmSpec(f"minima-k4-recent{n}", "sglang_minima.launch_server", ("--minima-recent-pages", str(n)))
          for n in (8, 16)),
        ArmSpec("minima-k4-defer", "sglang_minima.launch_server", ("--minima-defer-prefill-conversion",)),
        # the page after the sink kept hot too: needles there lose most (needle_tiers.py)
        ArmSpec("minima-k4-sink2", "sglang_minima.launch_server", ("--minima-sink-pages", "2")),
        # the defaults since 2026-12-05
        ArmSpec("minima-k4-defer-sink2", "sglang_minima.launch_server",
                ("--minima-sink-pages", "2", "--minima-defer-prefill-conversion")),
        # page-centered keys on the pinned policy (the kernels serve them since 2026-12-06)
        ArmSpec("minima-k4-center", "sglang_minima.launch_server", ("--minima-key-center",)),
        # observation-window Anchors: the 4 pages a prompt's last 64 tokens attend most stay hot (with
        # the deferred conversion, chosen among all of a chunked prompt's pages)
        ArmSpec("minima-k4-window4", "sglang_minima.launch_server", WINDOW4),
        ArmSpec("minima-k4-defer-window4", "sglang_minima.launch_server",
                (*WINDOW4, "--minima-defer-prefill-conversion")),
        # the torch path over the same FP8 pages: tells Minima's kernels' numerics from its page handling
        ArmSpec("minima-native-nostale", "sglang_minima.launch_server",
                ("--attention-backend", "minima_native", "--minima-disable-stale")),
    )
}
# every converting arm in the FP8 arm's KV bytes (<arm>-eqbytes): e.g. the defaults' hot quarter holds 1.6x the
# pages it holds at FP8's logical tokens, as in a user's same memory
ARMS |= {f"{a.name}-eqbytes": replace(a, name=f"{a.name}-eqbytes", equal_bytes=True) for a in ARMS.values() if a.converts}


@dataclass(frozen=True)
class Run:
    arm: str
    chunk: str
    """``--chunked-prefill-size`` value, or 'default' (the flag not given)."""

    @property
    def label(self) -> str:
        return f"{self.arm}@{self.chunk}"


# ---------------------------------------------------------------------------------- serving


def dtype_bytes(dtype: str) -> int:
    """Bytes of an element of ``--dtype`` (the model dtype SGLang keeps BF16 KV in)."""
    return {"float32": 4, "float": 4}.get(dtype, 2)


def pool_tokens(spec: ArmSpec, args: argparse.Namespace) -> int:
    """The arm's ``--max-total-tokens``: ``--max-total-tokens`` itself, or for an ``equal_bytes`` arm the
    tokens that the FP8 arm's pool of that many tokens holds at this arm's bytes per token, less what
    the arm's server keeps in its budget for the prefill's scratch (page-aligned, rounded down: at most
    FP8's bytes)."""
    if not spec.equal_bytes:
        return args.max_total_tokens
    from sglang_minima.codec.accounting import fp8_bytes
    from sglang_minima.launch_server import prefill_scratch_reserve_for
    from sglang_minima.mem_cache.tier_store import minima_cell_size

    heads, dim = args.geometry
    extra = shlex.split(getattr(args, "server_args", ""))
    cell = minima_cell_size(spec.config(extra), num_kv_heads=heads, head_dim=dim, num_layers=args.num_layers,
                            page_size=args.page_size, model_dtype_bytes=dtype_bytes(args.dtype))
    reserve = prefill_scratch_reserve_for([*spec.flags, *extra], args.device, num_kv_heads=heads, head_dim=dim,
                                          page_size=args.page_size)
    budget = int(args.max_total_tokens * fp8_bytes(heads, args.page_size, dim).per_token) * args.num_layers - reserve
    return budget // cell // args.page_size * args.page_size


def server_flags(spec: ArmSpec, args: argparse.Namespace, chunk: str) -> list[str]:
    flags = ["--model-path", str(args.model_path), "--dtype", args.dtype, "--page-size", str(args.page_size),
             "--max-total-tokens", str(pool_tokens(spec, args)),
             "--max-running-requests", str(max(4, getattr(args, "concurrency", 1))), "--random-seed", "0"]
    if args.device == "cpu":
        flags += ["--device", "cpu", "--cuda-graph-backend-decode", "disabled",
                  "--cuda-graph-backend-prefill", "disabled"]
        if not spec.is_minima:
            flags += ["--attention-backend", "torch_native"]
    elif not spec.is_minima:
        flags += ["--attention-backend", "flashinfer"]  # the baselines are SGLang's flashinfer, not its fa3 default on Hopper
    if chunk != "default":
        flags += ["--chunked-prefill-size", chunk]
    return flags + list(spec.flags) + shlex.split(getattr(args, "server_args", ""))


def minima_stats(url: str) -> dict[str, int] | None:
    info = requests.get(url + "/server_info", timeout=60).json()
    minima = info.get("internal_states", [{}])[0].get("minima")
    if not minima or not minima.get("active"):
        return None
    stats = minima["stats"]
    # the pages converted for want of a free hot page, by what they were (a sink or Recent page
    # converted under pressure is the policy's FP8 page given up: the pool, not the policy, decided)
    tiers = {f"pressure_{tier}_pages": int(n) for tier, n in stats.get("pressure_retier_tiers", {}).items()}
    # conversions that found the TQ3 pool full: Stale pages read as FP8 (servers since 2026-12-06)
    no_room = {"retier_no_room_pages": int(stats["retier"]["no_room_pages"])} if "no_room_pages" in stats["retier"] else {}
    return {k: int(stats[k]) for k in ROUTE_KEYS} | {"retier_pages": int(stats["retier"]["pages"]),
                                                    "pressure_retier_pages": int(stats["pressure_retier_pages"])} | tiers | no_room


def stats_delta(prev: dict[str, int] | None, cur: dict[str, int] | None) -> dict[str, int] | None:
    """What ``minima_stats`` counted between two reads (None: not a Minima server)."""
    return None if cur is None else {k: cur[k] - prev[k] for k in cur}


def group_routes(records: dict[str, dict]) -> dict[str, dict]:
    """Route-counter deltas once per group of ``records`` (by key; an example answered alone is its
    own group): every example of a group carries its group's delta."""
    return {r.get("group", k): r["routes"] for k, r in records.items() if r["routes"] is not None}


def launch_arm(run: Run, args: argparse.Namespace):
    """The server of ``run``'s arm and chunk size, its log at OUT/logs/<arm>@<chunk>.log."""
    from minima_test_support.server import launch

    spec = ARMS[run.arm]
    log = args.out / "logs" / f"{run.label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return launch(server_flags(spec, args, run.chunk), log, module=spec.module, port=args.port,
                  env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def groups_of(todo: list[Example], size: int) -> list[list[Example]]:
    """``todo`` in groups of at most ``size`` examples of one task and length, index-major: the first
    ``size`` indices of every cell, then the next ones (a run stopped early has covered every cell)."""
    cells: dict[tuple[str, int], list[Example]] = {}
    for ex in sorted(todo, key=lambda ex: ex.index):
        cells.setdefault((ex.task, ex.length), []).append(ex)
    groups = [(rank, cell, exs[i:i + size]) for cell, exs in cells.items()
              for rank, i in enumerate(range(0, len(exs), size))]
    return [g for _, _, g in sorted(groups, key=lambda g: (g[0], g[1][1], list(TASKS).index(g[1][0])))]


def generate_one(url: str, ex: Example, max_new_tokens: int) -> tuple[dict, float]:
    t0 = time.time()
    r = requests.post(url + "/generate", timeout=3600, json={
        "text": ex.prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
        "extra_key": ex.key,  # its own radix namespace: no example reads another's cached pages
    })
    r.raise_for_status()
    return r.json(), time.time() - t0


def unpack_answers(path: Path, lines: list[str]) -> None:
    """Committed answers' unpacked copy at ``path``, unless there is one: processes that split an arm's
    tasks (run_suite.sh's NIAH_SHARDS) resume from one gzip, and a second copy written over the first
    would drop what a shard has appended since. The copy is written aside and linked into place, so a
    shard beside this one sees no file or the whole of it, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in lines))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def answer_run(run: Run, examples: list[Example], args: argparse.Namespace, url: str | None) -> None:
    """Answer the examples of ``run`` not yet in its JSONL, appending each group as it comes."""
    path = answers_path(args.out, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = answer_lines(path)
    done = {json.loads(line)["key"] for line in lines}
    groups = groups_of([ex for ex in examples if ex.key not in done], args.concurrency)
    if not groups or time.time() > args.deadline:
        return
    if lines and not path.exists():  # resuming committed (gzipped) answers: append to their unpacked copy
        unpack_answers(path, lines)
    server = None
    if url is None:
        server = launch_arm(run, args)
        url = server.url
    try:
        with path.open("a") as f, ThreadPoolExecutor(args.concurrency) as pool, \
                tqdm(total=sum(map(len, groups)), desc=run.label, unit="ex") as bar:
            last = 0.0  # the previous group's seconds: a group not expected to end in the budget is not started
            for group in groups:
                if time.time() + last > args.deadline:
                    print(f"{run.label}: --time-budget-s reached, {bar.total - bar.n} examples left (resume later)")
                    break
                t0 = time.time()
                requests.post(url + "/flush_cache", timeout=60)
                prev = minima_stats(url)
                outs = list(pool.map(lambda ex: generate_one(url, ex, args.max_new_tokens), group))
                cur = minima_stats(url)
                routes = stats_delta(prev, cur)
                records = []
                for ex, (out, seconds) in zip(group, outs):
                    records.append(json.dumps({
                        "key": ex.key, "task": ex.task, "length": ex.length, "index": ex.index,
                        "answer": out["text"], "score": string_match_all(out["text"], ex.outputs),
                        "prompt_tokens": out["meta_info"]["prompt_tokens"],
                        "completion_tokens": out["meta_info"]["completion_tokens"],
                        "cached_tokens": out["meta_info"].get("cached_tokens"),  # 0: nothing shared
                        "seconds": round(seconds, 3),
                        # the route counters' deltas over the example's group (the group attended them)
                        "group": group[0].key, "group_size": len(group), "routes": routes,
                    }) + "\n")
                # one write a group: two runs side by side may append to one file (an arm's tasks split
                # over two processes), and a group written in buffer-sized pieces could interleave
                f.write("".join(records))
                f.flush()
                bar.update(len(group))
                last = time.time() - t0
    finally:
        if server is not None:
            server.stop()


# ---------------------------------------------------------------------------------- report


def bootstrap_ci(diffs: list[float], resamples: int, seed: int) -> tuple[float, float]:
    import numpy as np

    if not diffs:
        return float("nan"), float("nan")
    d = np.asarray(diffs, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    means = d[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def kv_geometry(model_path: Path) -> tuple[int, int]:
    """(KV heads, head dim) of the served model, from its config.json."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def set_model(args: argparse.Namespace, model_path: Path) -> None:
    """The served model's facts the server flags need (``pool_tokens``: an eqbytes arm's pool): its
    path, (KV heads, head dim) and layers. niah.py and perplexity.py set them the same way."""
    args.model_path = model_path
    args.geometry, args.num_layers = kv_geometry(model_path), kv_layers(model_path)


def kv_layers(model_path: Path) -> int:
    """Layers of the served model, from its config.json: every one keeps KV in the models niah.py
    serves (the default model); a hybrid model's linear-attention layers would not."""
    return json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]


def bytes_per_token(spec: ArmSpec, hot_tokens: int, tq3_tokens: int, geometry: tuple[int, int], page_size: int,
                    dtype: str, extra_flags: Sequence[str] = ()) -> float | None:
    """KV bytes per attended token and layer (K and V, every KV head): the model dtype's for BF16 KV,
    FP8's for the FP8 arms, and for Minima the mix of FP8 and TQ3 tokens its attention read."""
    from sglang_minima.codec.accounting import fp8_bytes, tq3_bytes

    heads, dim = geometry
    fp8 = fp8_bytes(heads, page_size, dim).per_token
    if not spec.is_minima:
        return fp8 if "fp8_e4m3" in spec.flags else fp8 * dtype_bytes(dtype)
    if hot_tokens + tq3_tokens == 0:
        return None if spec.converts else fp8
    tq3 = tq3_bytes(spec.tq3_layout(heads, page_size, dim, extra_flags)).per_token
    return (hot_tokens * fp8 + tq3_tokens * tq3) / (hot_tokens + tq3_tokens)


def attended_bytes(arm: str, groups: Sequence[dict], geometry: tuple[int, int], page_size: int, dtype: str,
                   server_args: str = "") -> tuple[float | None, int]:
    """(KV bytes per attended token and layer, tokens attended) of an arm's route counters, one record a
    group (``group_routes``): the report's per-run figure, and frontier.py's weight when it pools runs."""
    hot = sum(g["route_hot_tokens"] for g in groups)
    tq3 = sum(g["route_tq3_tokens"] for g in groups)
    return bytes_per_token(ARMS[arm], hot, tq3, geometry, page_size, dtype, shlex.split(server_args)), hot + tq3


def answers_path(out: Path, run: Run) -> Path:
    return out / "answers" / f"{run.label}.jsonl"


def answer_lines(path: Path) -> list[str]:
    """The lines of an answers JSONL, or of its gzipped copy where only that exists."""
    if path.exists():
        return path.read_text().splitlines()
    gz = path.with_name(path.name + ".gz")
    return gzip.decompress(gz.read_bytes()).decode().splitlines() if gz.exists() else []


def load_answers(out: Path, run: Run) -> dict[str, dict]:
    return {r["key"]: r for r in map(json.loads, answer_lines(answers_path(out, run)))}


def report(runs: list[Run], examples: list[Example], args: argparse.Namespace) -> dict:
    answers = {run.label: load_answers(args.out, run) for run in runs}
    cells = sorted({(ex.task, ex.length) for ex in examples}, key=lambda c: (c[1], list(TASKS).index(c[0])))
    keys = {c: [ex.key for ex in examples if (ex.task, ex.length) == c] for c in cells}
    result: dict = {"cells": [], "macro": {}, "macro_by_length": {}, "reference": args.reference}
    selected = {ex.key for ex in examples}
    for chunk in args.chunked_prefill_sizes:
        ref = answers.get(Run(args.reference, chunk).label, {})
        macro_diffs: dict[str, list[list[float]]] = {}
        by_length: dict[tuple[str, int], list[tuple[list[float], dict]]] = {}
        for task, length in cells:
            for arm in args.arms:
                got = answers[Run(arm, chunk).label]
                ks = [k for k in keys[(task, length)] if k in got]
                if not ks:
                    continue
                paired = [k for k in ks if k in ref]
                diffs = [got[k]["score"] - ref[k]["score"] for k in paired]
                groups = group_routes({k: got[k] for k in ks})
                tq3 = sum(r["route_tq3_pages"] for r in groups.values())
                hot = sum(r["route_hot_pages"] for r in groups.values())
                cell = {
                    "chunk": chunk, "task": task, "length": length, "arm": arm, "n": len(ks),
                    "score": sum(got[k]["score"] for k in ks) / len(ks),
                    "n_paired": len(paired),
                    "diff_vs_ref": sum(diffs) / len(diffs) if diffs else None,
                    "diff_ci95": bootstrap_ci(diffs, args.bootstrap, args.seed) if diffs else None,
                    "converts": ARMS[arm].converts,
                    "tq3_page_share": tq3 / (tq3 + hot) if tq3 + hot else None,
                    # examples answered in a group that read TQ3 pages (alone: that read them)
                    "examples_reading_tq3": sum(got[k]["routes"] is not None and got[k]["routes"]["route_tq3_pages"] > 0
                                                for k in ks),
                    "tq3_read": tq3 > 0,
                }
                result["cells"].append(cell)
                macro_diffs.setdefault(arm, []).append(diffs)
                by_length.setdefault((arm, length), []).append((diffs, cell))
        for arm, per_cell in macro_diffs.items():
            arm_cells = [c for c in result["cells"] if c["chunk"] == chunk and c["arm"] == arm]
            got = answers[Run(arm, chunk).label]
            run_groups = list(group_routes({k: got[k] for k in selected if k in got}).values())
            result["macro"][f"{arm}@{chunk}"] = {
                "score": sum(c["score"] for c in arm_cells) / len(arm_cells),
                "diff_vs_ref": macro_diff(per_cell),
                "diff_ci95": macro_ci(per_cell, args.bootstrap, args.seed),
                "cells": len(arm_cells),
                "cells_without_tq3": sum(c["converts"] and not c["tq3_read"] for c in arm_cells),
                "bytes_per_token": attended_bytes(arm, run_groups, args.geometry, args.page_size, args.dtype,
                                                  getattr(args, "server_args", ""))[0],
                **pressure_pages(run_groups),
            }
        # #17's target holds at every length: the macro over one length's tasks, same pairing and CI
        for (arm, length), per_task in by_length.items():
            result["macro_by_length"].setdefault(f"{arm}@{chunk}", {})[length] = {
                "diff_vs_ref": macro_diff([d for d, _ in per_task]),
                "diff_ci95": macro_ci([d for d, _ in per_task], args.bootstrap, args.seed),
                "cells": len(per_task),
                "cells_without_tq3": sum(c["converts"] and not c["tq3_read"] for _, c in per_task),
            }
    return result


def pressure_pages(groups) -> dict[str, int | None]:
    """Pages a run's server converted for want of a free hot page, how many of them were sinks or
    Recent pages (the policy's FP8 pages given up to memory), and the conversions it left undone for
    want of a free TQ3 page (Stale pages read as FP8): either way the pool, not the policy, decided what
    those examples read. None where its records predate the counters or it is not a Minima server."""
    groups = list(groups)
    total = [g["pressure_retier_pages"] for g in groups if "pressure_retier_pages" in g]
    kept = [g["pressure_anchor_pages"] + g["pressure_recent_pages"] for g in groups if "pressure_anchor_pages" in g]
    no_room = [g["retier_no_room_pages"] for g in groups if "retier_no_room_pages" in g]

    def every(counts: list[int]) -> int | None:  # a total only where every group was counted
        return sum(counts) if groups and len(counts) == len(groups) else None

    return {"pressure_pages": every(total), "pressure_kept_pages": every(kept), "no_room_pages": every(no_room)}


def macro_diff(per_cell: list[list[float]]) -> float | None:
    means = [sum(d) / len(d) for d in per_cell if d]
    return sum(means) / len(means) if means else None


def macro_ci(per_cell: list[list[float]], resamples: int, seed: int) -> tuple[float, float] | None:
    """Bootstrap of the macro mean of paired differences: resample examples within each cell."""
    import numpy as np

    cells = [np.asarray(d, dtype=np.float64) for d in per_cell if d]
    if not cells:
        return None
    rng = np.random.default_rng(seed)
    macro = np.zeros(resamples)
    for d in cells:
        macro += d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    macro /= len(cells)
    return float(np.percentile(macro, 2.5)), float(np.percentile(macro, 97.5))


def fmt_diff(d: float | None, ci) -> str:
    if d is None:
        return "-"
    return f"{d:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"


def markdown(result: dict, args: argparse.Namespace) -> str:
    if not result["cells"]:  # not an empty table: a run the budget stopped before any answer says so
        return ("No arm answered an example: every arm stopped before its first group (its log says why, "
                "e.g. `--time-budget-s reached`); nothing to score.\n")
    lines = []
    ref = result["reference"]
    for chunk in args.chunked_prefill_sizes:
        cells = [c for c in result["cells"] if c["chunk"] == chunk]
        if not cells:
            continue
        lines += [f"#### --chunked-prefill-size {chunk}", "",
                  f"Score (RULER string_match_all, %); Δ = paired difference vs `{ref}` [bootstrap 95% CI]; "
                  "TQ3 = share of attended pages that were TQ3 (examples that read any).", "",
                  "| task | length | arm | n | score | Δ vs " + ref + " | TQ3 pages |",
                  "|---|---|---|---|---|---|---|"]
        for c in cells:
            if c["converts"]:
                tq3 = (f"{100 * c['tq3_page_share']:.0f}% ({c['examples_reading_tq3']}/{c['n']})"
                       if c["tq3_read"] else "**none read: not evidence**")
            else:
                tq3 = "n/a"
            lines.append(f"| {c['task']} | {c['length']} | {c['arm']} | {c['n']} | {c['score']:.1f} | "
                         f"{fmt_diff(c['diff_vs_ref'], c['diff_ci95']) if c['arm'] != ref else '-'} | {tq3} |")
        lines.append("")
    lines += ["#### Macro (mean over task x length cells)", "",
              f"| run | cells | score | Δ vs {ref} [95% CI] | cells without a TQ3 read | KV bytes / attended token "
              "| pages converted under memory pressure (sinks or Recent) |",
              "|---|---|---|---|---|---|---|"]
    for label, m in result["macro"].items():
        bpt, pressure, kept = m.get("bytes_per_token"), m.get("pressure_pages"), m.get("pressure_kept_pages")
        lines.append(f"| {label} | {m['cells']} | {m['score']:.2f} | "
                     f"{fmt_diff(m['diff_vs_ref'], m['diff_ci95']) if not label.startswith(ref + '@') else '-'} | "
                     f"{m['cells_without_tq3']} | {'-' if bpt is None else f'{bpt:.0f}'} | "
                     f"{'-' if pressure is None else pressure}{'' if kept is None else f' ({kept})'} |")
    full = [f"- {label}: {m['no_room_pages']} conversions found the TQ3 pool full: Stale pages were read as FP8 "
            "(the pool's split, not the tier policy; `<arm>-eqbytes` sizes the pool in FP8's bytes)"
            for label, m in result["macro"].items() if m.get("no_room_pages")]
    lines += [""] + full if full else []
    lengths = sorted({n for by in result["macro_by_length"].values() for n in by})
    lines += ["", f"#### Macro Δ vs {ref} by length (mean over the tasks of one length; * = no TQ3 read in some cell)", "",
              "| run | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for label, by in result["macro_by_length"].items():
        if label.startswith(ref + "@"):
            continue
        row = []
        for n in lengths:
            m = by.get(n)
            row.append("-" if m is None else fmt_diff(m["diff_vs_ref"], m["diff_ci95"]) + ("*" if m["cells_without_tq3"] else ""))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "Δ is paired over the examples both runs answered; runs that cover different cells are "
              "compared by their Δ, not by their scores. KV bytes per attended token are per layer (K and V, "
              "every KV head), from the route counters' FP8 and TQ3 token reads."]
    return "\n".join(lines) + "\n"


def plot_frontier(result: dict, path: Path) -> None:
    """Δ macro vs the reference against KV bytes per attended token, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(k, m) for k, m in result["macro"].items()
           if m.get("bytes_per_token") is not None and m["diff_vs_ref"] is not None]
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    most = max(m["cells"] for _, m in pts)
    for label, m in pts:
        if m["cells"] < most:  # a run stopped early: its Δ is over fewer cells
            label = f"{label} ({m['cells']} cells)"
        lo, hi = m["diff_ci95"] or (m["diff_vs_ref"], m["diff_vs_ref"])
        ax.errorbar(m["bytes_per_token"], m["diff_vs_ref"], yerr=[[m["diff_vs_ref"] - lo], [hi - m["diff_vs_ref"]]],
                    fmt="o", color="tab:blue" if "minima" in label else "tab:gray", capsize=3)
        ax.annotate(label, (m["bytes_per_token"], m["diff_vs_ref"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(-1, color="tab:red", lw=0.6, ls="--")
    ax.set_xlabel("KV bytes per attended token, per layer")
    ax.set_ylabel(f"macro Δ vs {result['reference']} (pp, paired, 95% CI)")
    ax.set_title("RULER NIAH: the quality / bytes frontier (dashed: the -1 pp target)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(result: dict, path: Path) -> None:
    labels = list(result["macro"])
    if not labels:  # nothing answered: no figure (markdown says why)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [result["macro"][k]["score"] for k in labels]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    ax.bar(range(len(labels)), scores, color=["tab:blue" if "minima" in k else "tab:gray" for k in labels])
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right")
    ax.set_ylabel("RULER NIAH macro score (%)")
    ax.set_ylim(0, 100)
    for i, k in enumerate(labels):
        m = result["macro"][k]
        if m["diff_vs_ref"] is not None and not k.startswith(result["reference"] + "@"):
            ax.annotate(f"{m['diff_vs_ref']:+.1f}", (i, scores[i]), ha="center", va="bottom", fontsize=8)
    ax.set_title(f"RULER NIAH, Δ vs {result['reference']} annotated")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main


def _names_pool_size(arg: str) -> bool:
    """``arg`` is SGLang's ``--max-total-tokens``, or an abbreviation of it its parser would take
    (argparse's prefix matching: ``--max-total-token`` and ``--max-to`` name it too)."""
    name = arg.split("=", 1)[0]
    return len(name) >= len("--max-to") and "--max-total-tokens".startswith(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="1024,2048,4096,8192", help="RULER max sequence lengths")
    ap.add_argument("--n", type=int, default=64, help="examples per task and length")
    ap.add_argument("--limit", type=int, default=None,
                    help="answer only the first LIMIT of the --n examples per task and length (resume later)")
    ap.add_argument("--seed", type=int, default=42, help="RULER generator seed (also the bootstrap's)")
    ap.add_argument("--arms", default=None,
                    help=f"default: {GPU_ARMS} (on CPU without fp8)")
    ap.add_argument("--reference", default=None,
                    help="arm the paired differences are taken against: fp8, on CPU minima-nostale")
    ap.add_argument("--chunked-prefill-sizes", default="default,256",
                    help="'default' (flag not given) and/or token counts small enough that prompts read "
                         "their own Stale pages")
    ap.add_argument("--url", action="append", default=[], metavar="ARM=URL",
                    help="use a running server for ARM (then only one chunked-prefill size)")
    ap.add_argument("--device", default=e2e_device(), choices=("cpu", "cuda"),
                    help="default: MINIMA_E2E_DEVICE (cpu unless set; the device harness sets cuda)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool tokens of every arm (default: room for --concurrency prompts of the longest "
                         "length, so that no example waits for memory); a Minima arm's hot pages are a share of "
                         "them, which a wave of prompts can exhaust (then sink or Recent pages are converted "
                         "under pressure): <arm>-eqbytes arms get FP8's bytes of this many tokens instead")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="examples in flight at once (a group of one task and length)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no group after this many seconds (answers kept; rerun to resume)")
    ap.add_argument("--server-args", default="", help="more flags for every server, one string")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="RULER's niah budget is 128")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU size: every task at 1K, 4 examples each, 48 new tokens")
    ap.add_argument("--report-only", action="store_true", help="no serving: report what is in --out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.n, args.max_new_tokens = "1024", 4, 48
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        ap.error(f"--tasks: unknown {unknown} (RULER NIAH tasks: {list(TASKS)})")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.concurrency < 1:
        ap.error(f"--concurrency: {args.concurrency} (at least 1)")
    if any(_names_pool_size(a) for a in shlex.split(args.server_args)):
        # it would come last on every server's command line: the same pool for every arm, eqbytes' too
        ap.error("--server-args: --max-total-tokens sizes every arm's pool alike (an <arm>-eqbytes arm's too); "
                 "give it as niah.py's own --max-total-tokens")
    if args.max_total_tokens is None:
        args.max_total_tokens = max(32768, args.concurrency * (max(args.lengths) + 2 * args.page_size))
    args.deadline = time.time() + args.time_budget_s if args.time_budget_s else float("inf")
    on_cpu = args.device == "cpu"
    args.arms = [a for a in (args.arms or CPU_ARMS if on_cpu else args.arms or GPU_ARMS).split(",") if a]
    args.reference = args.reference or ("minima-nostale" if on_cpu else "fp8")
    if on_cpu and "fp8" in args.arms:
        ap.error("--arms: SGLang's CPU FP8 KV cache needs Intel AMX; on CPU the FP8 arm is minima-nostale "
                 "(Minima's hot pages are FP8 e4m3)")
    args.chunked_prefill_sizes = [c for c in args.chunked_prefill_sizes.split(",") if c]
    urls = dict(u.split("=", 1) for u in args.url)
    bad = [a for a in [*args.arms, *urls] if a not in ARMS]
    if bad:
        ap.error(f"--arms/--url: unknown arm(s) {bad} (known: {list(ARMS)})")
    if urls and len(args.chunked_prefill_sizes) != 1:
        ap.error("--url: a running server has one chunked-prefill size; give one --chunked-prefill-sizes value")
    if args.reference not in args.arms:
        ap.error(f"--reference {args.reference!r} must be one of --arms")
    args.urls = urls
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from sglang_minima.cpu_engine import setup_cpu_engine
    from sglang_minima.models import ensure_default_model

    if args.device == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        setup_cpu_engine()  # the plain SGLang arms inherit the CPU engine setup (pytest's conftest did it)
    set_model(args, ensure_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    examples = [ex for task in args.tasks for length in args.lengths
                for ex in generate(task, length, args.n, args.model_path, seed=args.seed)[: args.limit]]
    runs = [Run(arm, chunk) for chunk in args.chunked_prefill_sizes for arm in args.arms]
    if not args.report_only:
        for run in runs:
            answer_run(run, examples, args, args.urls.get(run.arm))
    result = report(runs, examples, args)
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, device {args.device}",
        # quoted as a shell would need it: niah_import.py re-runs this command to check a committed report
        "command": "python benchmark/quality/niah.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "arms": {a: asdict(ARMS[a]) for a in args.arms},
    }
    (args.out / "niah.json").write_text(json.dumps(result, indent=1))
    md = markdown(result, args)
    (args.out / "niah.md").write_text(md)
    plot(result, args.out / "niah.png")
    plot_frontier(result, args.out / "niah_frontier.png")
    print(md)
    for label, m in result["macro"].items():
        if m["cells_without_tq3"]:
            print(f"WARNING: {label}: {m['cells_without_tq3']} cell(s) never read a TQ3 page: not evidence about TQ3")
    return result


if __name__ == "__main__":
    main()
