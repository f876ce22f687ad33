"""Distortion of KV formats at their real bit cost: BF16, FP8, int3/int4 min-max, TQ3 (+ variants).

For each format: per-coordinate relative MSE of K and V, relative error of the logits q·k, and
relative error of the causal attention output, on random Gaussian data and on real post-RoPE Q/K/V
captured from SmolLM2-135M-Instruct on long real text. The whole cache is quantized (a stress test:
Minima keeps sinks and recent pages in FP8). Prints a table, writes JSON and a PNG.

    python benchmark/codec/bench_codec.py            # ~1-2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from capture import LayerQKV, capture_qkv
from methods import METHODS, PAGE_SIZE, RECENT_TOKENS, SINK_TOKENS

from sglang_minima.codec.accounting import bytes_per_token_table
from sglang_minima.ops.dense import attend, causal_mask

ROOT = Path(__file__).resolve().parents[2]


def _rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    return float(err.double().pow(2).sum().sqrt() / ref.double().pow(2).sum().sqrt())


def metrics(layer: LayerQKV, k_hat: torch.Tensor, v_hat: torch.Tensor, num_queries: int) -> dict[str, float]:
    n = layer.k.shape[0]
    qpos, kpos = torch.arange(n - num_queries, n), torch.arange(n)
    q = layer.q[n - num_queries :]
    mask = causal_mask(qpos, kpos)
    group = q.shape[1] // layer.k.shape[1]

    def logits(k: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thd,nhd->htn", q, k.repeat_interleave(group, 1))[:, mask]

    ref_logits = logits(layer.k)
    out_ref, _ = attend(q, layer.k, layer.v, layer.sm_scale, mask)
    out, _ = attend(q, k_hat, v_hat, layer.sm_scale, mask)
    return {
        "k_rel_mse": float((k_hat - layer.k).pow(2).mean() / layer.k.pow(2).mean()),
        "v_rel_mse": float((v_hat - layer.v).pow(2).mean() / layer.v.pow(2).mean()),
        "qk_rel_err": _rel(logits(k_hat) - ref_logits, ref_logits),
        "attn_rel_err": _rel(out - out_ref, out_ref),
    }


def gaussian_layers(num_tokens: int, head_dim: int, seed: int) -> list[LayerQKV]:
    g = torch.Generator().manual_seed(seed)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(num_tokens, h, head_dim, generator=g)

    return [LayerQKV(0, randn(8), randn(2), randn(2), head_dim**-0.5)]


def evaluate(name: str, layers: list[LayerQKV], num_queries: int, bar: tqdm) -> list[dict]:
    rows = []
    for m in METHODS:
        per_layer = []
        for layer in layers:
            k_hat, v_hat = m.run(layer.k, layer.v, layer.layer_id)
            per_layer.append(metrics(layer, k_hat, v_hat, num_queries))
            bar.update(1)
        n, d = layers[0].k.shape[0], layers[0].k.shape[-1]
        row = {"data": name, "method": m.name, "bits_k": m.bits_k(d, n), "bits_v": m.bits_v(d, n)}
        row["bits_mean"] = (row["bits_k"] + row["bits_v"]) / 2
        for key in per_layer[0]:
            row[key] = sum(r[key] for r in per_layer) / len(per_layer)
        row["per_layer"] = {str(layer.layer_id): r for layer, r in zip(layers, per_layer, strict=True)}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["data", "method", "bits_k", "bits_v", "k_rel_mse", "v_rel_mse", "qk_rel_err", "attn_rel_err"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["data"], r["method"], f"{r['bits_k']:.3f}", f"{r['bits_v']:.3f}"]
        cells += [f"{r[c]:.3e}" for c in cols[4:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_bytes_table() -> str:
    lines = [
        "| head_dim | FP8 payload | FP8 metadata | FP8 total | TQ3 payload | TQ3 metadata | TQ3 total "
        "| TQ3 bits K/V | FP8/TQ3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bytes_per_token_table(page_size=PAGE_SIZE):
        lines.append(
            f"| {r['head_dim']} | {r['fp8_payload']:.0f} | {r['fp8_metadata']:.0f} | {r['fp8_total']:.0f} | "
            f"{r['tq3_payload']:.0f} | {r['tq3_metadata']:.0f} | {r['tq3_total']:.0f} | "
            f"{r['tq3_bits_k']:.4g}/{r['tq3_bits_v']:.4g} | {r['fp8_over_tq3']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["data"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, name in zip(axes[0], datasets, strict=True):
        for r in (r for r in rows if r["data"] == name):
            ax.scatter(r["bits_mean"], r["attn_rel_err"])
            ax.annotate(r["method"], (r["bits_mean"], r["attn_rel_err"]), fontsize=8)
        ax.set(
            xscale="log",
            yscale="log",
            title=name,
            xlabel="bits / element (K,V mean, with metadata)",
            ylabel="attention output rel. error",
        )
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, torch {torch.__version__}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, help="HF model dir (default: sglang_minima.models.ensure_default_model())"
    )
    p.add_argument("--text", type=Path, default=ROOT / ".cache/text/paul_graham_essays.txt")
    p.add_argument("--tokens", type=int, default=3072, help="tokens of real text (a multiple of 64)")
    p.add_argument("--layers", default="0,4,8,12,16,20,24,29")
    p.add_argument("--queries", type=int, default=256, help="last positions used as queries")
    p.add_argument("--gaussian-dims", default="64,128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=ROOT / "docs/results/codec.json")
    p.add_argument("--png", type=Path, default=ROOT / "docs/results/codec.png")
    args = p.parse_args()
    if args.tokens % PAGE_SIZE or args.tokens <= SINK_TOKENS + RECENT_TOKENS + args.queries:
        p.error(
            f"--tokens must be a multiple of {PAGE_SIZE} above {SINK_TOKENS + RECENT_TOKENS + args.queries}"
        )
    if not args.text.exists():
        p.error(f"--text {args.text} not found: pass a file with at least --tokens tokens of real text")
    torch.manual_seed(args.seed)

    if args.model is None:
        from sglang_minima.models import ensure_default_model

        args.model = ensure_default_model()
    layer_ids = [int(x) for x in args.layers.split(",")]
    real = capture_qkv(args.model, args.text.read_text(), args.tokens, layer_ids)
    datasets = [
        (f"gauss-d{d}", gaussian_layers(args.tokens, int(d), args.seed))
        for d in args.gaussian_dims.split(",")
    ]
    datasets.append((f"smollm2-{args.text.stem}", real))

    total = sum(len(layers) for _, layers in datasets) * len(METHODS)
    rows = []
    with tqdm(total=total, desc="quantize+attend", file=sys.stderr) as bar:
        for name, layers in datasets:
            rows += evaluate(name, layers, args.queries, bar)

    table, bytes_table = format_table(rows), format_bytes_table()
    print(table)
    print()
    print(f"Bytes per token per layer per KV head (page_size={PAGE_SIZE}):")
    print(bytes_table)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "model": str(args.model),
        "text": str(args.text),
        "tokens": args.tokens,
        "layers": layer_ids,
        "queries": args.queries,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"meta": meta, "results": rows, "bytes_per_token": bytes_per_token_table(page_size=PAGE_SIZE)},
            indent=1,
        )
    )
    plot(rows, args.png)
    print(f"\nwrote {args.json} and {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
