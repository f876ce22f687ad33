"""TQ3 encode/decode: the torch reference that GPU kernels must match bit for bit.

Keys (rotated k', per token): norm n, codes against the Lloyd-Max thresholds of sqrt(d)·k'/n, and
an fp16 norm correction s = n / ||centroids[c]||, so k̂' = s·centroids[c] has norm n. The codes are
3-bit (TQ3) or, with ``TQ3PageLayout.key_bits == 4``, 4-bit against the 16-level codebook
(``codebook.key_codebook``); the recipe is the same.
Page-centered keys (``TQ3PageLayout.key_center``): the recipe codes k' - m instead, m the page's
mean rotated key per head (fp16), and decodes s·centroids[c] + m.
Values (rotated v', per token): fp16 zero = min, fp16 scale = (max - min)/7, uniform 3-bit codes;
or (``TQ3PageLayout.value_code == "lloyd-max"``) the key recipe's codes and one fp16 scale, the
least-squares <v', c>/<c, c>, decoded s·centroids[c] (``value_codebook``). With
``TQ3PageLayout.value_bits == 4`` either recipe has 16 levels (the uniform scale is (max - min)/15).
The exact arithmetic (order, rounding) is specified in docs/TQ3P.md; each step below is one IEEE
fp32 operation so a kernel can replicate it. Decoded K/V stay in the rotated space: attention uses
q' = R q and un-rotates its output once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codebook import Codebook, key_codebook
from .fp8 import Scale, fp8_dequantize
from .layout import KEY, UNIFORM_VALUES, VALUE, TQ3PageLayout
from .packing import key_pair_fields, pack_codes, unpack_codes, value_code_ints
from .rotation import LayerRotation

# Squared norms below the smallest normal fp32 are coded as zero (codes 0, scale 0): keeps sqrt(d)/n
# finite and makes the result independent of a device's subnormal handling.
_MIN_NORM_SQ = torch.finfo(torch.float32).tiny
_FP16_MAX = torch.finfo(torch.float16).max
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 a / b on every device: for fp32 inputs, the float64 quotient rounded
    once to fp32 is the IEEE fp32 quotient. (CUDA torch divides by a scalar via its reciprocal.)"""
    return (a.to(torch.float64) / b.to(torch.float64)).to(torch.float32)


