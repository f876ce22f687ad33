"""benchmark/quality/stale_probe.py's mode grammar, its observation-window Anchors (``+snap<A>``):
the window's weights, the pages they keep FP8, and the pages converted around them, and the pooled
report of several runs' records."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

from stale_probe import KVState, MinimaEmulation, Mode, Tiers, example_keys, pooled, report  # noqa: E402

from sglang_minima.ops.dense import attend, causal_mask  # noqa: E402


def test_modes_parse_with_their_modifiers_and_refuse_what_has_no_effect():
    assert Mode.parse("k4@all") == Mode("k4", None)
    assert Mode.parse("k4+defer+snap4@256") == Mode("k4", 256, defer=True, snap_pages=4)
    assert Mode.parse("defer@128") == Mode("defer", 128, defer=True)  # tq3 with the deferred conversion
    assert Mode.parse("k4+center@all") == Mode("k4", None, center=True)
    for bad, says in (("k5@all", "unknown kv mode"), ("k4+snap@all", "unknown modifier"),
                      ("k4+snap0@all", "unknown modifier"), ("fp8+snap4@all", "no effect"),
                      ("fp8+center@all", "no effect"), ("tq3v+center@all", "keeps them FP8")):
        with pytest.raises(SystemExit, match=says):
            Mode.parse(bad)


def test_centered_keys_code_the_residual_from_the_pages_mean_key():
    torch.manual_seed(0)
    emu = MinimaEmulation.__new__(MinimaEmulation)
    emu.head_dim = 64
    # a page whose keys share a large offset per head (as real keys do: RoPE's slow channels)
    offset = 4.0 * torch.randn(1, 2, 1, 64)
    k = offset + 0.3 * torch.randn(1, 2, 64, 64)
    plain, centered = emu._finer_keys(k, 4), emu._centered_keys(k, 4)
    err = lambda x: float(((x - k) ** 2).sum() / (k**2).sum())  # noqa: E731
    assert err(centered) < err(plain) / 20  # the code spends its levels on the residual, not the offset
    # identical keys: the residual is the mean's fp16 rounding, coded with its norm: the page decodes
    # within twice that rounding, where the plain code's error is the code's own
    same = offset.expand(1, 2, 64, 64)
    rounding = float((same - same.half().float()).norm())
    assert float((emu._centered_keys(same, 4) - same).norm()) <= 2 * rounding + 1e-6
    assert float((emu._finer_keys(same, 4) - same).norm()) > 100 * rounding


def _emulation(snap_window: int, state: KVState, page_size: int = 4, recent: int = 1, sink: int = 1):
    emu = MinimaEmulation.__new__(MinimaEmulation)  # no model: only the schedule and the window
    emu.tiers, emu.snap_window, emu.state = Tiers(page_size, recent, sink), snap_window, state
    return emu


def test_a_bf16_model_is_attended_in_fp32_over_fp8_bytes_and_answered_in_bf16():
    """``--dtype bfloat16``: the emulated cache stores the bf16 keys' FP8 bytes (as set_kv_buffer casts
    them), scores in fp32 and hands the model bf16, what a served attention layer returns."""
    torch.manual_seed(0)
    emu = _emulation(64, KVState(kv_mode="fp8"), page_size=8)

    class Layer:
        layer_idx = 0

    q, k, v = (torch.randn(1, h, 12, 64).to(torch.bfloat16) for h in (4, 2, 2))  # [batch, heads, tokens, dim]
    out, _ = emu._attention(Layer(), q, k, v, None, scaling=0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 12, 4, 64)
    e4m3 = lambda x: x[0].transpose(0, 1).to(torch.float8_e4m3fn).to(torch.float32)  # noqa: E731
    want, _ = attend(q[0].transpose(0, 1), e4m3(k), e4m3(v), 0.125, causal_mask(torch.arange(12), torch.arange(12)))
    torch.testing.assert_close(out[0], want.to(torch.bfloat16), rtol=0, atol=0)


def test_the_window_is_the_softmax_weight_of_the_chunks_last_queries_summed_over_heads_and_layers():
    torch.manual_seed(0)
    t, n, hq, h, d, w = 6, 10, 4, 2, 8, 3
    q, k, v = torch.randn(t, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)
    mask = causal_mask(torch.arange(n - t, n), torch.arange(n))
    _, lse = attend(q, k, v, 0.3, mask)
    emu = _emulation(w, KVState(kv_mode="k4", snap_pages=1, observe=True))
    emu._observe(q, k, 0.3, lse, mask)
    emu._observe(q, k, 0.3, lse, mask)  # a second layer adds to the first
    logits = torch.einsum("thd,nhd->thn", q[-w:], k.repeat_interleave(hq // h, 1)) * 0.3
    want = torch.softmax(logits.masked_fill(~mask[-w:, None, :], float("-inf")), -1).sum((0, 1))
    torch.testing.assert_close(emu.state.key_mass, 2 * want, rtol=1e-5, atol=1e-6)
    assert emu.state.key_mass.sum().item() == pytest.approx(2 * w * hq, rel=1e-5)
    assert emu.state.key_mass[-1].item() > 0 and mask[-w:, -1].sum().item() == 1  # the last key: the last query only


def test_snap_keeps_the_heaviest_unconverted_stale_pages_once_the_prefill_ends():
    # 6 pages of 4 tokens: sink page 0, Recent page 5, pages 1-4 Stale once sealed
    state = KVState(kv_mode="k4", snap_pages=2)
    emu = _emulation(4, state)
    state.key_mass = torch.zeros(24)
    state.key_mass[3 * 4 + 1] = 5.0  # page 3 heaviest
    state.key_mass[1 * 4:2 * 4] = 0.5  # page 1: 2.0 in all
    state.key_mass[4 * 4] = 1.0  # page 4: 1.0
    emu._tick(24, prefilling=False)
    assert state.anchors == {3, 1}
    assert state.converted == {2, 4}
    assert state.key_mass is None
    # later ticks keep the same Anchors (picked once) and convert the new Stale pages around them
    emu._tick(25, prefilling=False)  # page 5 sealed and no longer Recent (page 6 is)
    assert state.anchors == {3, 1} and state.converted == {2, 4, 5}


def test_snap_with_deferral_chooses_among_all_prompt_pages_and_without_it_only_among_the_unconverted():
    def run(defer: bool) -> KVState:
        state = KVState(kv_mode="k4", defer=defer, snap_pages=1)
        emu = _emulation(4, state)
        emu._tick(12, prefilling=True)  # chunk 1 of 2 ends: pages 1 sealed and Stale
        state.key_mass = torch.zeros(24)
        state.key_mass[4:8] = 3.0  # page 1 is what the window attends most
        state.key_mass[8:12] = 1.0
        emu._tick(24, prefilling=False)
        return state

    deferred, eager = run(True), run(False)
    assert deferred.anchors == {1} and deferred.converted == {2, 3, 4}
    # without deferral page 1 was converted by the first chunk's tick: the window can only keep page 2
    assert eager.anchors == {2} and eager.converted == {1, 3, 4}


def test_fp8_and_plain_modes_pick_no_anchors():
    state = KVState(kv_mode="k4")
    emu = _emulation(4, state)
    emu._tick(24, prefilling=False)
    assert state.anchors is None and state.converted == {1, 2, 3, 4}
    fp8 = KVState(kv_mode="fp8")
    _emulation(4, fp8)._tick(24, prefilling=False)
    assert fp8.converted == set()


def _records(path: Path, keys: list[str], results: dict[str, tuple[list[float], list[float]]]) -> Path:
    """A run's --out JSON: per mode, scores and the last layer's hidden error of each example."""
    path.write_text(json.dumps({"examples": keys, "results": {
        m: {"scores": sc, "hidden_err": [[0.0, e] for e in err]} for m, (sc, err) in results.items()}}))
    return path


def test_the_report_pools_runs_pairs_examples_and_takes_the_macro_over_tasks(tmp_path):
    a = _records(tmp_path / "a.json", ["t1/1024/0", "t2/1024/1"],
                 {"fp8@256": ([100.0, 100.0], [0.0, 0.0]), "k4@256": ([0.0, 100.0], [0.2, 0.4])})
    # a cut run: its second example has the reference's records only; t1/1024/0 again (counted once)
    b = _records(tmp_path / "b.json", ["t1/1024/0", "t1/1024/2", "t2/1024/3"],
                 {"fp8@256": ([0.0, 100.0, 50.0], [0.0, 0.0, 0.0]), "k4@256": ([100.0, 100.0], [0.6, 0.0])})
    got = pooled([a, b])
    assert sorted(got["k4@256"]) == ["t1/1024/0", "t1/1024/2", "t2/1024/1"]
    assert got["k4@256"]["t1/1024/0"] == {"task": "t1", "score": 0.0, "hidden": 0.2}  # the first run's
    assert len(got["fp8@256"]) == 4
    table = report([a, b], ["fp8@256"])
    row = next(line for line in table.splitlines() if line.startswith("| k4@256 "))
    # t1: (0 - 100, 100 - 100) -> -50; t2: 100 - 100 -> 0; the macro over the two tasks: -25
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["k4@256", "3", "66.7"]
    assert cells[3].startswith("-25.0 [")
    assert cells[4] == "t1 -50.0"
    assert cells[5] == f"{(0.2 + 0.4 + 0.0) / 3:.4f}"  # b's 0.6 is the duplicate's
    with pytest.raises(SystemExit, match="no records of"):
        report([a], ["bf16@256"])


def test_keys_come_comma_separated_or_from_a_file(tmp_path):
    import argparse

    assert example_keys("niah_single_3/2048/7,niah_multiquery/2048/10") == (
        "niah_multiquery/2048/10", "niah_single_3/2048/7")
    f = tmp_path / "lost.txt"
    f.write_text("niah_single_3/2048/7\n\nniah_single_3/2048/7\nniah_multivalue/2048/1\n")
    assert example_keys(f"@{f}") == ("niah_multivalue/2048/1", "niah_single_3/2048/7")  # once each
    assert json.loads(json.dumps(example_keys(f"@{f}"))) == ["niah_multivalue/2048/1", "niah_single_3/2048/7"]
    with pytest.raises(argparse.ArgumentTypeError, match="no example key"):
        example_keys(" , ")
