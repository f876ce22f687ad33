"""minima_kernels on the GPU against the torch reference (codec + ops).

Decode: mixed FP8 / TQ3 batches with odd lengths, real-like K/V (outlier channels), requests without
TQ3 pages, all-FP8 and all-TQ3 batches; the kernels' own buffers are NaN-poisoned before each run.
Conversion: FP8 -> TQ3 and TQ3 -> FP8 bytes must equal the torch codec's, on poisoned destinations.
"""

import math

import pytest
import torch
from minima_kernels.decode_paths import FusedDecode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEOMETRIES = [  # (q heads, kv heads, head dim, page size)
    (24, 4, 256, 64),
    (32, 8, 128, 32),
    (9, 3, 64, 16),
]
OUT_RTOL = 2e-2
LSE_ATOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _wrapper(hq: int, h: int, d: int, p: int, fp8_kernel: str = "flashinfer", **kwargs):
    from minima_kernels import MinimaDecodeWrapper

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return MinimaDecodeWrapper(workspace, hq, h, d, p, fp8_kernel=fp8_kernel, **kwargs)


def _run_poisoned(wrapper, batch, **plan_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    wrapper.plan(*batch.plan_args(), **plan_kwargs)
    bufs = []
    if wrapper.tq3_plan is not None:
        bufs += [wrapper.tq3_plan.out_partial, wrapper.tq3_plan.lse_partial]
    if wrapper.fp8_plan is not None:
        bufs += [wrapper.fp8_plan.out_partial, wrapper.fp8_plan.lse_partial]
    bufs += [wrapper.decode.out.out, wrapper.decode.out.lse]  # what the mixed decode returns (its epilogue's outputs)
    for buf in bufs:
        buf.fill_(float("nan"))
    out, lse = wrapper.run(
        batch.q,
        (batch.k_fp8.view(torch.float8_e4m3fn), batch.v_fp8.view(torch.float8_e4m3fn)),
        batch.tq3_pages,
        batch.rotation.signs.cuda(),
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
    )
    torch.cuda.synchronize()
    return out, lse


def _check(batch, out: torch.Tensor, lse: torch.Tensor, hq: int, d: int, sm_scale: float | None = None) -> None:
    ref_out, ref_lse = batch.reference(d**-0.5 if sm_scale is None else sm_scale)
    assert out.shape == (batch.batch, hq, d) and lse.shape == (batch.batch, hq)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    rel = _rel(out, ref_out)
    lse_err = float((lse - ref_lse).abs().max())
    print(f"rel_err(out)={rel:.2e} max|dlse|={lse_err:.2e}")
    assert rel < OUT_RTOL
    assert lse_err < LSE_ATOL


@pytest.mark.parametrize("fp8_kernel", ["flashinfer", "tilelang", "fused"])
@pytest.mark.parametrize("overlap_fp8", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_mixed_decode_matches_reference(hq: int, h: int, d: int, p: int, overlap_fp8: bool, fp8_kernel: str) -> None:
    from kv_fixtures import make_batch

    if fp8_kernel == "fused" and not overlap_fp8:
        pytest.skip("the fused decode is one launch: no side stream to overlap")
    # odd fills of the last FP8 page, one request without TQ3 pages, ~75% Stale overall
    batch = make_batch(hq, h, d, p, [1, 3, 2, 1, 2], [9, 0, 5, 13, 1], [1, p - 1, p, 7, 3], seed=hq + p)
    wrapper = _wrapper(hq, h, d, p, fp8_kernel)
    wrapper.overlap_fp8 = overlap_fp8
    out, lse = _run_poisoned(wrapper, batch)
    _check(batch, out, lse, hq, d)


@pytest.mark.parametrize("fp8_kernel", ["flashinfer", "fused"])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_decode_reads_4bit_keys(hq: int, h: int, d: int, p: int, fp8_kernel: str) -> None:
    # --minima-key-bits 4: the TQ3 decode (two-launch) and the fused decode over 4-bit-key pages
    # against the torch reference over the same pages, and the 3-bit reference is not it
    from kv_fixtures import make_batch

    batch = make_batch(hq, h, d, p, [1, 3, 2, 1], [9, 0, 5, 13], [1, p - 1, p, 7], seed=hq + p + 4, key_bits=4)
    wrapper = _wrapper(hq, h, d, p, fp8_kernel, key_bits=4)
    out, lse = _run_poisoned(wrapper, batch)
    _check(batch, out, lse, hq, d)
    kernel = wrapper.decode.kernel if isinstance(wrapper.decode, FusedDecode) else wrapper.decode.tq3_kernel
    assert "k4_keys" in kernel.get_kernel_source()


@pytest.mark.parametrize("key_bits", [4, 3])
@pytest.mark.parametrize("fp8_kernel", ["flashinfer", "fused"])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_decode_reads_page_centered_keys(hq: int, h: int, d: int, p: int, fp8_kernel: str, key_bits: int) -> None:
    # --minima-key-center (either key width; 4 is the server's): each TQ3 page's keys shifted by its own
    # vector, coded about the page's mean; the TQ3 and fused decodes add q'.m per page and match the
    # torch reference, which without the means is far off (the term is not lost in the tolerance)
    import dataclasses

    from kv_fixtures import make_batch
    from sglang_minima.codec import page_fields

    batch = make_batch(hq, h, d, p, [1, 3, 2, 1], [9, 0, 5, 13], [1, p - 1, p, 7], seed=hq + p + 6, key_bits=key_bits,
                       key_center=True, key_offset=0.5)
    wrapper = _wrapper(hq, h, d, p, fp8_kernel, key_bits=key_bits, key_center=True)
    out, lse = _run_poisoned(wrapper, batch)
    _check(batch, out, lse, hq, d)
    no_mean = batch.tq3_pages.clone()
    page_fields(no_mean, batch.layout).k_mean.zero_()
    wrong, _ = dataclasses.replace(batch, tq3_pages=no_mean).reference(d**-0.5)
    print(f"without the means: rel_err(out)={_rel(out, wrong):.2e}")
    assert _rel(out, wrong) > 5 * OUT_RTOL


@pytest.mark.parametrize("tq3_config", [{"warps": 4, "min_blocks": 2}, {"warps": 8, "min_blocks": 1}], ids=["4w2b", "8w1b"])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_mixed_decode_with_another_tq3_build(hq: int, h: int, d: int, p: int, tq3_config: dict) -> None:
    # tq3_config overrides tile_config's build; the split count follows the build's CTAs per SM
    from kv_fixtures import make_batch
    from minima_kernels import choose_num_splits, tile_config

    batch = make_batch(hq, h, d, p, [1, 3, 2], [40, 0, 57], [1, p - 1, 7], seed=hq + p + 1)
    wrapper = _wrapper(hq, h, d, p, "tilelang", tq3_config=tq3_config)
    _check(batch, *_run_poisoned(wrapper, batch), hq, d)
    build = {**tile_config(hq // h, p, d, 3), **tq3_config}
    assert wrapper.tq3_build == build
    assert f"__launch_bounds__({32 * build['warps']}, {build['min_blocks']})" in wrapper.decode.tq3_kernel.get_kernel_source()
    assert wrapper.tq3_plan.num_splits == choose_num_splits(3, h, 57, p, d, build=build)
    with pytest.raises(ValueError, match="tq3_config: unknown options"):
        _wrapper(hq, h, d, p, tq3_config={"warp": 4})


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_all_fp8_and_all_tq3(hq: int, h: int, d: int, p: int) -> None:
    from kv_fixtures import make_batch

    wrapper = _wrapper(hq, h, d, p)
    all_fp8 = make_batch(hq, h, d, p, [4, 1, 6], [0, 0, 0], [p, 5, 1], seed=1)
    _check(all_fp8, *_run_poisoned(wrapper, all_fp8), hq, d)
    all_tq3 = make_batch(hq, h, d, p, [0, 0, 0], [4, 1, 17], [0, 0, 0], seed=2)
    _check(all_tq3, *_run_poisoned(wrapper, all_tq3), hq, d)


@pytest.mark.parametrize("pages_per_step", [1, 2])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_tilelang_fp8_more_splits_than_pages_and_nan_slots(hq: int, h: int, d: int, p: int, pages_per_step: int) -> None:
    # the TileLang FP8 decode with 8 splits over 1-3 pages per request (empty splits), partial last
    # pages inside multi-split requests, and e4m3 NaN (0x7F) in every slot past a request's last token;
    # with 2 pages per step, splits of odd page counts (24 pages in 8 splits of 3: a step whose second
    # page is past the split)
    from kv_fixtures import make_batch

    if pages_per_step > 1 and d > 128:
        pytest.skip("2 pages per step: more shared memory than an SM has at head dim 256")
    batch = make_batch(hq, h, d, p, [3, 1, 2, 24], [2, 1, 3, 1], [5, p, 1, 3], seed=hq + 7, unused_slot_byte=0x7F)
    wrapper = _wrapper(hq, h, d, p, "tilelang", fp8_config={"pages_per_step": pages_per_step})
    out, lse = _run_poisoned(wrapper, batch, num_fp8_splits=8)
    assert wrapper.fp8_plan.num_splits == 8
    assert wrapper.fp8_plan.page_ids.numel() == 30 + pages_per_step - 1  # the last split's step reads one id past the list
    _check(batch, out, lse, hq, d)


@pytest.mark.parametrize("fp8_kernel", ["flashinfer", "tilelang", "fused"])
def test_request_without_fp8_pages(fp8_kernel: str) -> None:
    from kv_fixtures import make_batch

    hq, h, d, p = GEOMETRIES[1]
    batch = make_batch(hq, h, d, p, [2, 0, 1], [3, 6, 0], [9, 0, 4], seed=3)
    wrapper = _wrapper(hq, h, d, p, fp8_kernel)
    _check(batch, *_run_poisoned(wrapper, batch), hq, d)
    assert (wrapper.fp8_plan is not None) == (fp8_kernel != "flashinfer")
    assert isinstance(wrapper.decode, FusedDecode) == (fp8_kernel == "fused")


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_fused_decode_nan_slots_ragged_splits(hq: int, h: int, d: int, p: int, q_dtype: torch.dtype) -> None:
    # fp8_kernel="fused": both formats' splits in one grid. 8 FP8 splits over 1-24 pages (empty splits,
    # a split ending inside a request's last page, chunks wholly past it), e4m3 NaN in every slot past
    # a request's last token (zero-filled by the copy), a request without FP8 pages and one without TQ3
    # pages; then the same plan replayed from a CUDA graph must give the eager run's bits
    from kv_fixtures import make_batch

    batch = make_batch(hq, h, d, p, [3, 1, 0, 24, 2], [2, 1, 5, 0, 9], [5, p, 0, 3, p // 2 + 1], seed=hq + 31, unused_slot_byte=0x7F)
    batch.q = batch.q.to(q_dtype)
    wrapper = _wrapper(hq, h, d, p, "fused", q_dtype=q_dtype)
    out, lse = _run_poisoned(wrapper, batch, num_splits=5, num_fp8_splits=8)
    assert isinstance(wrapper.decode, FusedDecode) and wrapper.fp8_plan.num_splits == 8 and wrapper.tq3_plan.num_splits == 5
    _check(batch, out, lse, hq, d)
    eager_out, eager_lse = out.clone(), lse.clone()
    args = (batch.q, (batch.k_fp8.view(torch.float8_e4m3fn), batch.v_fp8.view(torch.float8_e4m3fn)), batch.tq3_pages, batch.rotation.signs.cuda())
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        wrapper.run(*args, k_scale=batch.k_scale, v_scale=batch.v_scale)
        with torch.cuda.graph(graph, stream=stream):
            wrapper.run(*args, k_scale=batch.k_scale, v_scale=batch.v_scale)
    for buf in (wrapper.tq3_plan.out_partial, wrapper.fp8_plan.out_partial, wrapper.decode.out.out, wrapper.decode.out.lse):
        buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(wrapper.decode.out.out.view(torch.int16), eager_out.view(torch.int16)) and torch.equal(wrapper.decode.out.lse, eager_lse)


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_fused_decode_many_splits_is_the_default(hq: int, h: int, d: int, p: int) -> None:
    # fp8_kernel="auto" takes the fused decode; its epilogue combines 40 TQ3 and 24 FP8 splits per head
    # (9 of them empty) in one pass
    from kv_fixtures import make_batch

    batch = make_batch(hq, h, d, p, [30, 2], [200, 7], [p - 1, 4], seed=hq + 41)
    wrapper = _wrapper(hq, h, d, p, "auto")
    out, lse = _run_poisoned(wrapper, batch, num_splits=40, num_fp8_splits=24)
    assert isinstance(wrapper.decode, FusedDecode)
    _check(batch, out, lse, hq, d)


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_fused_plan_shares_one_wave(hq: int, h: int, d: int, p: int) -> None:
    # the library's split counts (choose_mixed_splits) for a single long request and a batch of three
    from kv_fixtures import make_batch
    from minima_kernels import tile_config
    from minima_kernels.heuristics import choose_mixed_splits

    wrapper = _wrapper(hq, h, d, p, "fused")
    for fp8_pages, tq3_pages, last in (([12], [150], [p - 5]), ([1, 3, 2], [20, 1, 33], [1, p - 1, 7])):
        batch = make_batch(hq, h, d, p, fp8_pages, tq3_pages, last, seed=hq + len(last))
        _check(batch, *_run_poisoned(wrapper, batch), hq, d)
        build = tile_config(hq // h, p, d, len(last))
        assert (wrapper.tq3_plan.num_splits, wrapper.fp8_plan.num_splits) == choose_mixed_splits(
            len(last), h, max(tq3_pages), max(fp8_pages), p, build, head_dim=d
        )


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_single_request_takes_its_own_build(hq: int, h: int, d: int, p: int) -> None:
    # tile_config(batch=1): one wrapper re-planned from one request to three and back switches TQ3
    # builds, and each plan's outputs match the reference
    from kv_fixtures import make_batch
    from minima_kernels import tile_config

    wrapper = _wrapper(hq, h, d, p, "tilelang")
    one = make_batch(hq, h, d, p, [3], [45], [p - 2], seed=hq + 11)
    three = make_batch(hq, h, d, p, [1, 3, 2], [20, 0, 33], [1, p - 1, 7], seed=hq + 12)
    for batch, size in ((one, 1), (three, 3), (one, 1)):
        _check(batch, *_run_poisoned(wrapper, batch), hq, d)
        build = tile_config(hq // h, p, d, size)
        assert wrapper.tq3_build == build
        assert f"__launch_bounds__({32 * build['warps']}, {build['min_blocks']})" in wrapper.decode.tq3_kernel.get_kernel_source()
    assert wrapper.builds["tq3"] == (1 if d == 128 else 2)


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_fp8_build_follows_split_length(hq: int, h: int, d: int, p: int) -> None:
    # fp8_tile_config: a single request with 400 FP8 pages has splits of 13 / 25 / 10 pages (head dims
    # 256 / 128 / 64), so the TileLang FP8 decode takes 2 pages per step at head dims <= 128; 3 requests
    # of few pages go back to 1 page per step; each plan's outputs match the reference
    from kv_fixtures import make_batch
    from minima_kernels.heuristics import choose_fp8_splits, fp8_tile_config

    wrapper = _wrapper(hq, h, d, p, "tilelang")
    long_one = make_batch(hq, h, d, p, [400], [40], [p - 3], seed=hq + 21)
    three = make_batch(hq, h, d, p, [3, 1, 2], [2, 1, 3], [5, p, 1], seed=hq + 22)
    for batch, size, max_pages, two_pages in ((long_one, 1, 400, d <= 128), (three, 3, 3, False), (long_one, 1, 400, d <= 128)):
        _check(batch, *_run_poisoned(wrapper, batch), hq, d)
        splits = choose_fp8_splits(size, h, max_pages)
        assert wrapper.fp8_plan.num_splits == splits
        assert wrapper.fp8_build == fp8_tile_config(p, d, math.ceil(max_pages / splits))
        assert wrapper.fp8_build["pages_per_step"] == (2 if two_pages else 1)
    assert wrapper.builds["fp8"] == (2 if d <= 128 else 1)


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_compile_builds_every_kernel_plan_picks(hq: int, h: int, d: int, p: int) -> None:
    # compile() ahead of serving: afterwards plans of one request and of batches, short and long,
    # on every path "auto" takes, build nothing more; run() before a new plan is refused
    from kv_fixtures import make_batch

    wrapper = _wrapper(hq, h, d, p, "auto")
    made = wrapper.compile()
    assert made == sum(wrapper.builds.values()) > 0
    q = torch.zeros(1, hq, d, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(q, None, None, torch.ones(h, d, device="cuda"))
    assert wrapper.compile() == 0
    sizes = dict(wrapper.builds)
    cases = [
        ([3], [45], [p - 2]),
        ([400], [40], [p - 3]),
        ([1, 3, 2], [20, 0, 33], [1, p - 1, 7]),
        ([2] * 32, [64] * 32, [5] * 32),
        ([300] * 4, [8] * 4, [p] * 4),
    ]
    for seed, (fp8_pages, tq3_pages, last) in enumerate(cases):
        batch = make_batch(hq, h, d, p, fp8_pages, tq3_pages, last, seed=hq + 40 + seed)
        _check(batch, *_run_poisoned(wrapper, batch), hq, d)
    assert wrapper.builds == sizes


def test_long_context_many_splits() -> None:
    from kv_fixtures import make_batch

    hq, h, d, p = GEOMETRIES[0]
    batch = make_batch(hq, h, d, p, [2], [301], [37], seed=4)
    wrapper = _wrapper(hq, h, d, p)
    out, lse = _run_poisoned(wrapper, batch)
    assert wrapper.tq3_plan.num_splits > 1
    _check(batch, out, lse, hq, d)


@pytest.mark.parametrize("fp8_kernel", ["flashinfer", "tilelang", "fused"])
@pytest.mark.parametrize("layer", [1, 15, 29])
def test_mixed_decode_on_captured_smollm2_kv(layer: int, fp8_kernel: str) -> None:
    # real post-RoPE K/V and query of SmolLM2-135M-Instruct (test/gpu/capture_smollm2_kv.py): 1,024
    # tokens of text, 12 of 16 pages Stale (TQ3), the 4 most recent FP8, as the tiers would hold them
    from pathlib import Path

    from kv_fixtures import batch_from_kv

    data = torch.load(Path(__file__).parent / "data" / "smollm2_qkv.pt")["layers"][layer]
    hq, d = data["q_last"].shape
    h = data["k"].shape[1]
    batch = batch_from_kv(data["q_last"], data["k"], data["v"], 64, 12, layer_id=layer)
    wrapper = _wrapper(hq, h, d, 64, fp8_kernel)
    out, lse = _run_poisoned(wrapper, batch)
    _check(batch, out, lse, hq, d, sm_scale=data["sm_scale"])


@pytest.mark.parametrize("num_splits", [1, 7, 300, 1024])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_split_combine_matches_torch(d: int, num_splits: int) -> None:
    # the shared-memory combine over up to MAX_SPLITS splits, with empty splits (-inf) and one head
    # whose splits are all empty (out 0, lse -inf)
    from minima_kernels import tq3_merge_splits

    gen = torch.Generator(device="cuda").manual_seed(num_splits + d)
    batch, heads = 3, 5
    out_partial = torch.randn(batch, heads, num_splits, d, device="cuda", generator=gen)
    lse_partial = 8 * torch.randn(batch, heads, num_splits, device="cuda", generator=gen)
    lse_partial[torch.rand(batch, heads, num_splits, device="cuda", generator=gen) < 0.3] = float("-inf")
    lse_partial[0, 0, 0] = 1.0  # at least one live split in each head but [1, 2]
    lse_partial[:, :, -1] = torch.where(torch.isinf(lse_partial).all(-1), 2.0, lse_partial[:, :, -1])
    lse_partial[1, 2] = float("-inf")
    out = torch.full((batch, heads, d), float("nan"), device="cuda")
    lse = torch.full((batch, heads), float("nan"), device="cuda")
    tq3_merge_splits(heads, d)(out_partial, lse_partial, out, lse)
    ref_lse = torch.logsumexp(lse_partial * math.log(2), dim=-1) / math.log(2)
    weights = torch.exp2(lse_partial - ref_lse.unsqueeze(-1)).nan_to_num(0.0)
    ref_out = (weights.unsqueeze(-1) * out_partial).sum(2)
    live = torch.isfinite(ref_lse)
    assert not bool(live[1, 2]) and int(live.sum()) == batch * heads - 1
    assert float((out[live] - ref_out[live]).abs().max()) < 1e-5
    assert float((lse[live] - ref_lse[live]).abs().max()) < 1e-5
    assert bool((out[1, 2] == 0).all()) and float(lse[1, 2]) == float("-inf")


@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_glue_rotations_are_the_codecs(hq: int, h: int, d: int, p: int) -> None:
    # the glue kernels' Hadamard transforms run the codec's butterflies in its order, built without
    # FMA contraction: q' is the codec's rotate rounded to fp16, and with one split and no FP8 state
    # the epilogue's output is the codec's unrotate of the partial (exp2(0) = 1) rounded to bf16
    from minima_kernels import mixed_epilogue_kernel, rotate_queries_kernel
    from sglang_minima.codec import LayerRotation

    g = hq // h
    rotation = LayerRotation(h, d, layer_id=2, seed=11, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(d + 2)
    q = (3 * torch.randn(5, hq, d, device="cuda", generator=gen)).to(torch.bfloat16)
    q_rot = torch.full((5, hq, d), float("nan"), dtype=torch.float16, device="cuda")
    rotate_queries_kernel(hq, g, d, "bfloat16")(q, rotation.signs, q_rot)
    ref = rotation.rotate(q, head_axis=1).to(torch.float16)
    assert bool((q_rot.view(torch.int16) == ref.view(torch.int16)).all())

    partial = torch.randn(5, hq, 1, d, device="cuda", generator=gen)
    lse_partial = torch.randn(5, hq, 1, device="cuda", generator=gen)
    out = torch.full((5, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((5, hq), float("nan"), device="cuda")
    no_fp8_out, no_fp8_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))  # not read
    mixed_epilogue_kernel(hq, g, d, "none", "bfloat16")(
        partial, lse_partial, rotation.signs, no_fp8_out, no_fp8_lse, out, lse
    )
    ref = rotation.unrotate(partial[:, :, 0], head_axis=1).to(torch.bfloat16)
    assert bool((out.view(torch.int16) == ref.view(torch.int16)).all())
    assert bool((lse == lse_partial[:, :, 0]).all())


KEY_FORMATS = pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True), (3, True)],
                                      ids=["k3", "k4", "k4-center", "k3-center"])


@KEY_FORMATS
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_fp8_to_tq3_is_bit_identical(hq: int, h: int, d: int, p: int, key_bits: int, key_center: bool) -> None:
    from kv_fixtures import fp8_pages, tq3_pages_from
    from minima_kernels import fp8_to_tq3
    from sglang_minima.codec import LayerRotation, TQ3PageLayout, page_fields

    gen = torch.Generator(device="cuda").manual_seed(d)
    layout = TQ3PageLayout(h, p, d, key_bits, key_center)
    rotation = LayerRotation(h, d, layer_id=3, seed=7, device="cuda")
    k_scale, v_scale = 0.37, 0.29  # non-power-of-two scales: the dequant multiply rounds
    k = fp8_pages(12, p, h, d, k_scale, gen, "cuda")
    v = fp8_pages(12, p, h, d, v_scale, gen, "cuda")
    k[0, 0, 0] = 0  # an all-zero key and value: the codec's zero-norm / zero-scale branches
    v[0, 0, 0] = 0
    src = torch.tensor([5, 0, 11, 3, 7], dtype=torch.int32, device="cuda")
    dst = torch.tensor([2, 6, 0, 4, 1], dtype=torch.int32, device="cuda")
    pool = torch.full((8, layout.page_bytes), 0xAB, dtype=torch.uint8, device="cuda")
    fp8_to_tq3(k, v, src, dst, pool, rotation, k_scale=k_scale, v_scale=v_scale, key_bits=key_bits, key_center=key_center)
    torch.cuda.synchronize()
    ref = tq3_pages_from(k[src.long()], v[src.long()], layout, rotation, k_scale, v_scale)
    got = pool[dst.long()]
    print(f"fp8_to_tq3: {int((got != ref).sum())} of {ref.numel()} bytes differ")
    mine, theirs = page_fields(got, layout), page_fields(ref, layout)
    # every field, v_zero included: codec and kernel both store a zero min / max as +0.0
    for name in ("k_codes", "v_codes", "k_norm", "v_scale", "v_zero") + (("k_mean",) if key_center else ()):
        a, b = getattr(mine, name), getattr(theirs, name)
        assert bool((a.view(torch.uint8) == b.view(torch.uint8)).all()), (
            f"{name} differs at {(a.view(torch.uint8) != b.view(torch.uint8)).nonzero()[:8].tolist()}"
        )
    assert bool((got == ref).all())
    assert int(mine.v_zero[1, 0, 0].view(torch.int16)) == 0  # src page 0 holds the all-zero value row: +0.0
    untouched = [i for i in range(8) if i not in dst.tolist()]
    assert bool((pool[untouched] == 0xAB).all())


def _encoded_tq3_pages(h: int, p: int, d: int, *, seed: int, layer_id: int, key_bits: int = 3, key_center: bool = False):
    """(layout, rotation, 6 TQ3 pages) encoded by the codec from FP8 pages at scales 0.5 / 0.25."""
    from kv_fixtures import fp8_pages, tq3_pages_from
    from sglang_minima.codec import LayerRotation, TQ3PageLayout

    gen = torch.Generator(device="cuda").manual_seed(seed)
    layout = TQ3PageLayout(h, p, d, key_bits, key_center)
    rotation = LayerRotation(h, d, layer_id=layer_id, seed=5, device="cuda")
    tq3 = tq3_pages_from(
        fp8_pages(6, p, h, d, 0.5, gen, "cuda"), fp8_pages(6, p, h, d, 0.25, gen, "cuda"), layout, rotation, 0.5, 0.25
    )
    return layout, rotation, tq3


@KEY_FORMATS
@pytest.mark.parametrize("k_scale,v_scale", [(0.5, 0.25), (0.37, 0.29)])  # powers of two, and scales that round
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_tq3_to_fp8_is_bit_identical(hq: int, h: int, d: int, p: int, k_scale: float, v_scale: float, key_bits: int,
                                     key_center: bool) -> None:
    from minima_kernels import tq3_to_fp8
    from sglang_minima.codec import decode_pages, fp8_requantize, key_codebook, to_original_space

    layout, rotation, tq3 = _encoded_tq3_pages(h, p, d, seed=d + 1, layer_id=1, key_bits=key_bits, key_center=key_center)
    src = torch.tensor([4, 1, 5], dtype=torch.int32, device="cuda")
    dst = torch.tensor([0, 3, 2], dtype=torch.int32, device="cuda")
    k_cache = torch.full((5, p, h, d), 0x7F, dtype=torch.uint8, device="cuda")
    v_cache = torch.full((5, p, h, d), 0x7F, dtype=torch.uint8, device="cuda")
    tq3_to_fp8(tq3, src, dst, k_cache, v_cache, rotation, k_scale=k_scale, v_scale=v_scale, key_bits=key_bits,
               key_center=key_center)
    torch.cuda.synchronize()
    k_rot, v_rot = decode_pages(tq3[src.long()], layout, key_codebook(d, key_bits))
    ref_k = fp8_requantize(to_original_space(k_rot, rotation), k_scale).transpose(1, 2)
    ref_v = fp8_requantize(to_original_space(v_rot, rotation), v_scale).transpose(1, 2)
    bad_k = int((k_cache[dst.long()] != ref_k).sum())
    bad_v = int((v_cache[dst.long()] != ref_v).sum())
    print(f"tq3_to_fp8: {bad_k} K and {bad_v} V bytes differ of {ref_k.numel()} each")
    assert bad_k == 0 and bad_v == 0
    assert bool((k_cache[[1, 4]] == 0x7F).all())


@KEY_FORMATS
@pytest.mark.parametrize("hq,h,d,p", GEOMETRIES)
def test_tq3_to_bf16_heads_equals_the_codec(hq: int, h: int, d: int, p: int, key_bits: int, key_center: bool) -> None:
    # the prefill's TQ3 tile: the promotion kernel's decode and un-rotation (the codec's fp32 values)
    # cast to bf16, head-major, the c-th listed page at tokens c * P; tokens past the list untouched
    from minima_kernels import PageConversions
    from sglang_minima.codec import decode_pages, key_codebook, to_original_space

    layout, rotation, tq3 = _encoded_tq3_pages(h, p, d, seed=d + 3, layer_id=2, key_bits=key_bits, key_center=key_center)
    src = torch.tensor([4, 1, 5], dtype=torch.int32, device="cuda")
    k_out = torch.full((h, 4 * p, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_out = torch.full_like(k_out, float("nan"))
    PageConversions(h, p, d, key_bits, key_center).tq3_to_bf16_heads(tq3, src, k_out, v_out, rotation.signs)
    torch.cuda.synchronize()
    k_rot, v_rot = decode_pages(tq3[src.long()], layout, key_codebook(d, key_bits))  # [n, H, P, D]
    for got, x in ((k_out, k_rot), (v_out, v_rot)):
        ref = to_original_space(x, rotation).to(torch.bfloat16).transpose(0, 1).reshape(h, 3 * p, d)
        bad = int((got[:, : 3 * p].view(torch.int16) != ref.view(torch.int16)).sum())
        assert bad == 0, f"{bad} of {ref.numel()} bf16 values differ from the codec's"
        assert bool(got[:, 3 * p :].isnan().all())
