"""The TileLang FP8 decode's split count and build, against the choices the H200 measurements made
(docs/results/kernels.md). Pure functions: no GPU needed, but minima_kernels imports tilelang and
flashinfer (the gpu extra)."""

import pytest

pytest.importorskip("tilelang")
pytest.importorskip("flashinfer")


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
    from minima_kernels.decode import choose_fp8_splits

    assert choose_fp8_splits(batch, kv_heads, max_pages) == splits


@pytest.mark.parametrize(
    "head_dim,pages_per_split,pages_per_step",
    [(64, 24, 2), (128, 16, 2), (128, 8, 2), (64, 7, 1), (64, 6, 1), (256, 32, 1)],
)
def test_fp8_pages_per_step(head_dim: int, pages_per_split: int, pages_per_step: int) -> None:
    from minima_kernels.fp8_decode import fp8_tile_config

    build = fp8_tile_config(64, head_dim, pages_per_split)
    assert build == {"threads": 128, "stages": 2, "pages_per_step": pages_per_step}


def test_two_page_steps_past_the_tested_head_dims_are_refused() -> None:
    from minima_kernels.fp8_decode import fp8_decode_kernel

    with pytest.raises(ValueError, match="pages_per_step=2"):
        fp8_decode_kernel(4, 6, 256, 64, 256**-0.5, "bfloat16", pages_per_step=2)


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
    from minima_kernels import tile_config
    from minima_kernels.decode import choose_mixed_splits

    build = tile_config(0, 64, head_dim, batch)
    assert choose_mixed_splits(batch, kv_heads, tq3_pages, fp8_pages, 64, build) == splits


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
    from minima_kernels import tile_config
    from minima_kernels.decode import fused_fits

    build = tile_config(0, 64, head_dim, batch)
    assert fused_fits(batch, kv_heads, tq3_pages, fp8_pages, 64, build) == fits
