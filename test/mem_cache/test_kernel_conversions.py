"""On CUDA the store converts pages through the TileLang kernels: the same TQ3 bytes as the torch
codec's store, every layer, with FP8 scales != 1, and the same FP8 bytes once promoted back; run on
the device machine. On CPU the store's kernel wiring (views, page ids, per-layer signs and scales)
runs against a stand-in that follows the kernels' contract with the torch codec."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from sglang_minima.codec import LayerRotation, TQ3PageLayout
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.codec.fp8 import fp8_quantize, fp8_requantize
from sglang_minima.codec.tq3 import decode_pages, encode_pages, to_original_space
from sglang_minima.mem_cache import kernel_conversions
from sglang_minima.mem_cache.tier_store import StoreShape, TieredPageStore

GEOMETRIES = [(3, 64, 64), (8, 128, 64), (4, 256, 32)]  # kv heads, head dim, page size


class CodecPageConversions:
    """``minima_kernels.PageConversions``' contract (both directions), computed by the torch codec (CPU stand-in)."""

    def __init__(self, heads: int, page_size: int, head_dim: int, key_bits: int = 3, key_center: bool = False):
        self.layout = TQ3PageLayout(heads, page_size, head_dim, key_bits, key_center)
        self.codebook = key_codebook(head_dim, key_bits)

    encode_kernel = decode_kernel = "built"  # the real ones compile here

    def _rotation(self, signs):
        rotation = LayerRotation(self.layout.num_kv_heads, self.layout.head_dim, 0, 0, signs.device)
        object.__setattr__(rotation, "signs", signs)
        return rotation

    def fp8_to_tq3(self, k_cache, v_cache, src, dst, tq3_pages, signs, scales):
        assert src.dtype == dst.dtype == torch.int32 and scales.dtype == torch.float32
        k, v = (c.view(torch.uint8)[src.long()].transpose(1, 2) for c in (k_cache, v_cache))
        tq3_pages[dst.long()] = encode_pages(k, v, self.layout, self._rotation(signs), self.codebook,
                                             k_scale=float(scales[0]), v_scale=float(scales[1]))

    def tq3_to_fp8(self, tq3_pages, src, dst, k_cache, v_cache, signs, scales):
        assert src.dtype == dst.dtype == torch.int32 and scales.dtype == torch.float32
        k_rot, v_rot = decode_pages(tq3_pages[src.long()], self.layout, self.codebook)
        rotation = self._rotation(signs)
        for cache, x, scale in ((k_cache, k_rot, scales[0]), (v_cache, v_rot, scales[1])):
            x = to_original_space(x, rotation).transpose(1, 2)  # [N, P, H, D]
            cache.view(torch.uint8)[dst.long()] = fp8_requantize(x, float(scale))


def _stores(heads, dim, page_size, device, key_bits=3):
    shape = StoreShape(num_logical_pages=24, num_hot_pages=12, num_layers=3, hot_dtype=torch.float8_e4m3fn,
                       layout=TQ3PageLayout(heads, page_size, dim, key_bits))
    kern = TieredPageStore(shape, device=device, rotation_seed=11)
    ref = TieredPageStore(shape, device=device, rotation_seed=11, conversion_kernels=False)
    return shape, kern, ref


