"""minima_kernels.heuristics on CPU: the builds, split counts and path choice against the choices the
H200 measurements made (docs/results/kernels.md), their SM count taken from the device, and no
tilelang or flashinfer needed to import them."""

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize(
    "batch,kv_heads,max_pages,splits",
    [
        (1, 4, 128, 33),  # one CTA per SM: 132 SMs / 4 (request, kv head) pairs
        (1, 3, 512, 44),
        (8, 3, 128, 5),
        (8, 8, 128, 2),
        (2, 8, 4, 2),  # at least 2 pages per split
    ],
)
def test_fp8_splits(batch: int, kv_heads: int, max_pages: int, splits: int) -> None:
    from minima_kernels.heuristics import choose_fp8_splits

    assert choose_fp8_splits(batch, kv_heads, max_pages) == splits


@pytest.mark.parametrize(
    "head_dim,pages_per_split,pages_per_step",
    [(64, 24, 2), (128, 16, 2), (128, 8, 2), (64, 7, 1), (64, 6, 1), (256, 32, 1)],
)
def test_fp8_pages_per_step(head_dim: int, pages_per_split: int, pages_per_step: int) -> None:
    from minima_kernels.heuristics import fp8_tile_config

    build = fp8_tile_config(64, head_dim, pages_per_split)
    assert build == {"threads": 128, "stages": 2, "pages_per_step": pages_per_step}


@pytest.mark.parametrize(
    "batch,kv_heads,tq3_pages,fp8_pages,head_dim,splits",
    [
        (1, 4, 384, 128, 256, (25, 8)),  # one wave of 132 slots / 4 heads = 33, shared 3:1 as the pages
        (1, 3, 1536, 512, 64, (33, 11)),  # 8 warps x 1 CTA at batch 1: 44 slots per kv head
        (8, 3, 384, 128, 64, (16, 6)),  # 4 CTAs x 4 warps: 22 slots per (request, kv head)
        (32, 8, 1536, 512, 128, (3, 1)),  # fewer than 2 slots per pair: several waves of equal-work splits
        (1, 4, 2, 2, 256, (1, 1)),  # at least 2 chunks per warp
    ],
)
def test_fused_splits(batch: int, kv_heads: int, tq3_pages: int, fp8_pages: int, head_dim: int, splits: tuple) -> None:
    from minima_kernels.heuristics import tile_config
    from minima_kernels.heuristics import choose_mixed_splits

    build = tile_config(0, 64, head_dim, batch)
    assert choose_mixed_splits(batch, kv_heads, tq3_pages, fp8_pages, 64, build, head_dim=head_dim) == splits


@pytest.mark.parametrize(
    "batch,tq3_pages,fp8_pages,splits",
    # Llama-3-8B-class, 4-bit keys, 132 SMs: 264 resident slots; the sweep's requests (device README
    # stop 55: 8 FP8 pages of 512 or 2,040) and #16's kernel target (75% Stale at 32K); in the comments,
    # the one-wave share by work that stop 55's eager rule took
    [
        (8, 504, 8, (4, 1)),  # before (3, 1); 4 slots: a 4th TQ3 split saves 42 pages a CTA, the FP8 split holds 8
        (8, 2032, 8, (4, 1)),  # before (3, 1)
        (4, 2032, 8, (8, 1)),  # before (7, 1)
        (8, 64, 6, (3, 1)),  # before (3, 1); a 4th would save 5 pages, fewer than the FP8 split's 6
        (8, 384, 128, (3, 1)),  # before (3, 1); 75% Stale: the FP8 pages take their slot
        # 12 rows: 2 slots, 2.75 in the GPU: one wave of 2 TQ3 splits fills 73% of the slots; 1.5 waves
        # (4 splits) where they hold 64 pages or more each, one FP8 split
        (12, 504, 8, (4, 1)),  # before (1, 1)
        (12, 384, 128, (4, 1)),  # before (1, 1)
        (12, 64, 6, (2, 1)),  # before (1, 1); splits of 16 pages: one wave (the sweep: 0.67x FP8, 4 splits 0.74x)
        (16, 2032, 8, (2, 1)),  # before (1, 1); 2.06 slots: one wave fills 97%
        (10, 500, 8, (3, 1)),  # before (2, 1); 3.3 slots, more TQ3 work than FP8: one wave fills 91%
        (10, 48, 200, (1, 2)),  # before (1, 2); 3 slots, the FP8 pages take two: the share stays
        (32, 384, 128, (3, 1)),  # before (3, 1); 1 slot: equal-work splits, as before
    ],
)
def test_eager_fused_splits_take_the_graphs_waves(batch, tq3_pages, fp8_pages, splits) -> None:
    # The sweep's eager column (an eager plan on the real page counts) took (1, 1) at 12-16 rows,
    # 0.85-0.90x FlashInfer FP8's time where 2-4 TQ3 splits took 0.40-0.56x, and (3, 1) at 8 rows of
    # 512 / 2,040 pages, 0.64 / 0.60x where 4 took 0.56 / 0.50x: the eager step now takes the graph's
    # rule on its real page counts
    from minima_kernels.heuristics import choose_mixed_splits, graph_splits, tile_config

    build = tile_config(4, 64, 128, batch, key_bits=4)
    got = choose_mixed_splits(batch, 8, tq3_pages, fp8_pages, 64, build, num_sms=132, head_dim=128)
    assert got == splits
    if fp8_pages == 8:  # a graph of this context takes the same splits
        assert graph_splits(batch, 8, tq3_pages + fp8_pages, 64, build, 132, head_dim=128) == splits


