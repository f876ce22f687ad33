"""benchmark/reliability/serving_soak.py's profiles and wall budget (no server is started)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import serving_soak as soak  # noqa: E402


def test_cpu_profile_keeps_the_cpu_soak(monkeypatch):
    monkeypatch.delenv("MINIMA_E2E_DEVICE", raising=False)
    args = soak.parse_args([])
    assert args.profile == "cpu"
    assert (args.duration_s, args.max_total_tokens, args.max_running_requests) == (600, 2048, 12)
    assert (args.nonce_clients, args.disconnect_clients, args.abort_clients) == (4, 1, 1)
    assert (args.bench_prompts, args.bench_concurrency, args.forced_retract_interval) == (4, 4, 40)
    assert tuple(args.abort_after_s) == (5.0, 30.0) and args.request_timeout_s == 900
    assert soak.load_seconds(args, elapsed_s=300) == 600  # no budget: the load is --duration-s


def test_profile_follows_the_device_and_flags_override_it(monkeypatch):
    monkeypatch.setenv("MINIMA_E2E_DEVICE", "cuda")
    args = soak.parse_args(["--nonce-clients", "2", "--forced-retract-interval", "0", "--abort-after-s", "1", "2"])
    assert args.profile == "cuda" and args.bench_prompts == soak.PROFILES["cuda"]["bench_prompts"]
    assert (args.nonce_clients, args.forced_retract_interval, args.abort_after_s) == (2, 0, [1.0, 2.0])


def test_wall_budget_leaves_room_for_drain_idle_and_report():
    args = soak.parse_args(["--profile", "cuda", "--wall-budget-s", "520"])
    after = args.drain_timeout_s + args.idle_timeout_s + soak.REPORT_S
    assert soak.load_seconds(args, elapsed_s=65) == min(args.duration_s, 520 - 65 - after)
    assert soak.load_seconds(args, elapsed_s=600) == 0  # a start that ate the budget: no load, checks fail
    assert soak.load_seconds(soak.parse_args(["--profile", "cuda", "--wall-budget-s", "2000"]), 60) == args.duration_s


def test_a_miss_with_another_requests_code_fails_the_leak_check():
    replay = {"replayed": 1, "same_miss": 1, "echoed": 0}
    own_error = {"code": "WTY-2733", "answer": " WYT-2733", "foreign_codes": []}
    leak = {"code": "QMK-8134", "answer": " ZCX-8963", "foreign_codes": ["ZCX-8963"]}
    ok = soak.nonce_check(100, [own_error], 300, replay)
    assert ok["passed"] and (ok["missed_own_code"], ok["with_another_requests_code"]) == (1, 0)
    bad = soak.nonce_check(100, [own_error, leak], 300, replay)
    assert not bad["passed"] and bad["with_another_requests_code"] == 1
    assert not soak.nonce_check(0, [], 0, {"replayed": 0, "same_miss": 0, "echoed": 0})["passed"]  # no evidence
