"""benchmark/quality/niah.py without a server: how examples are grouped for concurrent answering, and
how the report counts the route counters of a group (read once per group, not once per example)."""

import dataclasses
import json
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah  # noqa: E402
from ruler_data import Example  # noqa: E402


def _ex(task: str, length: int, index: int) -> Example:
    return Example(task, length, index, prompt=f"{task} {length} {index}", outputs=("7",), prompt_tokens=10)


def test_groups_hold_one_cell_each_and_come_index_major():
    todo = [_ex(t, n, i) for t in ("niah_multikey_1", "niah_single_1") for n in (2048, 1024) for i in range(5)]
    groups = niah.groups_of(todo[::-1], 2)  # any order in
    assert all(len({(ex.task, ex.length) for ex in g}) == 1 for g in groups)
    assert sorted(ex.key for g in groups for ex in g) == sorted(ex.key for ex in todo)
    # indices 0-1 of every cell (by length, then RULER's task order), then 2-3, then 4
    assert [(g[0].task, g[0].length, [ex.index for ex in g]) for g in groups[:4]] == [
        ("niah_single_1", 1024, [0, 1]), ("niah_multikey_1", 1024, [0, 1]),
        ("niah_single_1", 2048, [0, 1]), ("niah_multikey_1", 2048, [0, 1])]
    assert [len(g) for g in groups] == [2] * 8 + [1] * 4 and all(g[0].index == 4 for g in groups[8:])