@pytest.mark.parametrize(
    "batch,kv_heads,tq3_pages,fp8_pages,head_dim,fits",
    [
        (1, 4, 384, 128, 256, True),  # one wave: always fused
        (8, 8, 1536, 512, 128, True),
        (32, 4, 58, 6, 256, False),  # batch 32 x 4K, 90% Stale: 9 TQ3 splits of 6-7 pages over several waves
        (32, 8, 58, 6, 128, False),
        (32, 4, 48, 16, 256, True),  # x 4K, 75%: 3 splits of 16 pages
        (32, 4, 461, 51, 256, True),  # x 32K, 90%: 9 splits of 51 pages
    ],
)
def test_auto_takes_the_fused_decode(batch: int, kv_heads: int, tq3_pages: int, fp8_pages: int, head_dim: int, fits: bool) -> None:
    from minima_kernels.heuristics import tile_config
    from minima_kernels.heuristics import fused_fits

    build = tile_config(0, 64, head_dim, batch)
    assert fused_fits(batch, kv_heads, tq3_pages, fp8_pages, 64, build, head_dim=head_dim) == fits


def test_imports_without_tilelang_or_flashinfer() -> None:
    import subprocess
    import sys

    code = "import sys, minima_kernels.heuristics; assert not {'tilelang', 'flashinfer'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_sm_count_comes_from_the_device(monkeypatch) -> None:
    import torch
    from minima_kernels.heuristics import choose_fp8_splits, choose_num_splits, device_sm_count

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=66))
    sms = device_sm_count("cuda:0")
    assert sms == 66
    assert choose_fp8_splits(1, 4, 128, num_sms=sms) == 16  # half the H200's 33: one CTA per SM
    assert choose_num_splits(1, 4, 4096, 64, 256, num_sms=sms) == 2 * choose_num_splits(1, 4, 4096, 64, 256, num_sms=33)


def _path(fp8_kernel: str = "auto", **kw):
    from minima_kernels.heuristics import choose_path, tile_config

    geometry = dict(batch=1, num_kv_heads=4, group_size=6, head_dim=256, page_size=64, fp8_page_size=64,
                    num_fp8_pages=128, max_fp8_pages=128, max_tq3_pages=384)
    geometry.update(kw)
    tq3 = geometry.pop("tq3", True)
    build = tile_config(geometry["group_size"], geometry["page_size"], geometry["head_dim"], geometry["batch"]) if tq3 else None
    return choose_path(fp8_kernel, tq3_build=build, **geometry)


