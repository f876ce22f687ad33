"""TQ3 encode/decode: the documented recipe, the TQ3P byte layout, distortion, bad inputs."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from sglang_minima.codec.codebook import key_codebook, tq3_codebook
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize
from sglang_minima.codec.layout import KEY, VALUE, TQ3PageLayout
from sglang_minima.codec.packing import unpack_codes
from sglang_minima.codec.rotation import LayerRotation
from sglang_minima.codec.tq3 import (
    decode_pages,
    dequantize_values,
    dequantize_keys,
    encode_pages,
    page_fields,
    page_mean_keys,
    quantize_keys,
    quantize_values,
    quantize_values_lloyd_max,
    sum_of_squares,
    to_original_space,
)

H, P = 2, 16


def _setup(d: int):
    return TQ3PageLayout(H, P, d), LayerRotation(H, d, layer_id=1), tq3_codebook(d)


def _kv(n: int, d: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, P, d, generator=g) * 3
    v = torch.randn(n, H, P, d, generator=g) + 0.5
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("d", [64, 128, 256, 192])  # 192: not a power of two, the Haar-rotation fallback
def test_round_trip_shapes_and_original_space(d):
    layout, rot, cb = _setup(d)
    k, v = _kv(3, d)
    pages = encode_pages(k, v, layout, rot, cb)
    assert pages.shape == (3, layout.page_bytes) and pages.dtype == torch.uint8
    k_rot, v_rot = decode_pages(pages, layout, cb)
    k_hat, v_hat = to_original_space(k_rot, rot), to_original_space(v_rot, rot)
    # Rotation is orthogonal, so the error is the same in both spaces; and it is small.
    assert torch.allclose((k_hat - k).norm(), (k_rot - rot.rotate(k, head_axis=-3)).norm(), rtol=1e-4)
    assert float(((k_hat - k) ** 2).mean() / (k**2).mean()) < 0.045
    assert float(((v_hat - v) ** 2).mean() / (v**2).mean()) < 0.06


@pytest.mark.parametrize("key_bits,value_bits,page_size,d", [(4, 3, 64, 64), (3, 3, 16, 128), (4, 4, 64, 64), (3, 4, 32, 256)])
def test_decode_reads_the_codes_unpack_codes_reads(key_bits, value_bits, page_size, d):
    # decode_pages reads codes through the CPU decode's word reads: the same codes as unpack_codes,
    # spare bits and all, from any bytes
    from sglang_minima.codec.tq3 import _unpack

    layout = TQ3PageLayout(3, page_size, d, key_bits, value_bits=value_bits)
    pages = torch.randint(0, 256, (5, layout.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(d))
    f = page_fields(pages, layout)
    for kind, packed, bits in ((KEY, f.k_codes, key_bits), (VALUE, f.v_codes, value_bits)):
        assert torch.equal(_unpack(packed, kind, layout, bits), unpack_codes(packed, kind, page_size, d, bits))
        none = packed[:0]  # no pages: empty codes of the same trailing shape, as unpack_codes gives
        assert _unpack(none, kind, layout, bits).shape == unpack_codes(none, kind, page_size, d, bits).shape


@pytest.mark.parametrize("d", [64, 128, 256])
def test_key_norm_is_preserved(d):
    layout, rot, cb = _setup(d)
    k, v = _kv(2, d, seed=1)
    k_rot, _ = decode_pages(encode_pages(k, v, layout, rot, cb), layout, cb)
    ratio = k_rot.norm(dim=-1) / k.norm(dim=-1)
    assert float((ratio - 1).abs().max()) <= 2.0**-11 + 1e-6  # one fp16 rounding


def test_key_mse_matches_codebook_on_gaussian_data():
    d = 128
    cb = tq3_codebook(d)
    x = torch.randn(20000, d, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True) * math.sqrt(d)  # sqrt(d)·u: unit variance per coordinate
    codes, s = quantize_keys(x.float(), cb)
    x_hat = s.float().unsqueeze(-1) * cb.centroids[codes.long()]
    # Norm correction moves the reconstruction slightly off the centroids: within 10% of the Lloyd MSE.
    assert float(((x_hat.double() - x) ** 2).mean()) == pytest.approx(cb.mse, rel=0.1)


def test_key_codes_follow_the_definition():
    d = 64
    cb = tq3_codebook(d)
    k = torch.randn(500, d, generator=torch.Generator().manual_seed(3)) * 5
    codes, s = quantize_keys(k, cb)

    def sqrt(x):  # fp32 sqrt correctly rounded, as the codec defines it (torch's CPU fp32 sqrt is not
        return torch.sqrt(x.double()).float()  # always: ~1% of random draws here differed by an fp16 ulp)

    def div(a, b):  # fp32 quotient correctly rounded, the same way
        return (a.double() / b.double()).float()

    n = sqrt(sum_of_squares(k))
    u = k * div(torch.full_like(n, math.sqrt(d)), n).unsqueeze(-1)
    want = (u.unsqueeze(-1) > cb.thresholds).sum(-1)
    assert torch.equal(codes.long(), want)
    code_norm = sqrt(sum_of_squares(cb.centroids[codes.long()]))
    assert torch.equal(s, div(n, code_norm).to(torch.float16))


@pytest.mark.parametrize("bits", [3, 4])
def test_dequantize_keys_is_the_codebook_gather(bits):
    # centroids_of gathers through one flat index_select: the same values as the definition's advanced
    # index, for every shape a caller passes (non-contiguous codes, no codes at all)
    cb = key_codebook(64, bits)
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 3, 16, 64), generator=g, dtype=torch.uint8)
    s = (torch.rand(5, 3, 16, generator=g) + 0.5).to(torch.float16)
    for c, corr in ((codes, s), (codes.transpose(1, 2), s.transpose(1, 2)), (codes[:0], s[:0])):
        want = corr.float().unsqueeze(-1) * cb.centroids[c.long()]
        got = dequantize_keys(c, corr, cb)
        assert got.shape == c.shape and torch.equal(got, want)
    with pytest.raises(ValueError, match="TQ3 codes must be <"):
        dequantize_keys(codes | (1 << bits), s, cb)


def test_sum_of_squares_order():
    x = torch.randn(7, 96)
    s = torch.nn.functional.pad(x * x, (0, 32))
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    assert torch.equal(sum_of_squares(x), s[..., 0])


def test_value_recipe_by_hand():
    v = torch.tensor([[-1.0, 0.0, 0.5, 1.0, 2.5, 3.0, 3.5, -0.75]])
    codes, scale, zero = quantize_values(v)
    assert zero.item() == -1.0 and scale.dtype == torch.float16
    assert scale.item() == torch.tensor(4.5 / 7).to(torch.float16).item()
    q = (v - zero.float()) / scale.float()
    assert codes.tolist() == [torch.round(q).clamp(0, 7).to(torch.uint8).tolist()[0]]
    assert codes[0, 0] == 0 and codes[0, 6] == 7


def test_round_half_to_even():
    v = torch.tensor([[0.0, 0.5, 1.5, 2.5, 7.0, 3.5, 4.5, 6.5]])  # scale 1, zero 0
    codes, scale, zero = quantize_values(v)
    assert scale.item() == 1.0 and zero.item() == 0.0
    assert codes.tolist() == [[0, 0, 2, 2, 7, 4, 4, 6]]


def test_zero_keys_and_constant_values():
    d = 64
    layout, rot, cb = _setup(d)
    k = torch.zeros(1, H, P, d)
    v = torch.randn(1, H, P, d)
    pages = encode_pages(k, v, layout, rot, cb)
    f = page_fields(pages, layout)
    assert torch.count_nonzero(f.k_codes) == 0 and torch.count_nonzero(f.k_norm) == 0
    assert torch.count_nonzero(decode_pages(pages, layout, cb)[0]) == 0
    # A constant (rotated) value row: scale 0, codes 0, decoded exactly.
    codes, scale, zero = quantize_values(torch.full((3, d), 0.375))
    assert torch.count_nonzero(codes) == 0 and torch.count_nonzero(scale) == 0
    assert torch.equal(dequantize_values(codes, scale, zero), torch.full((3, d), 0.375))


def test_zero_value_rows_store_a_positive_zero_point():
    # The sign of a zero minimum depends on the reduction order (amin of [-0., +0.] is the first one),
    # so the reference stores +0.0 for any zero minimum, as the GPU conversion kernel does: 0x0000.
    rows = torch.tensor([[-0.0] * 8, [-0.0, 0.0] * 4, [0.0, -0.0] * 4, [0.0] * 8])
    codes, scale, zero = quantize_values(rows)
    assert zero.view(torch.int16).tolist() == [0, 0, 0, 0]
    assert torch.count_nonzero(codes) == 0 and scale.view(torch.int16).tolist() == [0, 0, 0, 0]
    # Whole pages of zero values, with signs: the rotated rows mix +0 and -0.
    d = 64
    layout, rot, cb = _setup(d)
    signs = torch.randint(0, 2, (1, H, P, d), generator=torch.Generator().manual_seed(5)).bool()
    v = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0))
    assert torch.signbit(rot.rotate(v, head_axis=-3)).any() and not torch.signbit(rot.rotate(v, head_axis=-3)).all()
    pages = encode_pages(torch.randn(1, H, P, d), v, layout, rot, cb)
    assert torch.count_nonzero(pages[:, layout.v_zero_offset : layout.v_zero_offset + layout.meta_bytes]) == 0
    f = page_fields(pages, layout)
    assert torch.count_nonzero(f.v_codes) == 0 and torch.count_nonzero(f.v_scale.view(torch.int16)) == 0


def test_layout_offsets():
    d = 64
    layout, rot, cb = _setup(d)
    k, v = _kv(2, d, seed=2)
    pages = encode_pages(k, v, layout, rot, cb)
    k_codes, k_norm = quantize_keys(rot.rotate(k, head_axis=-3), cb)
    v_codes, v_scale, v_zero = quantize_values(rot.rotate(v, head_axis=-3))
    cb_ = layout.code_bytes
    assert torch.equal(unpack_codes(pages[:, :cb_].view(2, H, -1), KEY, P, d), k_codes)
    assert torch.equal(unpack_codes(pages[:, cb_ : 2 * cb_].view(2, H, -1), VALUE, P, d), v_codes)
    f = page_fields(pages, layout)  # the field views cover the same bytes, one code block per head
    assert f.k_codes.shape == f.v_codes.shape == (2, H, layout.head_code_bytes)
    assert torch.equal(unpack_codes(f.k_codes, KEY, P, d), k_codes)
    assert torch.equal(unpack_codes(f.v_codes, VALUE, P, d), v_codes)
    for off, field in (
        (layout.k_norm_offset, k_norm),
        (layout.v_scale_offset, v_scale),
        (layout.v_zero_offset, v_zero),
    ):
        raw = pages[:, off : off + layout.meta_bytes].reshape(2, H * P, 2).to(torch.int32)
        bits = raw[..., 0] | (raw[..., 1] << 8)  # little-endian fp16
        assert torch.equal(bits, field.reshape(2, -1).view(torch.int16).to(torch.int32) & 0xFFFF)
    end = layout.payload_bytes + layout.metadata_bytes
    assert torch.count_nonzero(pages[:, end:]) == 0


@pytest.mark.parametrize("key_bits", [3, 4])
def test_page_centered_keys_layout_and_recipe(key_bits):
    """``key_center``: k_mean fp16 [H, D] after v_zero; the key fields are those of the rotated keys
    minus that mean, the value fields those of the plain layout, bit for bit; decode adds the mean."""
    from sglang_minima.codec.codebook import key_codebook

    d = 64
    plain = TQ3PageLayout(H, P, d, key_bits)
    layout = TQ3PageLayout(H, P, d, key_bits, key_center=True)
    assert layout.k_mean_offset == plain.payload_bytes + plain.metadata_bytes
    assert layout.metadata_bytes == plain.metadata_bytes + H * d * 2 and layout.k_mean_bytes == H * d * 2
    assert layout.page_bytes >= plain.page_bytes + H * d * 2
    with pytest.raises(ValueError, match="no k_mean field"):
        _ = plain.k_mean_offset
    rot, cb = LayerRotation(H, d, layer_id=1), key_codebook(d, key_bits)
    k, v = _kv(3, d, seed=5)
    k = k + 20 * torch.randn(3, H, 1, d, generator=torch.Generator().manual_seed(6))  # a shared offset per page
    pages, ref = encode_pages(k, v, layout, rot, cb), encode_pages(k, v, plain, rot, cb)
    f, g = page_fields(pages, layout), page_fields(ref, plain)
    k_rot = rot.rotate(k, head_axis=-3)
    mean = page_mean_keys(k_rot)
    assert torch.equal(f.k_mean, mean)
    codes, norm = quantize_keys(k_rot - mean.float().unsqueeze(-2), cb)
    assert torch.equal(unpack_codes(f.k_codes, KEY, P, d, key_bits), codes) and torch.equal(f.k_norm, norm)
    assert torch.equal(f.v_codes, g.v_codes) and torch.equal(f.v_scale, g.v_scale) and torch.equal(f.v_zero, g.v_zero)
    k_hat, v_hat = decode_pages(pages, layout, cb)
    assert torch.equal(k_hat, dequantize_keys(codes, norm, cb) + mean.float().unsqueeze(-2))
    assert torch.equal(v_hat, decode_pages(ref, plain, cb)[1])
    err = lambda x: float(((x - k_rot) ** 2).sum() / (k_rot**2).sum())  # noqa: E731
    assert err(k_hat) < err(decode_pages(ref, plain, cb)[0]) / 20  # the levels go to the residual
    end = layout.payload_bytes + layout.metadata_bytes
    assert torch.count_nonzero(pages[:, end:]) == 0


def test_page_mean_keys_is_the_fixed_order_sum_over_tokens_divided_then_rounded():
    x = torch.randn(2, 3, 48, 64) * 5  # 48 tokens: padded to 64 for the halving sum
    s = torch.nn.functional.pad(x.transpose(-1, -2), (0, 16))
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    want = (s[..., 0].double() / 48).float().half()
    assert torch.equal(page_mean_keys(x), want)
    assert page_mean_keys(x).dtype == torch.float16 and page_mean_keys(x).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="mean key overflows fp16"):
        page_mean_keys(torch.full((1, 1, 16, 64), 1e5))


def test_input_dtypes_agree():
    d = 64
    layout, rot, cb = _setup(d)
    k, v = _kv(2, d, seed=3, dtype=torch.bfloat16)
    assert torch.equal(
        encode_pages(k, v, layout, rot, cb), encode_pages(k.float(), v.float(), layout, rot, cb)
    )
    k8, v8 = fp8_quantize(k.float(), 0.5), fp8_quantize(v.float(), 0.25)
    from_fp8 = encode_pages(k8, v8, layout, rot, cb, k_scale=0.5, v_scale=0.25)
    deq = encode_pages(fp8_dequantize(k8, 0.5), fp8_dequantize(v8, 0.25), layout, rot, cb)
    assert torch.equal(from_fp8, deq)


def test_deterministic_and_pinned():
    # Integer-derived input (exact in every dtype): a golden page for kernels to match.
    d = 64
    layout, rot, cb = _setup(d)
    i = torch.arange(H * P * d, dtype=torch.float32).view(1, H, P, d)
    k = ((i * 37) % 101 - 50) / 8
    v = ((i * 53) % 89 - 30) / 16
    a, b = encode_pages(k, v, layout, rot, cb), encode_pages(k, v, layout, rot, cb)
    assert torch.equal(a, b)
    assert hashlib.sha256(a.numpy().tobytes()).hexdigest() == GOLDEN_SHA256


# Re-pinned when the key codes moved to 6-bit table-index fields (layout.WORD_BITS). Only the placement
# of the key code bits changed: this page's key codes re-packed in the previous placement give back
# the previous pin, 0a8ca0c02d2c4e76267e82ba7b12b6f4ca6290c4166301ccde50c94af074de21, byte for byte
# (which in turn, re-packed 8 codes per 3 bytes, gives the first pin,
# 2daf680006df463c9cbd24fbfd8f1c89d7a70986a4e0d5d32d565ecfd6efe110).
GOLDEN_SHA256 = "2fa51530178d7b8bb8763eaa40f4f34668923b0a343f3f733ad15ce73b784064"


def test_bad_inputs():
    d = 64
    layout, rot, cb = _setup(d)
    k, v = _kv(1, d)
    with pytest.raises(ValueError, match="head_dim to be a positive multiple of 64, got 96"):
        TQ3PageLayout(H, P, 96)
    with pytest.raises(ValueError, match="page_size to be a positive multiple of 16, got 8"):
        TQ3PageLayout(H, 8, d)
    with pytest.raises(TypeError, match="dtype=torch.int32"):
        encode_pages(k.int(), v, layout, rot, cb)
    with pytest.raises(ValueError, match=r"k must have shape \[num_pages, 2, 16, 64\], got \(1, 2, 8, 64\)"):
        encode_pages(k[:, :, :8], v, layout, rot, cb)
    with pytest.raises(ValueError, match="k_scale applies to uint8 FP8 input only"):
        encode_pages(k, v, layout, rot, cb, k_scale=0.5)
    with pytest.raises(ValueError, match="rotation is for"):
        encode_pages(k, v, layout, LayerRotation(1, d, 0), cb)
    with pytest.raises(ValueError, match=r"shape \[num_pages, 1728\], got \(1, 1727\)"):
        decode_pages(torch.zeros(1, layout.page_bytes - 1, dtype=torch.uint8), layout, cb)
    with pytest.raises(ValueError, match="overflows fp16"):
        encode_pages(k, v * 1e5, layout, rot, cb)


@pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True)])
def test_lloyd_max_values_layout_and_recipe(key_bits, key_center):
    """``value_code="lloyd-max"``: no v_zero field (H*P*2 bytes a page fewer, k_mean moves up); the value
    codes are the 3-bit key recipe's on the rotated values, the scale fp16(<v', c> / <c, c>); the key
    fields are the uniform layout's, bit for bit; decode gives scale * centroids[codes]."""
    from sglang_minima.codec.codebook import key_codebook

    d = 128
    plain = TQ3PageLayout(H, P, d, key_bits, key_center)
    layout = TQ3PageLayout(H, P, d, key_bits, key_center, value_code="lloyd-max")
    assert layout.metadata_bytes == plain.metadata_bytes - H * P * 2 and layout.payload_bytes == plain.payload_bytes
    with pytest.raises(ValueError, match="lloyd-max values have no v_zero field"):
        _ = layout.v_zero_offset
    # what the GPU kernels do not read, with its flags (the decode backend's refusal, the conversions' log)
    # (page-centered keys are the kernels' too)
    assert layout.kernel_unread == ["lloyd-max values (--minima-value-code lloyd-max)"]
    assert plain.kernel_unread == []
    if key_center:
        assert layout.k_mean_offset == plain.k_mean_offset - H * P * 2
    with pytest.raises(ValueError, match="value_code='minmax'"):
        TQ3PageLayout(H, P, d, value_code="minmax")
    rot, cb = LayerRotation(H, d, layer_id=1), key_codebook(d, key_bits)
    k, v = _kv(3, d, seed=7)
    v[1, 0, 3] = 0.0  # an all-zero value: codes 0, scale 0
    pages, ref = encode_pages(k, v, layout, rot, cb), encode_pages(k, v, plain, rot, cb)
    f, g = page_fields(pages, layout), page_fields(ref, plain)
    assert f.v_zero is None and torch.equal(f.k_codes, g.k_codes) and torch.equal(f.k_norm, g.k_norm)
    if key_center:
        assert torch.equal(f.k_mean, g.k_mean)
    v_rot = rot.rotate(v, head_axis=-3)
    book = tq3_codebook(d)
    codes = unpack_codes(f.v_codes, VALUE, P, d)
    assert torch.equal(codes, quantize_keys(v_rot, book)[0])  # the key recipe's codes
    c = book.centroids[codes.long()].double()
    ls = (v_rot.double() * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-300)
    assert torch.equal(f.v_scale, ls.to(torch.float16))  # float64 then fp16: the same rounding here
    assert int(codes[1, 0, 3].count_nonzero()) == 0 and float(f.v_scale[1, 0, 3]) == 0.0
    q_codes, q_scale = quantize_values_lloyd_max(v_rot, book)  # the codec's own entry point, the same fields
    assert torch.equal(q_codes, codes) and torch.equal(q_scale, f.v_scale)
    k_hat, v_hat = decode_pages(pages, layout, cb)
    assert torch.equal(k_hat, decode_pages(ref, plain, cb)[0])
    assert torch.equal(v_hat, f.v_scale.float().unsqueeze(-1) * book.centroids[codes.long()])
    end = layout.payload_bytes + layout.metadata_bytes
    assert torch.count_nonzero(pages[:, end:]) == 0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_lloyd_max_values_err_less_than_uniform(d):
    """What the code is for: on rotated (near-Gaussian) values, Lloyd-Max levels with a least-squares
    scale leave less squared error than the per-token min/max grid, with 16 bits a token fewer."""
    rot, cb = LayerRotation(H, d, layer_id=1), tq3_codebook(d)
    k, v = _kv(8, d, seed=8)
    v_rot = rot.rotate(v, head_axis=-3)

    def err(value_code: str) -> float:
        layout = TQ3PageLayout(H, P, d, value_code=value_code)
        v_hat = decode_pages(encode_pages(k, v, layout, rot, cb), layout, cb)[1]
        return float(((v_hat - v_rot) ** 2).sum() / (v_rot**2).sum())

    uniform, lloyd = err("uniform"), err("lloyd-max")
    # the min/max grid's step grows with a token's extreme coordinates, so with the head dim (measured
    # here: 0.037 / 0.045 / 0.054 of the energy at d = 64 / 128 / 256); the Lloyd-Max levels' error is
    # about 0.033 at every d (ratios 0.86-0.88, 0.72-0.74, 0.62-0.63 over three seeds)
    assert lloyd < {64: 0.92, 128: 0.8, 256: 0.7}[d] * uniform, (lloyd, uniform)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("key_center,value_code,value_bits",
                         [(False, "uniform", 3), (True, "uniform", 3), (False, "lloyd-max", 3), (False, "uniform", 4)],
                         ids=["plain", "key_center", "lloyd_max", "value_bits4"])
def test_gpu_bytes_match_cpu(d, key_center, value_code, value_bits):
    _, rot, cb = _setup(d)
    # the mean's and the least-squares scale's fixed-order sums: the same bits too
    layout = TQ3PageLayout(H, P, d, key_center=key_center, value_code=value_code, value_bits=value_bits)
    k, v = _kv(256, d, seed=4, dtype=torch.bfloat16)
    gpu_rot = LayerRotation(H, d, layer_id=1, device="cuda")
    cpu = encode_pages(k, v, layout, rot, cb)
    gpu = encode_pages(k.cuda(), v.cuda(), layout, gpu_rot, cb.to("cuda"))
    assert torch.equal(cpu, gpu.cpu())
