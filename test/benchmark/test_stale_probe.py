"""benchmark/quality/stale_probe.py's mode grammar and its observation-window Anchors (``+snap<A>``):
the window's weights, the pages they keep FP8, and the pages converted around them."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "quality"))

from stale_probe import KVState, MinimaEmulation, Mode, Tiers  # noqa: E402

from sglang_minima.ops.dense import attend, causal_mask  # noqa: E402


def test_modes_parse_with_their_modifiers_and_refuse_what_has_no_effect():
    assert Mode.parse("k4@all") == Mode("k4", None)
    assert Mode.parse("k4+defer+snap4@256") == Mode("k4", 256, defer=True, snap_pages=4)
    assert Mode.parse("defer@128") == Mode("defer", 128, defer=True)  # tq3 with the deferred conversion
    for bad, says in (("k5@all", "unknown kv mode"), ("k4+snap@all", "unknown modifier"),
                      ("k4+snap0@all", "unknown modifier"), ("fp8+snap4@all", "no effect")):
        with pytest.raises(SystemExit, match=says):
            Mode.parse(bad)


def _emulation(snap_window: int, state: KVState, page_size: int = 4, recent: int = 1, sink: int = 1):
    emu = MinimaEmulation.__new__(MinimaEmulation)  # no model: only the schedule and the window
    emu.tiers, emu.snap_window, emu.state = Tiers(page_size, recent, sink), snap_window, state
    return emu


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