def test_auto_path_choice() -> None:
    from minima_kernels.heuristics import DecodePath

    # one wave at batch 1: fused, its splits from choose_mixed_splits (test_fused_splits' first row)
    assert _path() == DecodePath(fused=True, tilelang_fp8=False, tq3_splits=25, fp8_splits=8)
    # FP8 pages of another size: the two-launch path, the TileLang FP8 decode for few FP8 slots ...
    two = _path(fp8_page_size=32, num_fp8_pages=16, max_fp8_pages=16)
    assert not two.fused and two.tilelang_fp8 and two.fp8_parts and two.fp8_splits >= 1
    # ... FlashInfer's above TILELANG_FP8_MAX_TOKENS (16384 slots at head dim 256)
    many = _path(fp8_page_size=32, num_fp8_pages=1024, max_fp8_pages=1024)
    assert not many.fused and not many.tilelang_fp8 and many.fp8_splits == 0 and many.tq3_splits >= 1
    # several waves of short TQ3 splits (batch 32 x 4K, 90% Stale): the two-launch path
    assert not _path(batch=32, num_fp8_pages=32 * 6, max_fp8_pages=6, max_tq3_pages=58).fused
    # no TQ3 pages: FlashInfer's decode alone; no FP8 pages: the TQ3 decode alone
    assert _path(tq3=False, max_tq3_pages=0) == DecodePath(False, False, 0, 0)
    alone = _path(num_fp8_pages=0, max_fp8_pages=0)
    assert not alone.fp8_parts and alone.tq3_splits >= 1


def test_forced_paths_and_overrides() -> None:
    assert _path("tilelang").tilelang_fp8 and not _path("tilelang").fused
    flash = _path("flashinfer")
    assert not flash.fused and not flash.tilelang_fp8
    assert _path("fused", num_splits=7, num_fp8_splits=3).tq3_splits == 7
    assert _path("fused", num_splits=7, num_fp8_splits=3).fp8_splits == 3
    with pytest.raises(ValueError, match="TQ3 page size 64, got 32"):
        _path("fused", fp8_page_size=32)
    with pytest.raises(ValueError, match="at most 16 query heads"):
        _path("tilelang", group_size=24)
    with pytest.raises(ValueError, match="num_splits=2000: the split combine takes 1 to 1024"):
        _path("flashinfer", num_splits=2000)
    with pytest.raises(ValueError, match="fp8_kernel='fast'"):
        _path("fast")


@pytest.mark.parametrize(
    "batch,kv_heads,max_pages,head_dim,splits,whole_wave",
    [
        (8, 8, 544, 128, (4, 1), True),  # #16 (a)'s graph (34,816 tokens): 4 slots a pair, all TQ3 (the share: 3)
        (4, 8, 2048, 128, (8, 1), True),  # Llama-3-8B-class at 128K, 4 rows: 8 slots, 8 TQ3 splits of 255 pages
        # 1 row: 33 slots; a 33rd TQ3 split would shorten each by 2 pages and push an 8-page FP8 CTA
        # past the wave: the share's 32
        (1, 8, 2048, 128, (32, 1), False),
        (8, 3, 128, 64, (21, 1), False),  # SmolLM2 (3-bit keys) at its 8K context, batch 8: 22 slots, 5-page splits
    ],
)
def test_a_graph_with_slots_to_spare_takes_a_wave_of_tq3_splits_where_it_pays(
    batch, kv_heads, max_pages, head_dim, splits, whole_wave
) -> None:
    # with 4 resident slots a (request, kv head) or more, the one-wave share (for requests of the
    # whole context, 8 of their pages FP8) keeps the FP8 split a slot; the graph, like an eager
    # step's fused rule, gives that slot to one more TQ3 split where the split saves more pages than
    # the FP8 split holds
    from minima_kernels.heuristics import WHOLE_WAVE_MIN_SLOTS, graph_splits, slots_per_pair, tile_config

    build = tile_config(0, 64, head_dim, batch)
    slots = slots_per_pair(batch, kv_heads, build, 132)
    assert slots >= WHOLE_WAVE_MIN_SLOTS
    got = graph_splits(batch, kv_heads, max_pages, 64, build, 132, head_dim=head_dim)
    assert got == splits
    assert got[0] == (slots if whole_wave else slots - 1)


