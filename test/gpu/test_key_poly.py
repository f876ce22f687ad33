"""The decode kernel's key centroids: an odd polynomial evaluated in fp16 FMAs (CPU, no GPU needed).

The kernel turns a 3-bit key code c into its Lloyd-Max centroid as y * g(y^2), y = c - 3.5, in fp16x2
arithmetic (tq3_decode.key_poly fits g per head dim). Here that evaluation is replayed with exact fp16
rounding after every fused multiply-add and compared with the fp16 codebook the reference uses.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("tilelang")
pytest.importorskip("flashinfer")  # minima_kernels imports it


def _f16(x):
    return np.float16(x).astype(np.float64)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_polynomial_centroids_within_one_fp16_ulp(head_dim: int) -> None:
    from minima_kernels.decode import key_centroids_fp16
    from minima_kernels.tq3_decode import key_poly

    centroids = np.array(key_centroids_fp16(head_dim))
    b0, b1, b2, b3 = key_poly(tuple(centroids))
    for code in range(8):
        y = _f16(code - 3.5)
        u = _f16(y * y)
        g = _f16(_f16(_f16(u * b3 + b2) * u + b1) * u + b0)
        got = _f16(g * y)
        ulp = float(np.spacing(np.float16(abs(centroids[code]))))
        assert abs(got - centroids[code]) <= ulp, (code, got, centroids[code])
    # odd: codes c and 7 - c decode to exact negatives (fp16 negation is exact)
    assert torch.equal(torch.tensor(centroids[:4]), -torch.tensor(centroids[4:][::-1].copy()))
