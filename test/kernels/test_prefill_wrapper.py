"""MinimaPrefillWrapper's plumbing on CPU: FlashInfer replaced by a stand-in that follows its contract
(plan from host index pointers; ragged: causal within each request's new tokens, or a TQ3 tile's
head-major keys all visible, rows without keys undefined; paged: every listed slot visible; out in
q's dtype, base-2 LSE [T, Hq]; the in-place merge: contiguous operands, fp32 LSE, masked rows untouched), the TQ3 decode real (the torch codec,
or in place of the TileLang tile decoder the codec writing the same bf16 tiles). Against the torch
reference (mixed_paged_attention, causal by position) on the same keys. On the device,
test/attention/test_minima_backend.py runs the real FlashInfer."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages, to_original_space
from sglang_minima.ops.dense import attend, causal_mask
from sglang_minima.ops.merge import merge_attention_states
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention

H, HQ, D, PS = 2, 4, 64, 16
SM = D**-0.5
K_SCALE, V_SCALE = 0.5, 0.25


class _Ragged:
    """The new tokens' wrapper (NHD, causal, keys = queries) or a TQ3 tile's (HND keys [H, kv, D], fa2,
    every key visible): what MinimaPrefillWrapper builds. One plan per wrapper, as FlashInfer keeps it."""

    def __init__(self, workspace, layout, backend):
        assert (layout, backend) in (("NHD", "auto"), ("HND", "fa2")), (layout, backend)
        self.layout = layout

    def reset_workspace_buffer(self, float_workspace, int_workspace):
        assert int_workspace.dtype == torch.uint8 and int_workspace.device == float_workspace.device

    def plan(self, qo_indptr, kv_indptr, hq, h, d, *, causal, sm_scale, q_data_type, kv_data_type=None):
        assert qo_indptr.device.type == kv_indptr.device.type == "cpu"
        assert causal == (self.layout == "NHD") and qo_indptr.numel() == kv_indptr.numel()
        self.qo, self.kv, self.sm = qo_indptr.tolist(), kv_indptr.tolist(), sm_scale
        self.shape, self.dtypes = (hq, h, d), (q_data_type, kv_data_type or q_data_type)

    def run(self, q, k, v, return_lse):
        # what run() checks against the plan: q's rows, q's and k's dtypes; the heads it was planned for
        assert q.is_contiguous() and (q.dtype, k.dtype) == self.dtypes and v.dtype == k.dtype
        if self.layout == "HND":  # keys and values head-major: [H, kv, D], read by their strides
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        assert q.shape[0] == self.qo[-1] and k.shape[0] == self.kv[-1]
        assert (q.shape[1], k.shape[1], q.shape[2]) == self.shape and k.shape[2] == self.shape[2]
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("-inf"))  # no keys: undefined
        for i, (a, b) in enumerate(zip(self.qo, self.qo[1:])):
            ka, kb = self.kv[i], self.kv[i + 1]
            if kb == ka:
                continue
            mask = causal_mask(torch.arange(b - a), torch.arange(kb - ka)) if self.layout == "NHD" else None
            o, s = attend(q[a:b], k[ka:kb], v[ka:kb], self.sm, mask)
            out[a:b], lse[a:b] = o.to(q.dtype), s
        return out, lse


class _Paged:
    def __init__(self, workspace, layout, backend):
        assert layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, h, d, page_size, *, causal, sm_scale,
             q_data_type, kv_data_type):
        assert qo_indptr.device.type == kv_indptr.device.type == "cpu" and page_size == 1 and not causal
        assert last_page_len.tolist() == [1] * (qo_indptr.numel() - 1)
        self.qo, self.kv, self.slots, self.sm = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.long(), sm_scale

    def run(self, q, kv_cache, k_scale, v_scale, return_lse):
        k_cache, v_cache = kv_cache
        out = torch.full_like(q, float("nan"))  # rows without keys: whatever the kernel leaves
        lse = torch.full(q.shape[:2], 7.0)
        for i, (a, b) in enumerate(zip(self.qo, self.qo[1:])):
            s = self.slots[self.kv[i] : self.kv[i + 1]]
            if s.numel():
                k = fp8_dequantize(k_cache[s, 0], k_scale)
                v = fp8_dequantize(v_cache[s, 0], v_scale)
                o, l = attend(q[a:b], k, v, self.sm)
                out[a:b], lse[a:b] = o.to(q.dtype), l
        return out, lse


def _merge_state_in_place(v, s, v_other, s_other, mask=None):
    # the kernel's checks (CHECK_INPUT: contiguous), and an LSE it can update in place (fp32: flashinfer
    # casts any other dtype to a copy, and the merge would be lost); the head dims it is built for, one
    # block of threads; a bool mask on v's device (the kernel reads its bytes)
    assert all(t.is_contiguous() for t in (v, s, v_other, s_other)) and s.dtype == s_other.dtype == torch.float32
    assert v.dtype == v_other.dtype  # one template type for both states
    assert v.shape[-1] in (64, 128, 256, 512) and v.shape[1] * v.shape[-1] // max(8, v.shape[-1] // 32) <= 1024
    assert mask is None or (mask.dtype == torch.bool and mask.device == v.device)
    # as the kernel computes it: weights times outputs (a zero weight on a NaN output is NaN)
    m = torch.maximum(s, s_other)
    w, w_other = torch.exp2(s - m), torch.exp2(s_other - m)
    total = w + w_other
    merged = (v.float() * (w / total).unsqueeze(-1) + v_other.float() * (w_other / total).unsqueeze(-1)).to(v.dtype)
    keep = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask
    v[keep], s[keep] = merged[keep], (m + torch.log2(total))[keep]


class _CodecTiles:
    """PageConversions.tq3_to_bf16_heads by the torch codec: pages decoded and un-rotated into k_out /
    v_out [H, m, D] bf16, page c in tokens c * P .. (its poison beyond what it writes)."""

    def __init__(self, layout, codebook, rotation):
        self.layout, self.codebook, self.rotation = layout, codebook, rotation

    def tq3_to_bf16_heads(self, tq3_pages, src_pages, k_out, v_out, signs):
        k, v = decode_pages(tq3_pages[src_pages.long()], self.layout, self.codebook)  # [n, H, P, D] rotated
        n = src_pages.numel() * self.layout.page_size
        k_out.fill_(float("nan")), v_out.fill_(float("nan"))  # a tile's tail is never read
        for out, x in ((k_out, k), (v_out, v)):
            out[:, :n] = to_original_space(x, self.rotation).transpose(0, 1).reshape(out.shape[0], n, -1).to(out.dtype)


@pytest.fixture(params=["standin", pytest.param("cuda", marks=pytest.mark.gpu)])
def prefill(request, monkeypatch):
    """(minima_kernels.prefill, device): over the FlashInfer stand-in on CPU, or the real one on CUDA."""
    if request.param == "cuda":
        yield importlib.import_module("minima_kernels.prefill"), torch.device("cuda")
        return
    fake = types.SimpleNamespace(
        BatchPrefillWithRaggedKVCacheWrapper=_Ragged, BatchPrefillWithPagedKVCacheWrapper=_Paged,
        merge_state_in_place=_merge_state_in_place,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delitem(sys.modules, "minima_kernels.prefill", raising=False)
    yield importlib.import_module("minima_kernels.prefill"), torch.device("cpu")
    sys.modules.pop("minima_kernels.prefill", None)


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    layout, rot, cb = TQ3PageLayout(H, PS, D), LayerRotation(H, D, layer_id=3), tq3_codebook(D)
    k8 = fp8_quantize(torch.randn(200, H, D, generator=g), K_SCALE)
    v8 = fp8_quantize(torch.randn(200, H, D, generator=g), V_SCALE)
    tq3 = encode_pages(torch.randn(6, H, PS, D, generator=g), torch.randn(6, H, PS, D, generator=g), layout, rot, cb)
    return g, layout, rot, cb, k8, v8, tq3


@pytest.mark.parametrize("tiles,tile_pages,dtype", [
    ("default", 1, torch.bfloat16), ("tile_decoder", 1, torch.bfloat16), ("tile_decoder", 2, torch.bfloat16),
    ("tile_decoder", 2, torch.float16),  # an fp16 model: its queries meet the bf16 tile
])
def test_three_parts_merged_equal_the_torch_reference(prefill, tiles, tile_pages, dtype):
    prefill, dev = prefill
    if tiles == "tile_decoder" and dev.type == "cuda":
        pytest.skip("on the device the default is the TileLang tile decoder")
    g, layout, rot, cb, k8, v8, tq3 = _setup()
    # request 0: hot sink 0..15 (slots 100..115), TQ3 pages 16..47 (ids 4, 1), hot 48..52, new 53..59
    # request 1: a fresh prompt of 6 tokens (slots 150..155): no hot prefix, no TQ3
    # request 2: TQ3 page 0..15 (id 5), new 16..19 (slots 60..63): no hot prefix
    reqs = [
        dict(hot=list(range(100, 116)) + list(range(116, 121)), new=list(range(121, 128)), tq3=[4, 1], tq3_at=16),
        dict(hot=[], new=list(range(150, 156)), tq3=[], tq3_at=0),
        dict(hot=[], new=list(range(60, 64)), tq3=[5], tq3_at=0),
    ]
    q_lens = [len(r["new"]) for r in reqs]
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    # the new tokens' K/V as the forward hands them: the FP8 pages' values, so both paths see the same keys
    new_slots = torch.tensor([s for r in reqs for s in r["new"]])
    k_new = fp8_dequantize(k8[new_slots], K_SCALE).to(dtype)
    v_new = fp8_dequantize(v8[new_slots], V_SCALE).to(dtype)

    w = prefill.MinimaPrefillWrapper(_workspace(dev), HQ, H, D, PS, sm_scale=SM, tile_tokens=tile_pages * PS, q_dtype=dtype)
    # the kernel path over the codec's tiles: tiles of one page (request 0 merges two), or of two
    # (request 2 reads the first page of a two-page tile, whose tail is poison)
    if tiles == "tile_decoder":
        w._dequant = _CodecTiles(layout, cb, rot)
    qo = torch.tensor([0, 7, 13, 17], dtype=torch.int32)
    prefix = torch.tensor([0, 21, 21, 21], dtype=torch.int32)
    rows = torch.tensor([True] * 7 + [False] * 10, device=dev)
    segs = (prefill.Tq3Segment(0, 7, torch.tensor([4, 1], device=dev)), prefill.Tq3Segment(13, 4, torch.tensor([5], device=dev)))
    w.plan(qo, prefix, torch.tensor(reqs[0]["hot"], dtype=torch.int32, device=dev), rows, segs)
    hot = (_fp8(k8, dev).view(-1, 1, H, D), _fp8(v8, dev).view(-1, 1, H, D))
    rot_dev = LayerRotation(H, D, layer_id=3, device=dev)  # the pool's rotation lives on its device
    got = w.run(q.to(dev), k_new.to(dev), v_new.to(dev), hot, tq3.to(dev), layout, cb, rot_dev, k_scale=K_SCALE, v_scale=V_SCALE)
    assert got.dtype == dtype and got.shape == q.shape and not got.isnan().any()
    _check_against_the_torch_reference(got.cpu(), q, reqs, k8, v8, tq3, layout, cb, rot)


def _check_against_the_torch_reference(got, q, reqs, k8, v8, tq3, layout, cb, rot):
    """Each request's rows against mixed_paged_attention (causal by position) over its hot slots (a
    sink page's 16 tokens and a 5-token tail around its TQ3 pages, or none), its TQ3 pages (first at
    position ``tq3_at``) and its new tokens."""
    start = 0
    for r in reqs:
        n = len(r["new"])
        hot_slots = torch.tensor(r["hot"] + r["new"], dtype=torch.int64)
        tq3_tokens = PS * len(r["tq3"])
        positions = torch.cat([torch.arange(len(r["hot"]) - 5), torch.arange(5) + tq3_tokens + len(r["hot"]) - 5]) \
            if r["tq3"] and r["hot"] else torch.arange(len(r["hot"])) + tq3_tokens
        hot_pos = torch.cat([positions, torch.arange(n) + tq3_tokens + len(r["hot"])])
        q_pos = hot_pos[-n:]
        want, _ = mixed_paged_attention(
            q[start : start + n].float(),
            HotPagedKV(k8, v8, hot_slots, hot_pos, K_SCALE, V_SCALE),
            Tq3PagedKV(tq3, torch.tensor(r["tq3"], dtype=torch.int64), layout, cb,
                       torch.arange(len(r["tq3"]), dtype=torch.int64) * PS + r["tq3_at"]),
            rot, SM, q_pos,
        )
        torch.testing.assert_close(got[start : start + n].float(), want, atol=2e-2, rtol=2e-2)
        start += n


@pytest.mark.parametrize("tile_pages,tiles", [
    (1, [((0, 7), [4], None), ((0, 7), [1], None), ((7, 10), [5], None), ((7, 10), [0], None), ((7, 10), [3], None),
         ((15, 19), [2], None)]),
    (3, [((0, 10), [4, 1, 5], None), ((7, 19), [0, 3, 2], [True] * 3 + [False] * 5 + [True] * 4)]),
    (6, [((0, 19), [4, 1, 5, 0, 3, 2], [True] * 10 + [False] * 5 + [True] * 4)]),
])
def test_tiles_hold_the_batchs_tq3_pages_in_request_order(prefill, tile_pages, tiles):
    # A (rows 0-6): hot sink, TQ3 pages 4, 1, hot tail; B (rows 7-9): TQ3 pages 5, 0, 3; C (rows 10-14):
    # a fresh prompt; D (rows 15-18): TQ3 page 2. A tile takes pages in request order up to its size
    # (a request continues in the next); C's rows inside a tile read no keys there and are masked out.
    prefill, dev = prefill
    g, layout, rot, cb, k8, v8, tq3 = _setup(5)
    reqs = [
        dict(hot=list(range(100, 116)) + list(range(116, 121)), new=list(range(121, 128)), tq3=[4, 1], tq3_at=16),
        dict(hot=[], new=list(range(130, 133)), tq3=[5, 0, 3], tq3_at=0),
        dict(hot=[], new=list(range(150, 155)), tq3=[], tq3_at=0),
        dict(hot=[], new=list(range(60, 64)), tq3=[2], tq3_at=0),
    ]
    q = torch.randn(19, HQ, D, generator=g).to(torch.bfloat16)
    new_slots = torch.tensor([s for r in reqs for s in r["new"]])
    k_new = fp8_dequantize(k8[new_slots], K_SCALE).to(torch.bfloat16)
    v_new = fp8_dequantize(v8[new_slots], V_SCALE).to(torch.bfloat16)
    w = prefill.MinimaPrefillWrapper(_workspace(dev), HQ, H, D, PS, sm_scale=SM, tile_tokens=tile_pages * PS)
    if dev.type != "cuda":
        w._dequant = _CodecTiles(layout, cb, rot)
    segs = (prefill.Tq3Segment(0, 7, torch.tensor([4, 1], device=dev)),
            prefill.Tq3Segment(7, 3, torch.tensor([5, 0, 3], device=dev)),
            prefill.Tq3Segment(15, 4, torch.tensor([2], device=dev)))
    w.plan(torch.tensor([0, 7, 10, 15, 19], dtype=torch.int32), torch.tensor([0, 21, 21, 21, 21], dtype=torch.int32),
           torch.tensor(reqs[0]["hot"], dtype=torch.int32, device=dev), torch.tensor([True] * 7 + [False] * 12, device=dev),
           segs)
    got_tiles = [((t.rows.start, t.rows.stop), t.pages.tolist(), None if t.mask is None else t.mask.tolist())
                 for t in w._tq3_tiles]
    assert got_tiles == tiles
    hot = (_fp8(k8, dev).view(-1, 1, H, D), _fp8(v8, dev).view(-1, 1, H, D))
    rot_dev = LayerRotation(H, D, layer_id=3, device=dev)
    got = w.run(q.to(dev), k_new.to(dev), v_new.to(dev), hot, tq3.to(dev), layout, cb, rot_dev, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not got.isnan().any()
    _check_against_the_torch_reference(got.cpu(), q, reqs, k8, v8, tq3, layout, cb, rot)
    # the next step's plan, fewer tiles: each wrapper kept, the tiles re-planned
    wrappers = list(w._tile_wrappers)
    w.plan(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
           torch.zeros(0, dtype=torch.int32, device=dev), None, (prefill.Tq3Segment(0, 4, torch.tensor([2], device=dev)),))
    assert w._tile_wrappers == wrappers and [t.pages.tolist() for t in w._tq3_tiles] == [[2]]


@pytest.mark.parametrize("tiles", ["default", "tile_decoder"])
def test_a_shared_tq3_prefix_is_one_segment_over_its_requests_rows(prefill, tiles):
    """Two consecutive requests reading the same TQ3 pages (a radix hit on a Stale prefix), given as
    one segment over both requests' rows (forward_plan.split_extend): the pages are decoded into one
    tile once, and each request's rows still attend what the torch reference attends."""
    prefill, dev = prefill
    if tiles == "tile_decoder" and dev.type == "cuda":
        pytest.skip("on the device the default is the TileLang tile decoder")
    g, layout, rot, cb, k8, v8, tq3 = _setup(7)
    reqs = [dict(hot=[], new=list(range(121, 126)), tq3=[4, 1], tq3_at=0),
            dict(hot=[], new=list(range(130, 133)), tq3=[4, 1], tq3_at=0)]
    q = torch.randn(8, HQ, D, generator=g).to(torch.bfloat16)
    new_slots = torch.tensor([s for r in reqs for s in r["new"]])
    k_new = fp8_dequantize(k8[new_slots], K_SCALE).to(torch.bfloat16)
    v_new = fp8_dequantize(v8[new_slots], V_SCALE).to(torch.bfloat16)
    w = prefill.MinimaPrefillWrapper(_workspace(dev), HQ, H, D, PS, sm_scale=SM, tile_tokens=2 * PS)
    if tiles == "tile_decoder":
        w._dequant = _CodecTiles(layout, cb, rot)
    w.plan(torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
           torch.zeros(0, dtype=torch.int32, device=dev), None, (prefill.Tq3Segment(0, 8, torch.tensor([4, 1], device=dev)),))
    if w._dequant is not None:
        assert [((t.rows.start, t.rows.stop), t.pages.tolist(), t.mask) for t in w._tq3_tiles] == [((0, 8), [4, 1], None)]
    hot = (_fp8(k8, dev).view(-1, 1, H, D), _fp8(v8, dev).view(-1, 1, H, D))
    rot_dev = LayerRotation(H, D, layer_id=3, device=dev)
    got = w.run(q.to(dev), k_new.to(dev), v_new.to(dev), hot, tq3.to(dev), layout, cb, rot_dev, k_scale=K_SCALE, v_scale=V_SCALE)
    _check_against_the_torch_reference(got.cpu(), q, reqs, k8, v8, tq3, layout, cb, rot)


