"""Bytes per Minima tier, reconciled exactly with the KV pool's allocated bytes; table, JSON and PNG.

Two sources:
  (default)  a workload run in-process through SGLang's real classes (MinimaKVPool,
             MinimaPagedAllocator, MinimaRadixCache) with SmolLM2-135M's KV geometry: requests
             sharing a system prompt are prefilled, decoded step by step (the radix cache's
             flush_pending_backups runs the controller after every step), some finish into the
             cache; a report is taken after every step.
  --url URL  one report read from a running server's /server_info (its ``minima`` section).

Every report must satisfy: sum of the rows (recent, anchor, stale_hot, hot_other, stale, held, free, padding)
== bytes the store's buffers occupy == sum(pool.get_kv_size_bytes()); the script exits non-zero
otherwise.

    python benchmark/memory/memory_report.py [--out docs/results]   # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

from sglang_minima.cpu_engine import setup_cpu_engine

setup_cpu_engine()

import torch  # noqa: E402

ROWS = ("recent", "anchor", "stale_hot", "hot_other", "stale", "held_hot", "held_tq3", "free_hot", "free_tq3", "padding")
GEOMETRY = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M


def simulate(args) -> list[dict]:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.mem_cache_utils import finish_req

    from sglang_minima.config import MinimaConfig, set_active_config
    from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
    from sglang_minima.mem_cache.kv_pool import MinimaKVPool
    from sglang_minima.reporting.memory_report import memory_report
    from sglang_minima.mem_cache.radix_cache import MinimaRadixCache

    ps, layers, heads, dim = args.page_size, GEOMETRY["num_layers"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
    set_active_config(MinimaConfig(fp8_page_fraction=args.fp8_page_fraction, recent_pages=args.recent_pages))
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=ps))
    max_len = (args.prompt_pages + args.decode_steps // ps + 2) * ps
    req_to_token = ReqToTokenPool(size=args.requests, max_context_len=max_len, device="cpu", enable_memory_saver=False)
    size = args.pages * ps
    pool = MinimaKVPool(size, page_size=ps, dtype=torch.bfloat16, head_num=heads, head_dim=dim, layer_num=layers,
                        device="cpu", enable_memory_saver=False)
    allocator = MinimaPagedAllocator(size, ps, torch.bfloat16, "cpu", pool, False)
    cache = MinimaRadixCache(CacheInitParams(
        req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator, page_size=ps, disable=False,
        tree_components=(ComponentType.FULL,), kv_event_lora_names=KvEventLoraNames(),
    ))
    gen = torch.Generator().manual_seed(0)

    def write(loc: torch.Tensor) -> None:
        for layer in range(layers):
            k = torch.randn(loc.numel(), heads, dim, generator=gen, dtype=torch.bfloat16)
            v = torch.randn(loc.numel(), heads, dim, generator=gen, dtype=torch.bfloat16)
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, v)

    def one(x: int) -> torch.Tensor:
        return torch.tensor([x])

    system = list(range(1, args.shared_pages * ps + 1))
    running, reports = [], []
    for i in range(args.requests):
        tokens = system + [10_000 + i * 1_000 + j for j in range((args.prompt_pages - args.shared_pages) * ps - 3)]
        req = Req(rid=f"r{i}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=args.decode_steps))
        req.init_next_round_input(cache)
        req_to_token.alloc([req])
        row, prefix, n = req.kv.req_pool_idx, req.prefix_len, len(tokens)
        if prefix:
            req_to_token.write((row, slice(0, prefix)), cache.prefix_device_indices(req).to(torch.int32))
        last = req_to_token.req_to_token[row, prefix - 1 : prefix].long() if prefix else one(-1)
        out = allocator.alloc_extend(one(prefix), one(prefix), one(n), one(n), last, n - prefix)
        req_to_token.write((row, slice(prefix, n)), out.to(torch.int32))
        write(out)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = n
        req.output_ids = array("q")
        req.refresh_fill_ids()
        cache.checkpoint(req, up_to=n)  # what the scheduler does after a prefill: later prompts hit it
        running.append(req)
        cache.flush_pending_backups()
        reports.append(snapshot(memory_report(pool.store), pool, f"prefill r{i}"))
    for step in range(args.decode_steps):
        seq = torch.tensor([r.kv.kv_allocated_len + 1 for r in running])
        last = torch.stack([req_to_token.req_to_token[r.kv.req_pool_idx, r.kv.kv_allocated_len - 1] for r in running])
        out = allocator.alloc_decode(seq, seq, last.long())
        for r, loc in zip(running, out.tolist()):
            req_to_token.write((r.kv.req_pool_idx, r.kv.kv_allocated_len), loc)
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            r.output_ids.append(7)
        write(out)
        cache.flush_pending_backups()
        reports.append(snapshot(memory_report(pool.store), pool, f"decode {step}"))
    for r in running[: len(running) // 2]:
        r.refresh_fill_ids()
        finish_req(cache, r, r.kv.kv_allocated_len)
        cache.on_release(r, checkpointed=True)
        req_to_token.free(r)
    cache.flush_pending_backups()
    reports.append(snapshot(memory_report(pool.store), pool, "half finished"))
    return reports


def snapshot(report, pool, label: str) -> dict:
    data = report.as_dict()
    data["label"] = label
    data["pool_bytes"] = sum(pool.get_kv_size_bytes())
    return data


def from_server(url: str) -> list[dict]:
    import requests

    info = requests.get(f"{url.rstrip('/')}/server_info", timeout=30).json()
    states = info.get("internal_states") or [info]
    section = states[0]["minima"]
    data = section["memory"]
    data["label"] = url
    data["pool_bytes"] = data["allocated_bytes"]  # the server reports the buffers it measured
    return [data]


def reconcile(report: dict) -> bool:
    return report["accounted_bytes"] == report["allocated_bytes"] == report["pool_bytes"]


def print_table(report: dict) -> None:
    mib = 1 << 20
    print(f"\n{report['label']}: bytes per tier (MiB)")
    print(f"{'row':<10} {'pages':>7} {'payload':>10} {'metadata':>10} {'padding':>10} {'total':>10}")
    for name in ROWS:
        r = report["rows"][name]
        print(f"{name:<10} {r['pages']:>7} {r['payload_bytes'] / mib:>10.3f} {r['metadata_bytes'] / mib:>10.3f} "
              f"{r['padding_bytes'] / mib:>10.3f} {r['total_bytes'] / mib:>10.3f}")
    print(f"{'sum':<10} {'':>7} {'':>10} {'':>10} {'':>10} {report['accounted_bytes'] / mib:>10.3f}")
    print(f"allocated {report['allocated_bytes']} B, pool.get_kv_size_bytes {report['pool_bytes']} B, "
          f"rows {report['accounted_bytes']} B: {'reconciled' if reconcile(report) else 'MISMATCH'}")
    print(f"live tokens {report['live_tokens']}, bytes per live token {report['bytes_per_live_token']:.1f}")


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1 << 20
    x = range(len(reports))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.stackplot(x, *[[r["rows"][n]["total_bytes"] / mib for r in reports] for n in ROWS], labels=ROWS)
    ax.set_xlabel("report (one per scheduler step)")
    ax.set_ylabel("MiB")
    ax.set_title("Minima KV pool: bytes per tier (rows add up to the allocated bytes)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="read one report from a running server instead of simulating")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "docs" / "results")
    parser.add_argument("--pages", type=int, default=96, help="logical pages of the pool")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--fp8-page-fraction", type=float, default=0.25)
    parser.add_argument("--recent-pages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-pages", type=int, default=8)
    parser.add_argument("--shared-pages", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=24)
    args = parser.parse_args()

    reports = from_server(args.url) if args.url else simulate(args)
    print_table(reports[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_report.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                             "reports": reports}, indent=1))
    plot(reports, args.out / "memory_report.png")
    bad = [r["label"] for r in reports if not reconcile(r)]
    print(f"\n{len(reports)} reports, {len(reports) - len(bad)} reconciled exactly; wrote {args.out}/memory_report.{{json,png}}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
