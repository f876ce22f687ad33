"""A small in-memory stand-in for MinimaKVPool's read/write interface, and a dense reference.

FakeMinimaPool implements exactly what the attention backend uses (page_size, layout, page_table
.fmt/.phys, hot_k_buffer/hot_v_buffer, k_scale/v_scale, tq3_buffer, rotation, codebook, hot_slots,
set_kv_buffer, note_read with MinimaStats route counters, note_page_scores, note_scratch_bytes, minima_config) plus test-only helpers: map logical pages to hot physical pages (the allocator's job)
and retier a page to TQ3 (the controller's job). ``reference_attention`` decodes what a pool (fake or
real) holds for a request and runs plain softmax attention over it, to compare the backend against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.layers.radix_attention import AttentionType

from sglang_minima.codec.codebook import Codebook, key_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import decode_pages, encode_pages, to_original_space
from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.mem_cache.stats import MinimaStats


@dataclass
class FakePageTable:
    fmt: torch.Tensor  # int8 [num_logical_pages]
    phys: torch.Tensor  # int32 [num_logical_pages]


@dataclass
class FakeMinimaPool:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_logical_pages: int
    num_hot_pages: int
    num_tq3_pages: int
    hot_dtype: str | torch.dtype = "fp8_e4m3"
    scales: tuple[float, float] = (0.5, 0.25)
    rotation_seed: int = 0
    score_anchors: bool = False
    anchor_window: int = 0
    start_layer: int = 0
    key_bits: int = 3
    layout: TQ3PageLayout = field(init=False)
    page_table: FakePageTable = field(init=False)
    codebook: Codebook = field(init=False)
    stats: MinimaStats = field(init=False, default_factory=MinimaStats)
    reads: list[torch.Tensor] = field(init=False, default_factory=list)
    page_scores: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, default_factory=list)
    window_masses: list[tuple[torch.Tensor, torch.Tensor, dict[int, int]]] = field(init=False, default_factory=list)
    minima_config: MinimaConfig = field(init=False)

    def __post_init__(self) -> None:
        h, d, ps = self.num_kv_heads, self.head_dim, self.page_size
        self.layout = TQ3PageLayout(h, ps, d, self.key_bits)
        self.minima_config = MinimaConfig(attention_score_anchors=self.score_anchors, key_bits=self.key_bits,
                                          anchor_window=self.anchor_window,
                                          anchor_pages=4 if self.anchor_window else 0)
        self.page_table = FakePageTable(
            torch.zeros(self.num_logical_pages, dtype=torch.int8),
            torch.zeros(self.num_logical_pages, dtype=torch.int32),
        )
        self.codebook = key_codebook(d, self.key_bits)
        store = torch.uint8 if self.is_fp8 else self.hot_dtype
        rows = (self.num_hot_pages + 1) * ps
        self._hot_k = [torch.zeros(rows, h, d, dtype=store) for _ in range(self.num_layers)]
        self._hot_v = [torch.zeros(rows, h, d, dtype=store) for _ in range(self.num_layers)]
        self._tq3 = [
            torch.zeros(self.num_tq3_pages + 1, self.layout.page_bytes, dtype=torch.uint8)
            for _ in range(self.num_layers)
        ]
        self._rotations = [LayerRotation(h, d, layer, self.rotation_seed) for layer in range(self.num_layers)]
        self._free_hot = list(range(self.num_hot_pages, 0, -1))
        self._free_tq3 = list(range(self.num_tq3_pages, 0, -1))

    @property
    def layer_num(self) -> int:
        return self.num_layers

    @property
    def is_fp8(self) -> bool:
        return self.hot_dtype == "fp8_e4m3"

    # --- the read interface the backend uses ---
    def hot_k_buffer(self, layer_id: int) -> torch.Tensor:
        return self._hot_k[layer_id]

    def hot_v_buffer(self, layer_id: int) -> torch.Tensor:
        return self._hot_v[layer_id]

    def k_scale(self, layer_id: int) -> float:
        return self.scales[0] if self.is_fp8 else 1.0

    def v_scale(self, layer_id: int) -> float:
        return self.scales[1] if self.is_fp8 else 1.0

    def tq3_buffer(self, layer_id: int) -> torch.Tensor:
        return self._tq3[layer_id]

    def rotation(self, layer_id: int) -> LayerRotation:
        return self._rotations[layer_id]

    def hot_slots(self, logical_slots: torch.Tensor) -> torch.Tensor:
        slots = logical_slots.to(torch.int64)
        pages = slots // self.page_size
        if bool((self.page_table.fmt[pages] != FMT_HOT).any()):
            raise AssertionError("hot_slots on a non-hot page")
        return self.page_table.phys[pages].to(torch.int64) * self.page_size + slots % self.page_size

    def note_read(self, logical_pages: torch.Tensor, *, hot_tokens: int = 0, tq3_tokens: int = 0) -> None:
        fmt = self.page_table.fmt[logical_pages]
        self.reads.append(logical_pages)
        self.stats.route_hot_pages += int((fmt == FMT_HOT).sum())
        self.stats.route_tq3_pages += int((fmt == FMT_TQ3).sum())
        self.stats.route_hot_tokens += hot_tokens
        self.stats.route_tq3_tokens += tq3_tokens

    def note_page_scores(self, logical_pages: torch.Tensor, mass: torch.Tensor) -> None:
        self.page_scores.append((logical_pages, mass))

    def note_window_mass(self, logical_pages: torch.Tensor, mass: torch.Tensor, ends: dict[int, int]) -> None:
        self.window_masses.append((logical_pages, mass, ends))

    def note_scratch_bytes(self, nbytes: int) -> None:
        self.stats.note_scratch_bytes(nbytes)

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: torch.Tensor, *args, **kwargs) -> None:
        logical = loc.loc if hasattr(loc, "loc") else loc
        slots = self.hot_slots(logical)
        override = kwargs.get("layer_id_override")
        lid = layer.layer_id if override is None else override
        h, d = self.num_kv_heads, self.head_dim
        k, v = cache_k.view(-1, h, d), cache_v.view(-1, h, d)
        if self.is_fp8:
            k, v = fp8_quantize(k, self.k_scale(lid)), fp8_quantize(v, self.v_scale(lid))
        self._hot_k[lid][slots] = k.to(self._hot_k[lid].dtype)
        self._hot_v[lid][slots] = v.to(self._hot_v[lid].dtype)

    # --- test helpers: the allocator's and the controller's side ---
    def map_hot(self, logical_pages) -> None:
        for lp in logical_pages:
            self.page_table.fmt[lp] = FMT_HOT
            self.page_table.phys[lp] = self._free_hot.pop()

    def retier(self, logical_pages) -> None:
        """Convert hot pages to TQ3 in every layer, publish, free the hot pages."""
        for lp in logical_pages:
            assert int(self.page_table.fmt[lp]) == FMT_HOT
            src = int(self.page_table.phys[lp])
            dst = self._free_tq3.pop()
            rows = slice(src * self.page_size, (src + 1) * self.page_size)
            for lid in range(self.num_layers):
                k = self._hot_k[lid][rows].permute(1, 0, 2).unsqueeze(0)  # [1, H, P, D]
                v = self._hot_v[lid][rows].permute(1, 0, 2).unsqueeze(0)
                scales = dict(k_scale=self.k_scale(lid), v_scale=self.v_scale(lid)) if self.is_fp8 else {}
                self._tq3[lid][dst] = encode_pages(
                    k, v, self.layout, self._rotations[lid], self.codebook, **scales
                )[0]
            self.page_table.fmt[lp] = FMT_TQ3
            self.page_table.phys[lp] = dst
            self._free_hot.append(src)


def decoded_kv(pool, layer_id: int, logical_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V fp32 [n, H, D] of logical slots as attention should see them, decoded through the pool's
    read interface only (works for FakeMinimaPool and MinimaKVPool alike)."""
    slots = logical_slots.to(torch.int64)
    ps = pool.page_size
    k_buf, v_buf = pool.hot_k_buffer(layer_id), pool.hot_v_buffer(layer_id)
    k_out = torch.empty(slots.numel(), *k_buf.shape[1:])
    v_out = torch.empty(slots.numel(), *v_buf.shape[1:])
    for i, slot in enumerate(slots.tolist()):
        lp, off = divmod(slot, ps)
        phys = int(pool.page_table.phys[lp])
        if int(pool.page_table.fmt[lp]) == FMT_HOT:
            k, v = k_buf[phys * ps + off], v_buf[phys * ps + off]
            if k.dtype == torch.uint8:
                k, v = fp8_dequantize(k, pool.k_scale(layer_id)), fp8_dequantize(v, pool.v_scale(layer_id))
        else:
            k_rot, v_rot = decode_pages(pool.tq3_buffer(layer_id)[phys : phys + 1], pool.layout, pool.codebook)
            rotation = pool.rotation(layer_id)
            k, v = to_original_space(k_rot, rotation)[0, :, off], to_original_space(v_rot, rotation)[0, :, off]
        k_out[i], v_out[i] = k.float(), v.float()
    return k_out, v_out