def test_no_prefix_and_no_tq3_is_the_causal_part_alone(prefill):
    prefill, dev = prefill
    g, layout, rot, cb, k8, v8, tq3 = _setup(1)
    w = prefill.MinimaPrefillWrapper(_workspace(dev), HQ, H, D, PS, sm_scale=SM)
    w.plan(torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
           torch.zeros(0, dtype=torch.int32, device=dev), None, ())
    q = torch.randn(12, HQ, D, generator=g).to(torch.bfloat16)
    k, v = torch.randn(12, H, D, generator=g).to(torch.bfloat16), torch.randn(12, H, D, generator=g).to(torch.bfloat16)
    hot = (_fp8(k8, dev).view(-1, 1, H, D), _fp8(v8, dev).view(-1, 1, H, D))
    got = w.run(q.to(dev), k.to(dev), v.to(dev), hot, tq3.to(dev), layout, cb, rot, k_scale=1.0, v_scale=1.0).cpu()
    for a, b in ((0, 5), (5, 12)):  # two prompts, each causal on its own
        pos = torch.arange(b - a)
        want, _ = attend(q[a:b].float(), k[a:b].float(), v[a:b].float(), SM, causal_mask(pos, pos))
        torch.testing.assert_close(got[a:b].float(), want, atol=1e-2, rtol=1e-2)


