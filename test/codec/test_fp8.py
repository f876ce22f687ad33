"""FP8 pages: the bytes SGLang 0.5.23's set_kv_buffer stores, and their exact dequantization."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.codec.fp8 import FP8_DTYPE, fp8_dequantize, fp8_quantize


def _sglang_store(cache_k: torch.Tensor, k_scale) -> torch.Tensor:
    """MHATokenToKVPool.set_kv_buffer's FP8 branch, verbatim (memory_pool.py, 0.5.23)."""
    cache_k = cache_k.clone()
    if cache_k.dtype != FP8_DTYPE:
        if k_scale is not None:
            cache_k.div_(k_scale)
        cache_k = cache_k.to(FP8_DTYPE)
    return cache_k.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [None, 1.0, 0.37, torch.tensor(2.5)])
def test_bytes_match_sglang(dtype, scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4, 32, generator=g) * 30).to(dtype)
    assert torch.equal(fp8_quantize(x, scale), _sglang_store(x, scale))


def test_known_bit_patterns():
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, 448.0, -448.0, 2.0**-9, 0.5, 1.125])
    want = [0x00, 0x80, 0x38, 0xC0, 0x7E, 0xFE, 0x01, 0x30, 0x39]
    assert fp8_quantize(x).tolist() == want


def test_every_code_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~torch.isnan(codes.view(FP8_DTYPE).float())]  # 0x7F and 0xFF are NaN
    for scale in (None, 0.5, 3.0):
        values = fp8_dequantize(codes, scale)
        assert torch.equal(fp8_quantize(values, scale), codes)


def test_dequantize_is_value_times_scale():
    u8 = fp8_quantize(torch.tensor([1.5, -3.0, 0.25]))
    assert fp8_dequantize(u8, 2.0).tolist() == [3.0, -6.0, 0.5]
    assert fp8_dequantize(u8, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_bad_dtypes():
    with pytest.raises(TypeError, match="dtype=torch.int32"):
        fp8_quantize(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        fp8_dequantize(torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_torch_cast_for_every_bit_pattern(dtype):
    patterns = torch.arange(256, dtype=torch.uint8).view(2, 8, 16)
    want = patterns.view(torch.float8_e4m3fn).to(dtype)
    got = fp8_dequantize(patterns, dtype=dtype)
    assert got.dtype == dtype and got.shape == patterns.shape
    nan = torch.isnan(want)
    assert int(nan.sum()) == 2 and torch.equal(torch.isnan(got), nan)  # 0x7F and 0xFF
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))  # same bits, -0 included


def test_requantize_divides_correctly_rounded_and_saturates():
    """The promotion's quantizer (the promotion kernel's bytes): x / scale as an IEEE division, so a
    value on an e4m3 rounding tie goes to the even code; out-of-range values saturate to +-448."""
    from sglang_minima.codec.fp8 import fp8_requantize

    # 1.8125 / 0.29 rounds to exactly 6.25 in fp32, halfway between e4m3 6.0 (0x4C) and 6.5 (0x4D)
    tie = torch.tensor([1.8125, -1.8125])
    assert float(tie[0] / torch.tensor(0.29)) == 6.25
    assert fp8_requantize(tie, 0.29).tolist() == [0x4C, 0xCC]
    # a multiply by the fp32 reciprocal lands above the tie: the byte the kernel used to write
    assert (tie * float(torch.tensor(1.0) / torch.tensor(0.29))).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x4D, 0xCD]
    assert fp8_requantize(torch.tensor([1000.0, -1000.0, float("nan")]), 1.0).tolist() == [0x7E, 0xFE, 0x7F]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 40
    assert torch.equal(fp8_requantize(x, 0.37), (x / torch.tensor(0.37)).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(fp8_requantize(x), fp8_quantize(x))