@pytest.mark.parametrize(
    "batch,max_pages,splits",
    # Llama-3-8B-class, 4-bit keys, 132 SMs: 264 resident slots
    [
        (12, 100, 2), (12, 544, 4), (12, 2048, 4),  # 2.75 slots a pair: one wave of 2 fills 73%
        (16, 100, 2), (16, 2048, 2),  # 2.06: 97%
        (17, 100, 1), (17, 544, 3), (17, 2048, 3),  # 1.94: one split fills 52%
        (24, 100, 1), (24, 2048, 2),  # 1.38: 73%
        (32, 2048, 1), (64, 2048, 1),  # 1.03 and 0.52: one split
    ],
)
def test_a_graph_with_few_slots_a_pair_takes_a_wave_or_a_wave_and_a_half(batch, max_pages, splits) -> None:
    # From 9 rows the 8 kv heads leave each (request, kv head) under 4 resident slots (12-16 rows: 2,
    # from 17: 1). There the fused rule for requests of the model's whole context gave the short FP8
    # split a slot of its own and the TQ3 pages one CTA (12-16 rows of 512-2,040 pages: 0.85-0.90x
    # FlashInfer FP8 where 2-4 splits take 0.40-0.56x), and from 17 rows cut them into hundreds of
    # splits the real requests leave empty (64 rows at 128K: 255, a 138 ms decode step). Now one wave
    # of TQ3 splits, or 1.5 waves where one wave fills under 80% of the slots and the context leaves
    # each of the 1.5 waves' splits 64 pages or more; one FP8 split. An eager step's fused rule takes
    # the same at 2 or 3 slots and equal-work splits of its real pages below 2
    from minima_kernels.heuristics import (
        TQ3_WAVES,
        TQ3_WAVES_MIN_PAGES,
        WHOLE_WAVE_MIN_SLOTS,
        choose_mixed_splits,
        graph_splits,
        slots_per_pair,
        tile_config,
    )

    build = tile_config(4, 64, 128, batch, key_bits=4)
    slots = slots_per_pair(batch, 8, build, 132)
    assert slots < WHOLE_WAVE_MIN_SLOTS
    tq3, fp8 = graph_splits(batch, 8, max_pages, 64, build, 132, head_dim=128)
    assert (tq3, fp8) == (splits, 1)
    waves = int(TQ3_WAVES * build["min_blocks"] * 132 / (batch * 8) + 0.5)
    assert tq3 in (max(1, slots), waves)
    if tq3 != max(1, slots):
        assert (max_pages - 8) // tq3 >= TQ3_WAVES_MIN_PAGES
    eager = choose_mixed_splits(batch, 8, max_pages - 8, 8, 64, build, num_sms=132, head_dim=128)
    assert (eager == (tq3, fp8)) == (slots >= 2)


def test_smollm2_graphs_take_one_wave_of_short_splits() -> None:
    # SmolLM2 (3 kv heads, head dim 64, 3 resident CTAs an SM): at 48 rows one wave of 2 TQ3 splits
    # fills 73% of the slots, but 1.5 waves' 4 splits of its 8K context hold 30 pages of head dim 64,
    # 15 of head dim 128: one wave (stop 56's sweep, 128-page requests: 2 splits 0.52x FlashInfer FP8,
    # 4 splits 0.58x); a context of 11 pages leaves 3 TQ3 pages, 2 at least a split (2 chunks for each
    # of 4 warps): one split
    from minima_kernels.heuristics import graph_splits, min_split_pages, tile_config

    build = tile_config(3, 64, 64, 48, key_bits=4)
    assert min_split_pages(build, 64) == 2
    assert graph_splits(48, 3, 128, 64, build, 132, head_dim=64) == (2, 1)
    assert graph_splits(64, 3, 128, 64, tile_config(3, 64, 64, 64, key_bits=4), 132, head_dim=64) == (2, 1)
    assert graph_splits(96, 3, 128, 64, tile_config(3, 64, 64, 96, key_bits=4), 132, head_dim=64) == (1, 1)
    assert graph_splits(48, 3, 11, 64, build, 132, head_dim=64) == (1, 1)
    # head dim 256, 16 rows of 4 kv heads, a context of 4 pages: one split of each format
    assert graph_splits(16, 4, 4, 64, tile_config(0, 64, 256, 16), 132, head_dim=256) == (1, 1)


