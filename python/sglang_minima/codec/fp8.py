"""FP8 (e4m3) pages, byte-identical to SGLang 0.5.23's MHATokenToKVPool.

SGLang's ``set_kv_buffer`` (mem_cache/memory_pool.py) stores a K or V row as
``cache_k.div_(k_scale)`` (only when a scale is given, in the input's own dtype), then
``.to(float8_e4m3fn)`` and ``.view(uint8)``. There is no clamp: values beyond +-448 get whatever
torch's cast gives (torch 2.13 saturates to +-448, torch 2.11 gives NaN). Scales are per layer
and per tensor (``layer.k_scale``), None meaning 1.0.
We reproduce that exactly, so an FP8 page written by SGLang and one written here are the same bytes.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0

Scale = float | torch.Tensor | None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_quantize(x: torch.Tensor, scale: Scale = None) -> torch.Tensor:
    """``x`` (bf16/fp16/fp32) -> uint8 e4m3 bit patterns, as SGLang's set_kv_buffer stores them."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fp8_quantize expects a bf16/fp16/fp32 tensor, got dtype={x.dtype}")
    if scale is not None:
        # SGLang divides in place in the input dtype (bf16 stays bf16), then casts: keep that rounding.
        x = x / scale
    return x.to(FP8_DTYPE).view(torch.uint8)


def fp8_requantize(x: torch.Tensor, scale: Scale = None) -> torch.Tensor:
    """Decoded float pages -> uint8 e4m3 for a promotion (TQ3 back to FP8), as the promotion kernel
    (``minima_kernels.convert.tq3_to_fp8``) writes them: ``x / scale`` correctly rounded (divided by a
    tensor: a Python-float divisor may become a multiply by its reciprocal on CUDA, depending on the
    torch version, and that differs on e4m3 rounding ties), saturated to +-448 (a TQ3 round trip may
    overshoot the range its FP8 source had; torch 2.11's cast would give NaN there)."""
    x = x.to(torch.float32)
    if scale is not None:
        x = x / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


_DECODE_TABLES: dict[torch.device, torch.Tensor] = {}


def _decode_table(device: torch.device) -> torch.Tensor:
    """fp32 value of each of the 256 e4m3 bit patterns (torch's own cast, computed once)."""
    table = _DECODE_TABLES.get(device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32).to(device)
        _DECODE_TABLES[device] = table
    return table


def fp8_dequantize(u8: torch.Tensor, scale: Scale = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 e4m3 bit patterns -> ``dtype`` values times the per-layer scale."""
    if u8.dtype != torch.uint8:
        raise TypeError(f"fp8_dequantize expects uint8 e4m3 bit patterns, got dtype={u8.dtype}")
    # A table lookup gives the cast's exact values (every e4m3 value is exact in fp32, bf16 and
    # fp16) about 5x faster than torch's element-wise fp8 cast on CPU, the reference's hot path.
    x = _decode_table(u8.device).index_select(0, u8.reshape(-1).to(torch.int32)).view(u8.shape).to(dtype)
    return x if scale is None else x * scale