def reference_attention(
    pool, layer_id: int, q: torch.Tensor, logical_slots: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (float64) of one request's queries, the last ``len(q)`` positions of
    ``logical_slots``, over the decoded cache: q [T, Hq, D] -> (out [T, Hq, D], the attention
    weight of each key summed over queries and heads [n])."""
    k, v = decoded_kv(pool, layer_id, logical_slots)  # on the CPU, whatever the pool's device
    n, (t, hq, _) = logical_slots.numel(), q.shape
    group = hq // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.double().cpu(), k) * scaling
    visible = torch.arange(n).view(1, -1) <= torch.arange(n - t, n).view(-1, 1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("htn,nhd->thd", probs, v).float().to(q.device)
    return out, probs.sum(dim=(0, 1)).float()


@dataclass
class FakeLayer:
    """The RadixAttention fields an attention backend reads."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    qk_head_dim: int
    scaling: float
    v_head_dim: int = 0
    is_cross_attention: bool = False
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    attn_type: AttentionType = AttentionType.DECODER
    k_scale_float: float | None = None  # a checkpoint's FP8 KV scales (RadixAttention's), None: 1
    v_scale_float: float | None = None

    def __post_init__(self) -> None:
        self.v_head_dim = self.v_head_dim or self.qk_head_dim


def fake_runner(pool: FakeMinimaPool, req_to_token: torch.Tensor) -> SimpleNamespace:
    """The ModelRunner fields an attention backend's constructor reads."""
    return SimpleNamespace(
        device=str(req_to_token.device),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
    )