def test_compile_builds_cover_every_path_choice() -> None:
    # compile()'s list: for "auto" at Llama-3-8B-class (group 4, head dim 128, pages of 64), the TQ3
    # build of one request and of batches (equal at head dim 128, so once), its fused twin, and the
    # TileLang FP8 decode's one- and two-page steps; every build choose_path's plans take is in it
    from minima_kernels.heuristics import (
        TWO_PAGE_STEP_MIN_PAGES,
        compile_builds,
        fp8_tile_config,
        fused_build_of,
        tile_config,
    )

    builds = compile_builds("auto", 4, 64, 128, 64)
    tq3 = tile_config(4, 64, 128, None)
    assert builds == [
        ("tq3", tq3),
        ("mixed", fused_build_of(tq3, 64)),
        ("fp8", fp8_tile_config(64, 128, 1)),
        ("fp8", fp8_tile_config(64, 128, TWO_PAGE_STEP_MIN_PAGES)),
    ]
    # head dim 256 has a batch-1 TQ3 build of its own, and one FP8 step size
    kinds = [kernel for kernel, _ in compile_builds("auto", 6, 64, 256, 64)]
    assert kinds == ["tq3", "mixed", "tq3", "mixed", "fp8"]
    # what each choice may launch: FlashInfer's FP8 part builds no FP8 kernel; FP8 pages of another
    # size never take the fused decode; GQA groups over 16 heads never the TileLang FP8 decode
    assert {k for k, _ in compile_builds("flashinfer", 4, 64, 128, 64)} == {"tq3"}
    assert {k for k, _ in compile_builds("auto", 4, 64, 128, 32)} == {"tq3", "fp8"}
    assert {k for k, _ in compile_builds("auto", 24, 64, 128, 64)} == {"tq3", "mixed"}
    # the wrapper's overrides reach every build they apply to
    over = compile_builds("auto", 4, 64, 128, 64, tq3_config={"warps": 4}, fp8_config={"stages": 3})
    assert all(b["warps"] == 4 for k, b in over if k in ("tq3", "mixed"))
    assert all(b["stages"] == 3 for k, b in over if k == "fp8")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("batch", [None, 1])
def test_4bit_key_builds_fit_the_shared_memory_of_an_sm(head_dim: int, page_size: int, batch: int | None) -> None:
    # 4-bit keys add a 32 KB key table and a third more key words per ring slot: the fused twin of
    # each build (the larger) fits one CTA, and min_blocks of them an SM; 3-bit builds are unchanged
    from minima_kernels.heuristics import (
        CTA_RESERVED_SHARED_BYTES, CTA_SHARED_BYTES, SM_SHARED_BYTES, decode_shared_bytes, fused_build_of, tile_config,
    )

    group = 8
    old, new = tile_config(group, page_size, head_dim, batch), tile_config(group, page_size, head_dim, batch, 4)
    assert tile_config(group, page_size, head_dim, batch, 3) == old
    fused = fused_build_of(new, page_size)["fp8_step_chunks"]
    shared = decode_shared_bytes(head_dim, page_size, new, 4, fused, group)
    assert shared <= CTA_SHARED_BYTES and new["min_blocks"] * (shared + CTA_RESERVED_SHARED_BYTES) <= SM_SHARED_BYTES
    assert shared >= decode_shared_bytes(head_dim, page_size, new, 3, fused, group) + 16 * 1024  # the table, the key words
    assert new["step_chunks"] == old["step_chunks"] and new["warps"] * new["step_chunks"] % (page_size // 16) == 0
    if head_dim == 256 and batch is None:  # 12 warps' rings and the table would need 236 KB
        assert (old["warps"], new["warps"]) == (12, 8)
    if head_dim == 64 and batch is None:  # four 63 KB CTAs do not fit an SM
        assert (old["min_blocks"], new["min_blocks"]) == (4, 3)


def test_prefill_tile_and_its_scratch():
    from minima_kernels.heuristics import prefill_scratch_bytes, prefill_tile_pages, prefill_tq3_kernel

    # the kernel on CUDA for head dims with the kernels' rotation; the torch codec elsewhere
    assert prefill_tq3_kernel("cuda", 64) and prefill_tq3_kernel("cuda", 256)
    assert not prefill_tq3_kernel("cuda", 96) and not prefill_tq3_kernel("cpu", 64)

    assert prefill_tile_pages(64, kernel=True) == 256 and prefill_tile_pages(64, kernel=False) == 64
    assert prefill_tile_pages(64, kernel=True, tile_tokens=100) == 1  # whole pages, at least one
    assert prefill_tile_pages(16, kernel=True, tile_tokens=8) == 1
    # K and V of a full tile: bf16 on the kernel path, fp32 + bf16 copies on the torch codec's
    assert prefill_scratch_bytes(4, 256, 64, kernel=True) == 64 << 20  # what the H200 canary metered (64.0 MiB)
    assert prefill_scratch_bytes(8, 128, 64, kernel=True) == 64 << 20
    assert prefill_scratch_bytes(3, 64, 64, kernel=False) == 3 * 4096 * 64 * 12
    assert prefill_scratch_bytes(3, 64, 48, kernel=True) == 3 * (16384 // 48 * 48) * 64 * 4