@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("heads,dim,page_size", GEOMETRIES[:2])
def test_the_stores_kernel_wiring_writes_the_torch_codecs_bytes(monkeypatch, heads, dim, page_size, key_bits):
    shape, kern, ref = _stores(heads, dim, page_size, "cpu", key_bits)
    assert kern.kernels is None  # on CPU the torch codec converts
    monkeypatch.setitem(sys.modules, "minima_kernels", types.SimpleNamespace(PageConversions=CodecPageConversions))
    kern.kernels = kernel_conversions.KernelConversions(kern)
    _check_same_bytes(shape, kern, ref, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits", [3, 4])
@pytest.mark.parametrize("heads,dim,page_size", GEOMETRIES)
def test_kernel_conversions_write_the_torch_codecs_bytes(heads, dim, page_size, key_bits):
    shape, kern, ref = _stores(heads, dim, page_size, "cuda", key_bits)
    assert kern.kernels is not None and ref.kernels is None
    _check_same_bytes(shape, kern, ref, "cuda")


def _published(*stores):
    """On CUDA the copies run on each store's side stream: wait for them and publish."""
    for store in stores:
        store.publish_conversions(wait=True)


def _check_same_bytes(shape, kern, ref, device):
    heads, dim, page_size = shape.num_kv_heads, shape.head_dim, shape.page_size
    g = torch.Generator(device=device).manual_seed(dim)
    pages = torch.arange(1, 11, device=device)
    slots = torch.arange(page_size, 11 * page_size, device=device)
    for store in (kern, ref):
        store.map_new(pages)
        store.page_table.note_written(store.page_table.hot_slots(slots))  # every page sealed
    hot = kern.page_table.hot_slots(slots)
    for layer in range(shape.num_layers):
        scales = (0.37 + 0.1 * layer, 0.29)  # non-powers of two: the dequant multiply rounds
        for buf, scale in (("hot_k", scales[0]), ("hot_v", scales[1])):
            rows = fp8_quantize(4 * torch.randn(slots.numel(), heads, dim, device=device, generator=g), scale)
            rows[0, 0] = 0  # an all-zero token: the zero-norm / zero-range branches
            for store in (kern, ref):
                getattr(store, buf)[layer][hot] = rows.view(getattr(store, buf)[layer].dtype)
        for store in (kern, ref):
            store.k_scales[layer], store.v_scales[layer] = scales

    stale = torch.tensor([2, 3, 5, 7, 8, 1], device=device)
    assert kern.retier(stale) == ref.retier(stale) == 6
    _published(kern, ref)
    for name in ("fmt", "phys"):
        assert torch.equal(getattr(kern.page_table, name), getattr(ref.page_table, name))
    for layer in range(shape.num_layers):
        diff = int((kern.tq3[layer] != ref.tq3[layer]).sum())
        assert diff == 0, f"layer {layer}: {diff} TQ3 bytes differ from the torch codec's"

    for store in (kern, ref):
        store.end_step()  # the same free lists on both: promotion takes the same hot pages
    back = torch.tensor([3, 8], device=device)
    assert kern.promote(back) == ref.promote(back) == 2
    _published(kern, ref)
    assert torch.equal(kern.page_table.phys, ref.page_table.phys)
    promoted = kern.page_table.hot_slots(
        torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in (3, 8)]).to(device)
    )
    for layer in range(shape.num_layers):
        for buf in ("hot_k", "hot_v"):
            a = getattr(kern, buf)[layer][promoted].view(torch.uint8)
            b = getattr(ref, buf)[layer][promoted].view(torch.uint8)
            assert int((a != b).sum()) == 0, f"layer {layer} {buf}: promoted FP8 bytes differ"
    assert kern.stats.retier.pages == ref.stats.retier.pages == 6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_kernel_conversion_that_raises_leaves_every_page_in_its_format(monkeypatch, device):
    """The fault test of the kernel path: the kernel writes layer 0, then raises on layer 1."""
    shape, kern, _ = _stores(3, 64, 64, device)
    if device == "cpu":  # the stand-in kernel (CUDA builds the real one)
        monkeypatch.setitem(sys.modules, "minima_kernels", types.SimpleNamespace(PageConversions=CodecPageConversions))
        kern.kernels = kernel_conversions.KernelConversions(kern)
    pages = torch.arange(1, 5, device=device)
    kern.map_new(pages)
    kern.page_table.note_written(kern.page_table.hot_slots(torch.arange(64, 5 * 64, device=device)))
    fmt, phys = kern.page_table.fmt.clone(), kern.page_table.phys.clone()
    hot_free, tq3_free = kern.hot_pool.num_free, kern.tq3_pool.num_free
    real, calls = kern.kernels.kernels.fp8_to_tq3, []

    def fails_on_layer_1(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected kernel fault")
        real(*args)

    monkeypatch.setattr(kern.kernels.kernels, "fp8_to_tq3", fails_on_layer_1)
    assert kern.retier(pages) == 0
    assert torch.equal(kern.page_table.fmt, fmt) and torch.equal(kern.page_table.phys, phys)
    assert kern.stats.retier.failed_pages == 4 and kern.stats.retier.pages == 0
    assert kern.reference_mismatches() == 0
    assert (kern.hot_pool.num_free, kern.tq3_pool.num_free) == (hot_free, tq3_free)  # dst pages back, unread
    monkeypatch.setattr(kern.kernels.kernels, "fp8_to_tq3", real)
    assert kern.retier(pages) == 4  # the next batch converts them


def test_layout_options_convert_on_the_torch_codec(monkeypatch, caplog):
    """The kernels write neither Lloyd-Max nor 4-bit values: where they would serve the same store
    without them (kernels importable), a store with either converts through the codec, and the log says
    which; page-centered keys alone take the kernels."""
    monkeypatch.setitem(sys.modules, "minima_kernels", types.SimpleNamespace(PageConversions=CodecPageConversions))
    for center, code, bits in ((False, "uniform", 3), (True, "uniform", 3), (False, "lloyd-max", 3),
                               (True, "lloyd-max", 3), (False, "uniform", 4)):
        shape = StoreShape(num_logical_pages=8, num_hot_pages=4, num_layers=1, hot_dtype=torch.float8_e4m3fn,
                           layout=TQ3PageLayout(2, 16, 64, 4, key_center=center, value_code=code, value_bits=bits))
        cuda_like = types.SimpleNamespace(shape=shape, device=torch.device("cuda"), is_fp8=True)
        caplog.clear()
        with caplog.at_level("INFO", logger=kernel_conversions.logger.name):
            assert (kernel_conversions.kernel_conversions(cuda_like) is None) == (code != "uniform" or bits == 4)
        said = caplog.text
        assert "page-centered keys" not in said and ("lloyd-max values" in said) == (code != "uniform")
        assert ("4-bit values (--minima-value-bits 4)" in said) == (bits == 4)


def test_four_bit_keys_take_the_kernels_of_their_width(monkeypatch):
    """A store with 4-bit keys converts through the kernels too, built for its key width."""
    monkeypatch.setitem(sys.modules, "minima_kernels", types.SimpleNamespace(PageConversions=CodecPageConversions))
    shape = StoreShape(num_logical_pages=8, num_hot_pages=4, num_layers=1, hot_dtype=torch.float8_e4m3fn,
                       layout=TQ3PageLayout(2, 16, 64, 4))
    cuda_like = types.SimpleNamespace(shape=shape, device=torch.device("cuda"), is_fp8=True)
    conversions = kernel_conversions.kernel_conversions(cuda_like)
    assert conversions is not None and conversions.kernels.layout.key_bits == 4
    # and page-centered keys take kernels built for them
    centered = dataclasses.replace(shape, layout=TQ3PageLayout(2, 16, 64, 4, key_center=True))
    conversions = kernel_conversions.kernel_conversions(types.SimpleNamespace(**{**vars(cuda_like), "shape": centered}))
    assert conversions is not None and conversions.kernels.layout.key_center