def _sqrt(a: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt on every device, the same way (CUDA torch.sqrt on fp32 is not)."""
    return torch.sqrt(a.to(torch.float64)).to(torch.float32)


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum of x_i^2 over the last dim in a fixed order: zero-pad to a power of two P, then
    repeatedly s[i] = s[i] + s[i + P/2] until one element is left."""
    return _tree_sum(x.to(torch.float32) * x.to(torch.float32))


def page_mean_keys(k_rot: torch.Tensor) -> torch.Tensor:
    """Rotated keys of pages [..., P, D] -> each page's mean key per head, fp16 [..., D]: the fp32 sum
    over the P tokens in ``sum_of_squares``' order, divided by P (one correctly rounded fp32
    division), rounded to fp16."""
    k = k_rot.to(torch.float32)
    total = _tree_sum(k.transpose(-1, -2))
    mean = _div(total, torch.full_like(total, float(k.shape[-2]))).to(torch.float16)
    _check_finite_fp16(mean, "mean key")
    return mean


def _tree_sum(s: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim, zero-padded to a power of two and halved until one element is left."""
    d = s.shape[-1]
    p = 1 << max(d - 1, 0).bit_length()
    if p != d:
        s = torch.nn.functional.pad(s, (0, p - d))
    while p > 1:
        p //= 2
        s = s[..., :p] + s[..., p:]
    return s.squeeze(-1)


def _check_finite_fp16(x: torch.Tensor, what: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"TQ3: {what} overflows fp16 (|value| > {_FP16_MAX}); input has values too large to code"
        )


def _sphere_codes(x_rot: torch.Tensor, codebook: Codebook) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated vectors [..., D] -> (codes uint8 [..., D] of sqrt(D)·x/||x|| against the codebook's
    thresholds, the fp32 norm [...], the zero mask [...]: vectors coded as all-zero)."""
    x = x_rot.to(torch.float32)
    d = x.shape[-1]
    thresholds = codebook.thresholds.to(x.device)
    norm_sq = sum_of_squares(x)
    zero = norm_sq < _MIN_NORM_SQ
    norm = _sqrt(norm_sq)
    sqrt_d = torch.full_like(norm, float(torch.tensor(math.sqrt(d), dtype=torch.float32)))
    ratio = torch.where(zero, torch.zeros_like(norm), _div(sqrt_d, norm))
    u = (x * ratio.unsqueeze(-1)).contiguous()
    # code = #{j : t_j < u}; bucketize(right=False) counts boundaries strictly below u.
    codes = torch.bucketize(u, thresholds, right=False).to(torch.uint8)
    return torch.where(zero.unsqueeze(-1), torch.zeros_like(codes), codes), norm, zero


def centroids_of(codes: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """centroids[codes] fp32, shaped as ``codes``: the same gather as ``centroids[codes.long()]``, through
    one flat ``index_select``, which torch's CPU runs faster than the advanced index
    (decode_pages of 92 SmolLM2 pages 6.3-6.9 to 4.5-5.2 ms: docs/results/serving.md)."""
    centroids = codebook.centroids.to(codes.device)
    return centroids.index_select(0, codes.reshape(-1).long()).view(codes.shape)


def quantize_keys(k_rot: torch.Tensor, codebook: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys [..., D] -> (codes uint8 [..., D], norm correction fp16 [...])."""
    codes, norm, zero = _sphere_codes(k_rot, codebook)
    code_norm = _sqrt(sum_of_squares(centroids_of(codes, codebook)))
    correction = torch.where(zero, torch.zeros_like(norm), _div(norm, code_norm)).to(torch.float16)
    _check_finite_fp16(correction, "key norm correction")
    return codes, correction


def dequantize_keys(codes: torch.Tensor, correction: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """(codes [..., D], fp16 [...]) -> rotated keys fp32 [..., D]: s·centroids[c]."""
    _check_codes(codes, codebook.levels)
    return correction.to(torch.float32).unsqueeze(-1) * centroids_of(codes, codebook)


def quantize_values(v_rot: torch.Tensor, bits: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token min/max uniform codes of ``bits`` bits (3 for TQ3 values):
    [..., D] -> (codes uint8 [..., D], scale fp16 [...], zero fp16 [...])."""
    v = v_rot.to(torch.float32)
    top = (1 << bits) - 1
    lo, hi = v.amin(-1), v.amax(-1)
    # -0.0 -> +0.0: the sign of a zero min (max) depends on the reduction order; the GPU kernel does the same
    lo, hi = lo + 0.0, hi + 0.0
    zero16 = lo.to(torch.float16)
    scale16 = _div(hi - lo, torch.full_like(hi, float(top))).to(torch.float16)
    _check_finite_fp16(zero16, "value zero point")
    _check_finite_fp16(scale16, "value scale")
    scale, zero = scale16.to(torch.float32).unsqueeze(-1), zero16.to(torch.float32).unsqueeze(-1)
    q = torch.round(_div(v - zero, scale)).clamp(0, top)  # torch.round is round-half-to-even
    codes = torch.where(scale == 0, torch.zeros_like(q), q).to(torch.uint8)
    return codes, scale16, zero16


def dequantize_values(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 3
) -> torch.Tensor:
    """scale·c + zero in fp32 (scale·c is exact: an fp16 times a 3- or 4-bit integer)."""
    _check_codes(codes, 1 << bits)
    return scale.to(torch.float32).unsqueeze(-1) * codes.to(torch.float32) + zero.to(torch.float32).unsqueeze(
        -1
    )


def quantize_values_lloyd_max(v_rot: torch.Tensor, codebook: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """``lloyd-max`` values: rotated values [..., D] -> (codes uint8 [..., D], scale fp16 [...]). The
    codes are the key recipe's (``_sphere_codes``, the 3-bit codebook); the scale is the least-squares
    one for them, <v', c> / <c, c> with c = centroids[codes] (fp32 sums in ``sum_of_squares``' order,
    one correctly rounded division), so scale·c is the closest point to v' on the codes' line."""
    codes, _, zero = _sphere_codes(v_rot, codebook)
    c = centroids_of(codes, codebook)
    dot = _tree_sum(v_rot.to(torch.float32) * c)
    scale = torch.where(zero, torch.zeros_like(dot), _div(dot, sum_of_squares(c))).to(torch.float16)
    _check_finite_fp16(scale, "value scale")
    return codes, scale


def dequantize_values_lloyd_max(codes: torch.Tensor, scale: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """(codes [..., D], fp16 [...]) -> rotated values fp32 [..., D]: scale·centroids[c]."""
    return dequantize_keys(codes, scale, codebook)


def value_codebook(head_dim: int, bits: int = 3) -> Codebook:
    """The codebook of ``lloyd-max`` values: the key codebook of the head dim and the values' width."""
    return key_codebook(head_dim, bits)


def _check_codes(codes: torch.Tensor, levels: int) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"TQ3 codes must be uint8, got dtype={codes.dtype}")
    if codes.numel() and int(codes.max()) >= levels:
        raise ValueError(f"TQ3 codes must be < {levels}, got max {int(codes.max())}")


@dataclass(frozen=True)
class TQ3PageFields:
    """Views into TQ3P pages [N, page_bytes] (no copies), heads-major as in layout.py."""

    k_codes: torch.Tensor  # uint8 [N, H, P*D*key_bits/8], MMA order (layout.py)
    v_codes: torch.Tensor  # uint8 [N, H, P*D*value_bits/8], MMA order
    k_norm: torch.Tensor  # fp16 [N, H, P]
    v_scale: torch.Tensor  # fp16 [N, H, P]
    v_zero: torch.Tensor | None  # fp16 [N, H, P] (``uniform`` values only)
    k_mean: torch.Tensor | None = None  # fp16 [N, H, D] (``key_center`` layouts only)


def page_fields(pages: torch.Tensor, layout: TQ3PageLayout) -> TQ3PageFields:
    """Split TQ3P pages into their fields (views)."""
    _check_pages(pages, layout)
    n, h, p = pages.shape[0], layout.num_kv_heads, layout.page_size

    def codes(off: int, head_bytes: int) -> torch.Tensor:
        return pages[:, off : off + h * head_bytes].view(n, h, head_bytes)

    def meta(off: int) -> torch.Tensor:
        return pages[:, off : off + layout.meta_bytes].view(torch.float16).view(n, h, p)

    k_mean = None
    if layout.key_center:
        off = layout.k_mean_offset
        k_mean = pages[:, off : off + layout.k_mean_bytes].view(torch.float16).view(n, h, layout.head_dim)
    return TQ3PageFields(
        codes(layout.k_codes_offset, layout.k_head_code_bytes),
        codes(layout.v_codes_offset, layout.v_head_code_bytes),
        meta(layout.k_norm_offset),
        meta(layout.v_scale_offset),
        meta(layout.v_zero_offset) if layout.value_code == UNIFORM_VALUES else None,
        k_mean,
    )


def check_codebook(codebook: Codebook, layout: TQ3PageLayout, what: str) -> None:
    if codebook.levels != 1 << layout.key_bits:
        raise ValueError(
            f"{what}: the layout's keys are {layout.key_bits}-bit ({1 << layout.key_bits} levels), the "
            f"codebook has {codebook.levels} levels (codebook.key_codebook(head_dim, key_bits))"
        )


def _check_pages(pages: torch.Tensor, layout: TQ3PageLayout) -> None:
    if pages.dtype != torch.uint8:
        raise TypeError(f"TQ3 pages must be uint8, got dtype={pages.dtype}")
    if pages.dim() != 2 or pages.shape[1] != layout.page_bytes:
        raise ValueError(
            f"TQ3 pages must have shape [num_pages, {layout.page_bytes}], got {tuple(pages.shape)}"
        )


def _as_float(x: torch.Tensor, scale: Scale, name: str, layout: TQ3PageLayout) -> torch.Tensor:
    want = (layout.num_kv_heads, layout.page_size, layout.head_dim)
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"encode_pages: {name} must be bf16/fp16/fp32 or uint8 FP8, got dtype={x.dtype}")
    if x.dim() != 4 or tuple(x.shape[1:]) != want:
        raise ValueError(
            f"encode_pages: {name} must have shape [num_pages, {', '.join(map(str, want))}], "
            f"got {tuple(x.shape)}"
        )
    if x.dtype == torch.uint8:
        return fp8_dequantize(x, scale)
    if scale is not None:
        raise ValueError(
            f"encode_pages: {name}_scale applies to uint8 FP8 input only, got {name} dtype={x.dtype}"
        )
    return x.to(torch.float32)


def encode_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TQ3PageLayout,
    rotation: LayerRotation,
    codebook: Codebook,
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:
    """Full pages of K and V [N, H, P, D] (bf16/fp16/fp32, or uint8 FP8 with the per-layer scales)
    -> TQ3P pages uint8 [N, layout.page_bytes]."""
    if rotation.head_dim != layout.head_dim or rotation.num_kv_heads != layout.num_kv_heads:
        raise ValueError(
            f"encode_pages: rotation is for (H={rotation.num_kv_heads}, D={rotation.head_dim}), "
            f"layout is (H={layout.num_kv_heads}, D={layout.head_dim})"
        )
    check_codebook(codebook, layout, "encode_pages")
    kf, vf = _as_float(k, k_scale, "k", layout), _as_float(v, v_scale, "v", layout)
    if kf.shape[0] != vf.shape[0]:
        raise ValueError(f"encode_pages: k has {kf.shape[0]} pages, v has {vf.shape[0]}")
    n = kf.shape[0]
    k_rot = rotation.rotate(kf, head_axis=-3)
    k_mean = page_mean_keys(k_rot) if layout.key_center else None
    if k_mean is not None:  # the code spends its levels on how keys differ within the page
        k_rot = k_rot - k_mean.to(torch.float32).unsqueeze(-2)
    k_codes, k_norm = quantize_keys(k_rot, codebook)
    v_rot = rotation.rotate(vf, head_axis=-3)
    if layout.value_code == UNIFORM_VALUES:
        v_codes, *v_meta = quantize_values(v_rot, layout.value_bits)
    else:
        v_codes, *v_meta = quantize_values_lloyd_max(v_rot, value_codebook(layout.head_dim, layout.value_bits))
    parts = [
        pack_codes(k_codes, KEY, layout.key_bits).reshape(n, -1),
        pack_codes(v_codes, VALUE, layout.value_bits).reshape(n, -1),
        k_norm.reshape(n, -1).view(torch.uint8),
        *(m.reshape(n, -1).view(torch.uint8) for m in v_meta),
    ]
    if k_mean is not None:
        parts.append(k_mean.reshape(n, -1).view(torch.uint8))
    pad = layout.page_bytes - layout.payload_bytes - layout.metadata_bytes
    parts.append(torch.zeros(n, pad, dtype=torch.uint8, device=kf.device))
    return torch.cat(parts, dim=1)


def decode_pages(
    pages: torch.Tensor, layout: TQ3PageLayout, codebook: Codebook
) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ3P pages [N, page_bytes] -> (k̂', v̂') fp32 [N, H, P, D] in the ROTATED space."""
    f = page_fields(pages, layout)
    v_codes = _unpack(f.v_codes, VALUE, layout, layout.value_bits)
    if f.v_zero is not None:
        v = dequantize_values(v_codes, f.v_scale, f.v_zero, layout.value_bits)
    else:
        v = dequantize_values_lloyd_max(v_codes, f.v_scale, value_codebook(layout.head_dim, layout.value_bits))
    return _keys_of(f, layout, codebook), v


def decode_page_keys(pages: torch.Tensor, layout: TQ3PageLayout, codebook: Codebook) -> torch.Tensor:
    """The keys of ``decode_pages`` alone: k̂' fp32 [N, H, P, D], ROTATED space."""
    return _keys_of(page_fields(pages, layout), layout, codebook)


def _keys_of(f: TQ3PageFields, layout: TQ3PageLayout, codebook: Codebook) -> torch.Tensor:
    check_codebook(codebook, layout, "decode_pages")
    codes = _unpack(f.k_codes, KEY, layout, layout.key_bits)
    keys = dequantize_keys(codes, f.k_norm, codebook)
    if f.k_mean is not None:
        keys = keys + f.k_mean.to(torch.float32).unsqueeze(-2)
    return keys


def _unpack(packed: torch.Tensor, kind: str, layout: TQ3PageLayout, bits: int) -> torch.Tensor:
    """``unpack_codes`` of a head's code blocks [..., bytes] -> codes [..., P, D], through the CPU
    decode's word reads where they apply (``packing.key_pair_fields`` / ``value_code_ints``, bit-exact with
    ``unpack_codes``, tested): a few long ops instead of a gather per code and a loop over the spare
    pair's bits (2026-12-06, bench_cpu_extend.py's TQ3 decode column: 12.1 to 6.6-7.4 ms for 92
    pages of SmolLM2)."""
    p, d = layout.page_size, layout.head_dim
    if packed.device.type != "cpu" or packed.shape[-1] % 4:  # (the word reads are tested on CPU)
        return unpack_codes(packed, kind, p, d, bits)
    words = packed.contiguous().view(torch.int32)
    if kind == KEY:  # pair fields: code(2j) | code(2j + 1) << bits
        fields = key_pair_fields(words, p, d, bits)
        codes = torch.stack((fields & ((1 << bits) - 1), fields >> bits), dim=-1)
    else:
        codes = value_code_ints(words, p, d, bits)
    return codes.to(torch.uint8).view(*packed.shape[:-1], p, d)


def to_original_space(x_rot: torch.Tensor, rotation: LayerRotation) -> torch.Tensor:
    """Rotated pages [N, H, P, D] -> original space (R^T per kv head)."""
    return rotation.unrotate(x_rot, head_axis=-3)
