"""Lloyd-Max codebooks: the known Gaussian optimum, Lloyd's conditions, the sphere density."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_minima.codec.codebook import tq3_codebook


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_gaussian_matches_known_optimum():
    cb = tq3_codebook(None)
    want = [0.2451, 0.7560, 1.3440, 2.1520]
    assert cb.centroids[4:].tolist() == pytest.approx(want, abs=2e-4)
    assert cb.centroids[:4].flip(0).tolist() == pytest.approx([-w for w in want], abs=2e-4)
    assert cb.mse == pytest.approx(0.03454, abs=2e-5)


def test_gaussian_centroids_are_conditional_means():
    # Closed form: E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a)).
    cb = tq3_codebook(None)
    edges = [-math.inf] + cb.thresholds.tolist() + [math.inf]
    for k, c in enumerate(cb.centroids.tolist()):
        a, b = edges[k], edges[k + 1]
        pa = 0.0 if math.isinf(a) else _phi(a)
        pb = 0.0 if math.isinf(b) else _phi(b)
        assert c == pytest.approx((pa - pb) / (_cdf(b) - _cdf(a)), abs=1e-6)


@pytest.mark.parametrize("d", [8, 64, 128])
def test_sphere_codebook_satisfies_lloyd(d):
    # Independent check on a different grid (midpoint rule): conditional means and midpoints.
    cb = tq3_codebook(d)
    n = 2_000_000
    half = math.sqrt(d)
    x = (torch.arange(n, dtype=torch.float64) + 0.5) / n * 2 * half - half
    w = (1 - x * x / d).clamp_min(0) ** ((d - 3) / 2)
    t = cb.thresholds.double()
    cell = torch.bucketize(x, t)
    for k in range(8):
        sel = cell == k
        assert float(cb.centroids[k]) == pytest.approx(
            float((x[sel] * w[sel]).sum() / w[sel].sum()), abs=2e-5
        )
    c = cb.centroids.double()
    assert torch.allclose(t, 0.5 * (c[1:] + c[:-1]), atol=1e-7)
    mse = float(((x - c[cell]) ** 2 * w).sum() / w.sum())
    assert cb.mse == pytest.approx(mse, abs=1e-6)


def test_sphere_approaches_gaussian_and_is_sorted():
    g = tq3_codebook(None)
    errs = [float((tq3_codebook(d).centroids - g.centroids).abs().max()) for d in (64, 256, 1024)]
    assert errs[0] > errs[1] > errs[2]
    for d in (64, 128, 256):
        cb = tq3_codebook(d)
        assert bool((cb.centroids[1:] > cb.centroids[:-1]).all())
        assert torch.equal(cb.centroids, -cb.centroids.flip(0))
        assert cb.centroids.dtype == cb.thresholds.dtype == torch.float32


def test_sphere_beats_gaussian_codebook_on_sphere_data():
    d = 64
    u = torch.randn(20000, d, dtype=torch.float64)
    x = (u / u.norm(dim=-1, keepdim=True) * math.sqrt(d)).reshape(-1)

    def mse(cb):
        return float(((x - cb.centroids.double()[torch.bucketize(x, cb.thresholds.double())]) ** 2).mean())

    assert mse(tq3_codebook(d)) < mse(tq3_codebook(None))