def _answers(out: Path, label: str, rows: list[dict]) -> None:
    (out / "answers").mkdir(parents=True, exist_ok=True)
    (out / "answers" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(index: int, score: float, routes: dict | None, group: str | None = None, size: int | None = None) -> dict:
    row = {"key": f"niah_single_1/1024/{index}", "task": "niah_single_1", "length": 1024, "index": index,
           "score": score, "routes": routes}
    if group is not None:
        row |= {"group": group, "group_size": size}
    return row


def test_a_groups_routes_count_once_and_its_examples_count_as_reading_tq3(tmp_path):
    routes = {"route_hot_pages": 30, "route_tq3_pages": 10, "route_hot_tokens": 1920, "route_tq3_tokens": 640,
              "retier_pages": 3}
    none = dict.fromkeys(routes, 0)
    _answers(tmp_path, "fp8@default", [_row(i, 100.0, None, "g", 3) for i in range(4)])
    # three examples answered together (one delta, written on each), one alone (a pre-grouping row)
    _answers(tmp_path, "minima@default",
             [_row(i, s, routes, "niah_single_1/1024/0", 3) for i, s in enumerate((100.0, 0.0, 100.0))]
             + [_row(3, 100.0, none)])
    args = Namespace(out=tmp_path, reference="fp8", arms=["fp8", "minima"], chunked_prefill_sizes=["default"],
                     bootstrap=200, seed=0, geometry=(3, 64), page_size=64, dtype="bfloat16")
    examples = [_ex("niah_single_1", 1024, i) for i in range(4)]
    result = niah.report([niah.Run(a, "default") for a in args.arms], examples, args)
    cell = next(c for c in result["cells"] if c["arm"] == "minima")
    assert cell["tq3_page_share"] == 10 / 40  # not 30 / 120
    assert cell["examples_reading_tq3"] == 3 and cell["tq3_read"]
    assert cell["diff_vs_ref"] == -25.0 and cell["n_paired"] == 4
    # the run read 1,920 FP8 and 640 TQ3 tokens (the example alone read none): 3/4 at FP8's 384 bytes
    # per token and layer (3 KV heads x 64 dims x K and V), 1/4 at TQ3's 162
    assert result["macro"]["minima@default"]["bytes_per_token"] == (3 * 384 + 162) / 4
    assert result["macro"]["fp8@default"]["bytes_per_token"] == 384
    # records from before the pressure counters: nothing is said of the pressure
    assert result["macro"]["minima@default"]["pressure_pages"] is None


def test_the_macro_says_what_memory_pressure_converted(tmp_path):
    """A run's pages converted under pressure, once per group, and of them the sinks and Recent pages
    (the policy's FP8 pages); a run whose records predate the per-tier counters gives its total alone."""
    base = {"route_hot_pages": 30, "route_tq3_pages": 10, "route_hot_tokens": 1920, "route_tq3_tokens": 640,
            "retier_pages": 3}
    tiers = {"pressure_retier_pages": 9, "pressure_stale_pages": 6, "pressure_cached_pages": 0,
             "pressure_deferred_pages": 1, "pressure_anchor_pages": 2, "pressure_recent_pages": 0}
    _answers(tmp_path, "fp8@default", [_row(i, 100.0, None, "g", 2) for i in range(4)])
    _answers(tmp_path, "minima@default", [_row(i, 100.0, base | tiers, f"group{i // 2}", 2) for i in range(4)])
    _answers(tmp_path, "minima-k4@default", [_row(i, 100.0, base | {"pressure_retier_pages": 5}, "g", 4) for i in range(4)])
    args = Namespace(out=tmp_path, reference="fp8", arms=["fp8", "minima", "minima-k4"], chunked_prefill_sizes=["default"],
                     bootstrap=200, seed=0, geometry=(3, 64), page_size=64, dtype="bfloat16")
    examples = [_ex("niah_single_1", 1024, i) for i in range(4)]
    result = niah.report([niah.Run(a, "default") for a in args.arms], examples, args)
    assert (result["macro"]["minima@default"]["pressure_pages"], result["macro"]["minima@default"]["pressure_kept_pages"]) == (18, 4)
    assert (result["macro"]["minima-k4@default"]["pressure_pages"], result["macro"]["minima-k4@default"]["pressure_kept_pages"]) == (5, None)
    md = niah.markdown(result, args).splitlines()
    assert next(line for line in md if line.startswith("| minima@default |")).endswith("| 18 (4) |")
    assert next(line for line in md if line.startswith("| minima-k4@default |")).endswith("| 5 |")
    assert next(line for line in md if line.startswith("| fp8@default |")).endswith("| - |")


def test_a_run_whose_tq3_pool_was_full_says_so(tmp_path):
    routes = {"route_hot_pages": 30, "route_tq3_pages": 10, "route_hot_tokens": 1920, "route_tq3_tokens": 640,
              "retier_pages": 3, "pressure_retier_pages": 0}
    _answers(tmp_path, "fp8@default", [_row(i, 100.0, None, "g", 2) for i in range(2)])
    _answers(tmp_path, "minima@default", [_row(i, 100.0, routes | {"retier_no_room_pages": 12}, "g", 2) for i in range(2)])
    _answers(tmp_path, "minima-k4@default", [_row(i, 100.0, routes, "g", 2) for i in range(2)])  # an older server
    args = Namespace(out=tmp_path, reference="fp8", arms=["fp8", "minima", "minima-k4"], chunked_prefill_sizes=["default"],
                     bootstrap=200, seed=0, geometry=(3, 64), page_size=64, dtype="bfloat16")
    result = niah.report([niah.Run(a, "default") for a in args.arms], [_ex("niah_single_1", 1024, i) for i in range(2)], args)
    assert result["macro"]["minima@default"]["no_room_pages"] == 12  # the group's count, once
    assert result["macro"]["minima-k4@default"]["no_room_pages"] is None
    md = niah.markdown(result, args)
    assert "- minima@default: 12 conversions found the TQ3 pool full" in md and "- minima-k4@default:" not in md


def test_bytes_per_token_follows_the_codecs_page_accounting():
    geo = (3, 64)  # SmolLM2-135M: 3 KV heads of 64 dims; per layer, K and V
    assert niah.bytes_per_token(niah.ARMS["bf16"], 0, 0, geo, 64, "bfloat16") == 768
    assert niah.bytes_per_token(niah.ARMS["minima-nostale"], 5, 0, geo, 64, "bfloat16") == 384
    # TQ3: 3 bits per key and value element, an fp16 norm per key and a scale and zero per value, per head
    assert niah.bytes_per_token(niah.ARMS["minima"], 0, 7, geo, 64, "bfloat16") == 3 * (3 * 64 * 2 / 8 + 3 * 2)
    assert niah.bytes_per_token(niah.ARMS["minima-k4"], 0, 7, geo, 64, "bfloat16") == 3 * (7 * 64 / 8 + 3 * 2)
    assert niah.bytes_per_token(niah.ARMS["minima"], 0, 0, geo, 64, "bfloat16") is None  # read nothing: unknown
    # --server-args come after the arm's flags, and the launcher takes a flag's last value
    assert niah.bytes_per_token(niah.ARMS["minima"], 0, 7, geo, 64, "bfloat16", ["--minima-key-bits=4"]) == 3 * (7 * 64 / 8 + 3 * 2)
    # page-centered keys: one fp16 mean per page, head and dim, 2 * 64 / 64 bytes a token and head
    assert niah.bytes_per_token(niah.ARMS["minima-k4-center"], 0, 7, geo, 64, "bfloat16") == 3 * (7 * 64 / 8 + 3 * 2 + 2)


def test_an_equal_bytes_arm_gets_the_fp8_pools_bytes_in_tokens():
    args = Namespace(model_path="m", dtype="bfloat16", page_size=64, max_total_tokens=69_632, concurrency=32,
                     device="cuda", geometry=(3, 64), num_layers=30, server_args="")

    def tokens(arm: str, server_args: str = "", device: str = "cuda") -> int:
        flags = niah.server_flags(niah.ARMS[arm], Namespace(**{**vars(args), "server_args": server_args,
                                                               "device": device}), "default")
        return int(flags[flags.index("--max-total-tokens") + 1])

    assert tokens("fp8") == tokens("minima-default") == 69_632  # the same logical tokens
    # FP8: 384 bytes a token and layer, 30 layers; the defaults 0.25 * 384 + 0.75 * (4-bit keys, 3-bit
    # values: 3 * (7 * 64 / 8 + 3 * 2) = 186) = 235.5 a layer, 7,065 a token; on CUDA the server keeps
    # 12 MiB of the budget for the prefill's tile (3 heads x 16,384 tokens x 64 x 4 bytes), on CPU nothing
    fp8_budget = 69_632 * 384 * 30
    assert tokens("minima-default-eqbytes") == (fp8_budget - 12 * 2**20) // 7065 // 64 * 64 == 111_744
    assert tokens("minima-default-eqbytes", device="cpu") == fp8_budget // 7065 // 64 * 64 == 113_536
    # the arm's bytes per token follow --server-args (3-bit keys: 3 * (6 * 64 / 8 + 6) = 162 -> 217.5 a layer)
    assert tokens("minima-default-eqbytes", "--minima-key-bits 3") == (fp8_budget - 12 * 2**20) // 6525 // 64 * 64
    # a 20% FP8 share: 0.2 * 384 + 0.8 * 186 = 225.6 a layer, 6,768 a token; the arm's own flags count
    assert tokens("minima-fp8share20-eqbytes") == (fp8_budget - 12 * 2**20) // 6768 // 64 * 64
    assert "minima-nostale-eqbytes" not in niah.ARMS  # nothing converted: FP8's bytes per token already


def test_a_pool_size_among_the_servers_flags_is_refused_naming_the_flag(capsys, tmp_path):
    # it would come last on every server's command line and size every arm alike, eqbytes arms too
    import pytest

    for given in ("--max-total-tokens 4096", "--mem-fraction-static 0.5 --max-total-tokens=4096",
                  "--max-total-token 4096"):  # SGLang's parser takes an abbreviation as the flag
        with pytest.raises(SystemExit):
            niah.parse_args([f"--server-args={given}", "--arms", "fp8,minima-default-eqbytes", "--device", "cuda",
                             "--out", str(tmp_path)])
        assert "--server-args: --max-total-tokens sizes every arm's pool alike" in capsys.readouterr().err
    kept = niah.parse_args(["--server-args=--mem-fraction-static 0.5", "--device", "cuda", "--out", str(tmp_path)])
    assert kept.server_args == "--mem-fraction-static 0.5" and kept.max_total_tokens > 0


def test_gzipped_answers_are_read_and_a_resume_appends_to_their_unpacked_copy(tmp_path):
    import gzip

    rows = [_row(i, 100.0, None) for i in range(4)]
    (tmp_path / "answers").mkdir()
    gz = tmp_path / "answers" / "fp8@default.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows[:3]).encode()))
    run = niah.Run("fp8", "default")
    assert sorted(niah.load_answers(tmp_path, run)) == [r["key"] for r in rows[:3]]
    # a resume with every example answered launches nothing, and unpacks nothing either
    args = Namespace(out=tmp_path, concurrency=2, deadline=float("inf"))
    niah.answer_run(run, [_ex("niah_single_1", 1024, i) for i in range(3)], args, url=None)
    assert not (tmp_path / "answers" / "fp8@default.jsonl").exists()
    # the unpacked copy, a superset, wins over the gzip
    (tmp_path / "answers" / "fp8@default.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(niah.load_answers(tmp_path, run)) == 4


def test_a_second_unpack_keeps_what_a_shard_appended_to_the_first(tmp_path):
    path = tmp_path / "fp8@256.jsonl"
    rows = [json.dumps(_row(i, 100.0, None)) for i in range(3)]
    niah.unpack_answers(path, rows[:2])
    with path.open("a") as f:  # the shard that unpacked it answers a group
        f.write(rows[2] + "\n")
    niah.unpack_answers(path, rows[:2])  # the shard beside it, resuming from the same gzip
    assert path.read_text().splitlines() == rows


def test_the_macro_by_length_averages_each_lengths_tasks_and_flags_a_length_without_tq3(tmp_path):
    def row(task: str, length: int, index: int, score: float, tq3: int) -> dict:
        routes = {"route_hot_pages": 4, "route_tq3_pages": tq3, "route_hot_tokens": 256, "route_tq3_tokens": 64 * tq3,
                  "retier_pages": tq3}
        return {"key": f"{task}/{length}/{index}", "task": task, "length": length, "index": index, "score": score,
                "routes": routes}

    cells = [(t, n) for n in (1024, 2048) for t in ("niah_single_1", "niah_multikey_1")]
    _answers(tmp_path, "fp8@256", [row(t, n, i, 100.0, 0) | {"routes": None} for t, n in cells for i in range(2)])
    # 1K: single_1 loses 50 on both examples, multikey_1 nothing, and no example read a TQ3 page;
    # 2K: single_1 nothing, multikey_1 loses 100 on one example of two (its cell: -50)
    scores = {("niah_single_1", 1024): (50.0, 50.0), ("niah_multikey_1", 1024): (100.0, 100.0),
              ("niah_single_1", 2048): (100.0, 100.0), ("niah_multikey_1", 2048): (0.0, 100.0)}
    _answers(tmp_path, "minima@256", [row(t, n, i, scores[(t, n)][i], 0 if n == 1024 else 2)
                                      for t, n in cells for i in range(2)])
    args = Namespace(out=tmp_path, reference="fp8", arms=["fp8", "minima"], chunked_prefill_sizes=["256"],
                     bootstrap=200, seed=0, geometry=(3, 64), page_size=64, dtype="bfloat16")
    examples = [_ex(t, n, i) for t, n in cells for i in range(2)]
    result = niah.report([niah.Run(a, "256") for a in args.arms], examples, args)
    by = result["macro_by_length"]["minima@256"]
    assert by[1024]["diff_vs_ref"] == -25.0 and by[1024]["cells_without_tq3"] == 2
    assert by[2048]["diff_vs_ref"] == -25.0 and by[2048]["cells_without_tq3"] == 0
    assert tuple(by[1024]["diff_ci95"]) == (-25.0, -25.0)  # every example of 1K moved alike
    lo, hi = by[2048]["diff_ci95"]
    assert lo < -25.0 < hi  # one of two examples lost: the resample moves
    assert result["macro"]["minima@256"]["diff_vs_ref"] == -25.0
    md = niah.markdown(result, args)
    assert "| minima@256 | -25.0 [-25.0, -25.0]* | -25.0 [" in md


def test_every_minima_arm_is_a_valid_minima_config():
    # an arm whose flags the launcher refuses would only fail on the device, after its server start
    from sglang_minima.config import parse_minima_argv, split_minima_argv

    def config_of(arm: str):
        return parse_minima_argv(split_minima_argv(list(niah.ARMS[arm].flags))[0])

    for arm in niah.ARMS.values():
        config = config_of(arm.name)
        if arm.name.startswith("minima-fp8share"):
            assert config.fp8_page_fraction == int(arm.name.removeprefix("minima-fp8share")[:2]) / 100
        name = arm.name.removesuffix("-eqbytes")
        assert arm.equal_bytes == (name != arm.name)
        assert config.strict_hot_admission == name.endswith("-strict")
        assert config.key_center == name.endswith("-center")
    # the defaults and page-centered keys, nothing else (minima-k4-center carries the pinned older policy)
    defaults = parse_minima_argv([])
    assert dataclasses.replace(defaults, key_center=True) == config_of("minima-default-center")
    # the frontier's arms: the defaults with one window changed, nothing else
    for name, change in [("minima-default-recent8", {"recent_pages": 8}), ("minima-default-recent16", {"recent_pages": 16}),
                         ("minima-default-recent32", {"recent_pages": 32}),
                         ("minima-default-sink4", {"sink_pages": 4})]:
        assert config_of(name) == dataclasses.replace(defaults, **change) != defaults
    # the replicate pins four Recent pages, whatever the default becomes
    assert config_of("minima-default-recent4") == dataclasses.replace(defaults, recent_pages=4)


def test_a_run_that_answered_nothing_says_so_and_draws_nothing(tmp_path):
    """A call whose budget ended while its servers started (2026-12-07, stop 60's call 11) wrote empty answers
    files; its report says that in a sentence, not as tables without rows, and draws no figure."""
    for label in ("fp8@256", "minima@256"):
        _answers(tmp_path, label, [])
    args = Namespace(out=tmp_path, reference="fp8", arms=["fp8", "minima"], chunked_prefill_sizes=["256"],
                     bootstrap=200, seed=0, geometry=(3, 64), page_size=64, dtype="bfloat16")
    result = niah.report([niah.Run(a, "256") for a in args.arms], [_ex("niah_single_1", 1024, i) for i in range(2)], args)
    assert result["cells"] == [] and result["macro"] == {}
    assert niah.markdown(result, args).startswith("No arm answered an example")
    niah.plot(result, tmp_path / "niah.png")
    niah.plot_frontier(result, tmp_path / "niah_frontier.png")
    assert not list(tmp_path.glob("*.png"))
