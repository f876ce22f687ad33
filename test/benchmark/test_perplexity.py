"""benchmark/quality/perplexity.py's report: the paired NLL difference and the perplexity ratio
from per-window JSONL (no server is started)."""

import json
import math
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah  # noqa: E402
import perplexity  # noqa: E402


def _write(out: Path, label: str, windows: dict[int, list[float]], tq3_tokens: int) -> None:
    (out / "nll").mkdir(parents=True, exist_ok=True)
    routes = {"route_hot_pages": 0, "route_tq3_pages": 0, "route_hot_tokens": 0, "route_tq3_tokens": tq3_tokens,
              "retier_pages": 2 if tq3_tokens else 0}
    (out / "nll" / f"{label}.jsonl").write_text("".join(
        json.dumps({"window": w, "tokens": len(n), "nll": n, "seconds": 0.1, "routes": routes}) + "\n"
        for w, n in windows.items()))


def test_ratio_is_exp_of_the_token_weighted_mean_difference(tmp_path):
    _write(tmp_path, "minima-nostale@128", {0: [1.0, 2.0], 1: [3.0, 3.0, 3.0]}, 0)
    _write(tmp_path, "minima@128", {0: [1.2, 2.2], 1: [3.0, 3.0, 3.3]}, 64)
    _write(tmp_path, "minima-k4@128", {0: [1.0, 2.0]}, 0)  # one window, and it read no TQ3 page
    args = Namespace(out=tmp_path, reference="minima-nostale", chunk="128", bootstrap=200, device="cpu", window=3,
                     text="essays", concurrency=1)
    runs = [niah.Run(a, "128") for a in ("minima-nostale", "minima", "minima-k4")]
    rows = {r["run"]: r for r in perplexity.report(runs, args)["rows"]}
    m = rows["minima@128"]
    assert math.isclose(m["delta_nll"], 0.7 / 5)  # (0.2 + 0.2 + 0.3) over 5 tokens, not the windows' mean 0.15
    assert math.isclose(m["ppl_ratio_pct"], 100 * (math.exp(0.14) - 1))
    assert m["delta_nll_ci"][0] <= m["delta_nll"] <= m["delta_nll_ci"][1]
    assert (m["tq3_tokens_read"], m["pages_converted"], m["windows_without_tq3"]) == (128, 4, 0)
    k4 = rows["minima-k4@128"]
    assert k4["delta_nll"] == 0.0 and k4["windows_without_tq3"] == 1  # reported, not hidden
    assert math.isclose(rows["minima-nostale@128"]["perplexity"], math.exp(12.0 / 5))


def test_agreement_counts_equal_positions_first_divergence_and_identical_generations():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]  # identical; differs at 1; differs at 0
    a = perplexity.agreement(got, ref, resamples=200)
    assert math.isclose(a["token_agreement"], (4 + 3 + 3) / 12)
    assert a["first_divergence_mean"] == (4 + 1 + 0) / 3 and a["identical_generations"] == 1
    assert (a["generations"], a["generated_tokens"]) == (3, 12)
    assert a["token_agreement_ci"][0] <= a["token_agreement"] <= a["token_agreement_ci"][1]
    assert perplexity.agreement([[7, 7]], [[7, 7]], resamples=10)["token_agreement_ci"] == [1.0, 1.0]


class _Server:
    url = "http://stub"

    def stop(self):
        pass


def test_windows_sent_together_go_in_one_batched_call_and_count_their_routes_once(tmp_path, monkeypatch):
    """--concurrency 2: the windows of a group reach the server in one /generate call (a list of
    prompts), each record holds its own log-probs and the group's route counters, the report counts
    those once per group, and records sent one at a time are a different question (not mixed)."""
    calls, reads = [], iter(range(0, 10_000, 100))  # the server's TQ3 read counter: +100 per look

    def post(url, json=None, timeout=None):
        calls.append((url.rsplit("/", 1)[1], json))
        prompts = json["input_ids"] if json and isinstance(json["input_ids"][0], list) else [json["input_ids"]] if json else []
        answers = [{"meta_info": {"input_token_logprobs": [[None]] + [[-0.5 * t] for t in p[1:]]}, "output_ids": p[:2]}
                   for p in prompts]
        return Namespace(raise_for_status=lambda: None, json=lambda: answers if len(answers) > 1 else answers[0])

    monkeypatch.setattr(perplexity.requests, "post", post)
    monkeypatch.setattr(niah, "launch_arm", lambda run, args: _Server())
    monkeypatch.setattr(niah, "minima_stats", lambda url: {"route_tq3_tokens": next(reads), "retier_pages": 0})
    monkeypatch.setattr(niah, "stats_delta", lambda a, b: {k: b[k] - a[k] for k in a})
    windows = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    args = Namespace(out=tmp_path, text="essays", window=3, generate_tokens=2, concurrency=2, reference="fp8",
                     chunk="256", bootstrap=100, device="cuda")
    run = niah.Run("minima", "256")
    perplexity.score_run(run, windows, args)
    generates = [j for name, j in calls if name == "generate"]
    # per group: the prefill, then the generation
    assert [g["input_ids"] for g in generates] == [windows[:2], windows[:2], windows[2], windows[2]]
    assert generates[0]["return_logprob"] and "return_logprob" not in generates[1]
    got = perplexity.load(tmp_path, run, "essays", concurrency=2)
    assert got[1]["nll"] == [2.5, 3.0] and got[1]["group"] == [0, 1] and got[2]["generated"] == [7, 8]
    row = perplexity.report([run], args)["rows"][0]
    # two groups, each +100 TQ3 tokens in its prefill and +100 in its generation: not +100 per window
    assert (row["windows"], row["tq3_tokens_read"], row["generation_tq3_tokens_read"]) == (3, 200, 200)
    assert perplexity.load(tmp_path, run, "essays", concurrency=1) == {}
    calls.clear()
    perplexity.score_run(run, windows, args)  # all answered: resumes to nothing
    assert calls == []


def test_an_equal_bytes_arm_is_sized_from_the_model_perplexity_serves(tmp_path):
    # perplexity.py's arguments (no --server-args) and niah's model facts: FP8's bytes of 32,768 tokens,
    # less the 12 MiB prefill tile on CUDA, at the defaults' 7,065 bytes a token (SmolLM2: 3 x 64, 30 layers)
    (tmp_path / "config.json").write_text(json.dumps({"num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
                                                       "hidden_size": 576, "num_attention_heads": 9}))
    args = Namespace(device="cuda", dtype="bfloat16", page_size=64, max_total_tokens=32768, concurrency=1)
    niah.set_model(args, tmp_path)
    flags = niah.server_flags(niah.ARMS["minima-default-eqbytes"], args, "128")
    assert int(flags[flags.index("--max-total-tokens") + 1]) == (32768 * 384 * 30 - 12 * 2**20) // 7065 // 64 * 64