def _workspace(dev: torch.device) -> torch.Tensor:
    return torch.empty(128 << 20 if dev.type == "cuda" else 0, dtype=torch.uint8, device=dev)


def _fp8(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The hot buffers as the backend hands them over: e4m3 on CUDA (FlashInfer's dtype), the bits elsewhere."""
    return x.to(dev).view(torch.float8_e4m3fn) if dev.type == "cuda" else x


def test_refuses_device_index_pointers_and_a_mismatched_q(prefill):
    prefill, dev = prefill
    if dev.type == "cuda":
        pytest.skip("the checks run before any kernel: the stand-in case covers them")
    w = prefill.MinimaPrefillWrapper(torch.empty(0), HQ, H, D, PS, sm_scale=SM)
    with pytest.raises(ValueError, match="index pointers on the host"):
        w.plan(torch.tensor([0, 3], dtype=torch.int32, device="meta"), torch.tensor([0, 0], dtype=torch.int32),
               torch.zeros(0, dtype=torch.int32), None, ())
    w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
           torch.zeros(0, dtype=torch.int32), None, ())
    with pytest.raises(ValueError, match="q has 4 rows, the plan 3"):
        w.run(torch.zeros(4, HQ, D), None, None, None, None, None, None, None, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        prefill.MinimaPrefillWrapper(torch.empty(0), 3, 2, D, PS, sm_scale=SM)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_tq3_kernel_tiles_match_the_codec_tiles():
    # the TQ3 prefix decoded by the TileLang kernel (original space, bf16 tiles) against the torch
    # codec's (rotated space): one request over 6 TQ3 pages, tiles of 1, 4 and 16 pages
    prefill = importlib.import_module("minima_kernels.prefill")
    dev = torch.device("cuda")
    g, layout, rot, cb, k8, v8, tq3 = _setup(2)
    rot = LayerRotation(H, D, layer_id=3, device=dev)
    q = torch.randn(9, HQ, D, generator=g).to(torch.bfloat16).to(dev)
    k, v = (torch.randn(9, H, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))
    hot = (_fp8(k8, dev).view(-1, 1, H, D), _fp8(v8, dev).view(-1, 1, H, D))
    outs = []
    for kernel, tile in ((False, PS), (True, PS), (True, 4 * PS), (True, 16 * PS)):
        w = prefill.MinimaPrefillWrapper(_workspace(dev), HQ, H, D, PS, sm_scale=SM, tile_tokens=tile, tq3_kernel=kernel)
        w.plan(torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
               torch.zeros(0, dtype=torch.int32, device=dev), None,
               (prefill.Tq3Segment(0, 9, torch.tensor([5, 0, 3, 2, 4, 1], device=dev)),))
        outs.append(w.run(q, k, v, hot, tq3.to(dev), layout, cb, rot, k_scale=1.0, v_scale=1.0).float())
    for got in outs[1:]:
        assert not got.isnan().any()
        torch.testing.assert_close(got, outs[0], atol=1e-2, rtol=1e-2)


def test_a_head_dim_flashinfers_merge_lacks_merges_in_torch(prefill):
    # head dim 192: FlashInfer's prefill builds for it, its merge kernel does not (the stand-in refuses
    # it as the kernel would): the wrapper merges the hot prefix in torch, rows without one untouched
    prefill, dev = prefill
    if dev.type == "cuda":
        pytest.skip("the stand-in's refusal stands in for the kernel's")
    d = 192
    g = torch.Generator().manual_seed(4)
    k8 = fp8_quantize(torch.randn(40, H, d, generator=g), K_SCALE)
    v8 = fp8_quantize(torch.randn(40, H, d, generator=g), V_SCALE)
    w = prefill.MinimaPrefillWrapper(torch.empty(0), HQ, H, d, PS, sm_scale=d**-0.5)
    assert not prefill.fused_merge_fits(HQ, d, torch.bfloat16) and prefill.fused_merge_fits(HQ, 128, torch.bfloat16)
    # request 0: 10 hot prefix tokens (slots 0..9) and 3 new; request 1: 4 new, no prefix
    w.plan(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 10, 10], dtype=torch.int32),
           torch.arange(10, dtype=torch.int32), torch.tensor([True] * 3 + [False] * 4), ())
    q = torch.randn(7, HQ, d, generator=g).to(torch.bfloat16)
    k, v = torch.randn(7, H, d, generator=g).to(torch.bfloat16), torch.randn(7, H, d, generator=g).to(torch.bfloat16)
    got = w.run(q, k, v, (k8.view(-1, 1, H, d), v8.view(-1, 1, H, d)), None, None, None, None,
                k_scale=K_SCALE, v_scale=V_SCALE).float()
    prefix_k, prefix_v = fp8_dequantize(k8[:10], K_SCALE), fp8_dequantize(v8[:10], V_SCALE)
    for (a, b), (pk, pv) in (((0, 3), (prefix_k, prefix_v)), ((3, 7), (prefix_k[:0], prefix_v[:0]))):
        keys, vals = torch.cat([pk, k[a:b].float()]), torch.cat([pv, v[a:b].float()])
        n = pk.shape[0]
        visible = causal_mask(torch.arange(b - a) + n, torch.arange(n + b - a))
        want, _ = attend(q[a:b].float(), keys, vals, d**-0.5, visible)
        torch.testing.assert_close(got[a:b], want, atol=2e-2, rtol=2e-2)
