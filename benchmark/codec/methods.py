"""The KV formats compared by bench_codec.py, each as quantize-dequantize over [N, H, D] K and V.

All return K̂, V̂ in the ORIGINAL space, so every metric compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from sglang_minima.codec.accounting import tq3_bits
from sglang_minima.codec.codebook import key_codebook, tq3_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import (
    decode_pages,
    dequantize_keys,
    dequantize_values,
    encode_pages,
    quantize_keys,
    quantize_values,
    to_original_space,
)

PAGE_SIZE = 64
SINK_TOKENS = 64  # the product's defaults (ARCHITECTURE.md "TQ3"): sinks and Recent stay FP8
RECENT_TOKENS = 256
KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Method:
    name: str
    bits_k: Callable[[int, int], float]  # (head_dim, num_tokens) -> bits per element, metadata included
    bits_v: Callable[[int, int], float]
    run: Callable[[torch.Tensor, torch.Tensor, int], KV]  # (k, v, layer_id) -> (k̂, v̂)


def _bf16(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
    return k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()


def _fp8(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
    # SGLang's default per-layer scale (none given): 1.0.
    return fp8_dequantize(fp8_quantize(k)), fp8_dequantize(fp8_quantize(v))


def _int(bits: int) -> Callable[[torch.Tensor, torch.Tensor, int], KV]:
    def run(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
        out = []
        for x in (k, v):
            codes, scale, zero = quantize_values(x, bits)
            out.append(dequantize_values(codes, scale, zero, bits))
        return out[0], out[1]

    return run


def _pages(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> [N/P, H, P, D] (N a multiple of the page size)."""
    n, h, d = x.shape
    return x.view(n // PAGE_SIZE, PAGE_SIZE, h, d).transpose(1, 2)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    m, h, p, d = x.shape
    return x.transpose(1, 2).reshape(m * p, h, d)


def _tq3_pages(key_bits: int, key_center: bool = False) -> Callable[[torch.Tensor, torch.Tensor, int], KV]:
    """The product codec with ``key_bits``-bit keys, through real TQ3P pages; ``key_center``: page-centered
    keys (each page's mean rotated key per head, fp16, in the page; the code spends its levels on how
    keys differ within the page, not on the offset they share: post-RoPE keys carry a large one in
    their slowly rotating channels)."""

    def run(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
        h, d = k.shape[1], k.shape[2]
        layout, rot = TQ3PageLayout(h, PAGE_SIZE, d, key_bits, key_center), LayerRotation(h, d, layer_id)
        cb = key_codebook(d, key_bits)
        k_rot, v_rot = decode_pages(encode_pages(_pages(k), _pages(v), layout, rot, cb), layout, cb)
        return _tokens(to_original_space(k_rot, rot)), _tokens(to_original_space(v_rot, rot))

    return run


_tq3 = _tq3_pages(3)


def _tq3_lloyd_values(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
    """Variant: values get Lloyd-Max codes too (rotated, normalized, as keys) and ONE fp16 per token,
    the least-squares scale s = <v', c>/||c||^2 (MSE-optimal for the chosen codes)."""
    h, d = k.shape[1], k.shape[2]
    rot, cb = LayerRotation(h, d, layer_id), tq3_codebook(d)
    k_codes, k_norm = quantize_keys(rot.rotate(k), cb)
    v_rot = rot.rotate(v)
    c = cb.centroids[quantize_keys(v_rot, cb)[0].long()]
    s = ((v_rot * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-30)).to(torch.float16).float()
    return rot.unrotate(dequantize_keys(k_codes, k_norm, cb)), rot.unrotate(s.unsqueeze(-1) * c)


def _tiers(stale_code: Callable[[torch.Tensor, torch.Tensor, int], KV]) -> Callable[[torch.Tensor, torch.Tensor, int], KV]:
    """The product's tiers at the end of a sequence: sink + recent tokens FP8, the rest ``stale_code``."""

    def run(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
        fp8_k, fp8_v = _fp8(k, v, layer_id)
        n = k.shape[0]
        stale = slice(SINK_TOKENS, n - RECENT_TOKENS)
        tq3_k, tq3_v = stale_code(k[stale].contiguous(), v[stale].contiguous(), layer_id)
        fp8_k[stale], fp8_v[stale] = tq3_k, tq3_v
        return fp8_k, fp8_v

    return run


_minima = _tiers(_tq3)


def _minima_bits(bits: Callable[[int], float]) -> Callable[[int, int], float]:
    def blended(d: int, n: int) -> float:
        hot = SINK_TOKENS + RECENT_TOKENS
        return (hot * 8.0 + (n - hot) * bits(d)) / n

    return blended


def _tq3_no_rotation(k: torch.Tensor, v: torch.Tensor, layer_id: int) -> KV:
    """Ablation: the TQ3 recipe without the rotation."""
    cb = tq3_codebook(k.shape[-1])
    codes, s = quantize_keys(k, cb)
    v_codes, scale, zero = quantize_values(v)
    return dequantize_keys(codes, s, cb), dequantize_values(v_codes, scale, zero)


def _const(bits: float) -> Callable[[int, int], float]:
    return lambda d, n: bits


def _per_dim(bits: Callable[[int], float]) -> Callable[[int, int], float]:
    return lambda d, n: bits(d)


def _key_bits(key_bits: int, centered: bool = False) -> Callable[[int], float]:
    """Bits per key element of a TQ3 key code of ``key_bits`` bits (its norm included); ``centered``:
    page-centered keys, one fp16 mean more per page, head and dimension."""
    return lambda d: tq3_bits(d, key_bits=key_bits, centered_page_size=PAGE_SIZE if centered else None).key


_tq3_k = _key_bits(3)


def _tq3_v(d: int) -> float:
    return tq3_bits(d).value


METHODS = [
    Method("bf16", _const(16.0), _const(16.0), _bf16),
    Method("fp8-e4m3", _const(8.0), _const(8.0), _fp8),
    Method("int4-minmax", _per_dim(lambda d: 4 + 32 / d), _per_dim(lambda d: 4 + 32 / d), _int(4)),
    Method("int3-minmax", _per_dim(lambda d: 3 + 32 / d), _per_dim(lambda d: 3 + 32 / d), _int(3)),
    Method("tq3-norot", _per_dim(_tq3_k), _per_dim(_tq3_v), _tq3_no_rotation),
    Method("tq3", _per_dim(_tq3_k), _per_dim(_tq3_v), _tq3),
    Method("tq3-lmv", _per_dim(_tq3_k), _per_dim(_tq3_k), _tq3_lloyd_values),
    Method("tq3-center", _per_dim(_key_bits(3, centered=True)), _per_dim(_tq3_v), _tq3_pages(3, key_center=True)),
    Method("tq3-k4", _per_dim(_key_bits(4)), _per_dim(_tq3_v), _tq3_pages(4)),
    Method("tq3-k4-center", _per_dim(_key_bits(4, centered=True)), _per_dim(_tq3_v), _tq3_pages(4, key_center=True)),
    Method("minima-tiers", _minima_bits(_tq3_k), _minima_bits(_tq3_v), _minima),
    Method("minima-tiers-k4", _minima_bits(_key_bits(4)), _minima_bits(_tq3_v), _tiers(_tq3_pages(4))),
    Method("minima-tiers-k4-center", _minima_bits(_key_bits(4, centered=True)), _minima_bits(_tq3_v),
           _tiers(_tq3_pages(4, key_center=True))),
]
