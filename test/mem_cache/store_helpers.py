"""Build small tiered stores and write/read their pages the way SGLang and the backend do."""

from __future__ import annotations

import torch

from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.tq3 import decode_pages, to_original_space
from sglang_minima.mem_cache.conversion_stream import ConversionStream
from sglang_minima.mem_cache.page_table import FMT_HOT
from sglang_minima.mem_cache.tier_store import StoreShape, TieredPageStore

PS = 16
HEADS = 2
DIM = 64
LAYERS = 2


class HeldConversionStream(ConversionStream):
    """A CPU conversion stream whose copies finish when the test says (a side stream, held): the copy
    runs at launch, but a conversion is done only after ``complete()`` (every copy launched so far,
    in order, as a stream finishes them) or a ``wait`` for it. With ``hold`` False, at once."""

    def __init__(self, hold: bool = True):
        self.hold = hold
        self.launched = 0
        self.completed = 0  # handles up to this one are done
        self.waits = 0

    def launch(self, copy):
        copy()
        self.launched += 1
        return self.launched

    def done(self, handle) -> bool:
        return not self.hold or handle <= self.completed

    def wait(self, handle) -> None:
        self.waits += 1
        self.completed = max(self.completed, handle)

    def complete(self) -> None:
        self.completed = self.launched


def make_store(
    num_logical: int = 16, num_hot: int = 6, *, fp8: bool = True, stream: ConversionStream | None = None,
    debug_poison: bool | None = None, key_bits: int = 3, key_center: bool = False, value_code: str = "uniform",
    value_bits: int = 3,
) -> TieredPageStore:
    shape = StoreShape(
        num_logical_pages=num_logical,
        num_hot_pages=num_hot,
        num_layers=LAYERS,
        hot_dtype=torch.float8_e4m3fn if fp8 else torch.float32,
        layout=TQ3PageLayout(HEADS, PS, DIM, key_bits, key_center, value_code, value_bits),
    )
    return TieredPageStore(shape, conversion_stream=stream, debug_poison=debug_poison)


def write_tokens(store: TieredPageStore, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What MinimaKVPool.set_kv_buffer does for every layer: logical slots -> hot slots, FP8 cast."""
    hot = store.page_table.hot_slots(slots)
    store.page_table.note_written(hot)
    for layer in range(store.shape.num_layers):
        for buf, x in ((store.hot_k, k[layer]), (store.hot_v, v[layer])):
            buf[layer][hot] = fp8_quantize(x) if store.is_fp8 else x.to(buf[layer].dtype)


def read_page(store: TieredPageStore, page: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One logical page of one layer as float [P, H, D] in the original space, from its current format."""
    pt = store.page_table
    phys = int(pt.phys[page])
    if int(pt.fmt[page]) == FMT_HOT:
        rows = slice(phys * PS, (phys + 1) * PS)
        k, v = store.hot_k[layer][rows], store.hot_v[layer][rows]
        if store.is_fp8:
            return fp8_dequantize(k), fp8_dequantize(v)
        return k.float(), v.float()
    k_rot, v_rot = decode_pages(store.tq3[layer][phys : phys + 1], store.layout, store.codebook)
    rot = store.rotations[layer]
    return (
        to_original_space(k_rot, rot)[0].permute(1, 0, 2),
        to_original_space(v_rot, rot)[0].permute(1, 0, 2),
    )


def random_kv(n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [layers, n, H, D]."""
    shape = (LAYERS, n, HEADS, DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-6))
