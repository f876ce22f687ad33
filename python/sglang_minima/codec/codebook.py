"""Lloyd-Max codebooks for rotated key coordinates (3-bit TQ3, or 4-bit keys), derived in code.

After a random rotation, a key of norm n is n·u with u close to uniform on the sphere S^{d-1}; the
codec quantizes x_i = sqrt(d)·u_i, whose exact density is

    f_d(x) ∝ (1 - x²/d)^((d-3)/2)   on |x| < sqrt(d)     (-> N(0, 1) as d -> inf).

Lloyd iterations (thresholds = midpoints, centroids = conditional means) run in float64 on a fixed
fine grid (cumulative trapezoid integrals, linear interpolation at the thresholds), then round to
fp32. Everything is deterministic, so every process derives the same codebook bits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .layout import KEY_BITS_CHOICES, NUM_CODES, TQ3_BITS

_GRID_POINTS = (1 << 18) + 1
_GAUSS_HALF_WIDTH = 12.0  # tail mass beyond 12 sigma is ~1e-33: irrelevant at float64
_MAX_ITERS = 20000
_TOL = 1e-13


@dataclass(frozen=True)
class Codebook:
    """Centroids (ascending) and decision thresholds (midpoints) for one coordinate distribution."""

    centroids: torch.Tensor  # fp32 [levels]: NUM_CODES (3-bit keys) or 16 (4-bit keys)
    thresholds: torch.Tensor  # fp32 [levels - 1]
    head_dim: int | None  # None: the N(0, 1) limit
    mse: float  # expected squared error per coordinate (unit variance), float64

    @property
    def levels(self) -> int:
        return self.centroids.numel()

    def to(self, device: torch.device | str) -> Codebook:
        return Codebook(self.centroids.to(device), self.thresholds.to(device), self.head_dim, self.mse)


def _log_density(x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    if head_dim is None:
        return -0.5 * x * x
    return 0.5 * (head_dim - 3) * torch.log1p(-(x * x) / head_dim)


def _cumulative(y: torch.Tensor, dx: float) -> torch.Tensor:
    """Cumulative trapezoid integral, starting at 0."""
    steps = 0.5 * (y[1:] + y[:-1]) * dx
    return torch.cat((y.new_zeros(1), torch.cumsum(steps, 0)))


def _interp(xq: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    i = torch.searchsorted(x, xq).clamp(1, x.numel() - 1)
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return y0 + (y1 - y0) * (xq - x0) / (x1 - x0)


def lloyd_max(head_dim: int | None, levels: int = NUM_CODES) -> tuple[torch.Tensor, float]:
    """Float64 Lloyd-Max centroids for f_d (head_dim) or N(0, 1) (None), and their MSE."""
    if head_dim is not None and head_dim < 4:
        raise ValueError(f"sphere codebook needs head_dim >= 4, got {head_dim}")
    half = _GAUSS_HALF_WIDTH if head_dim is None else min(math.sqrt(head_dim), _GAUSS_HALF_WIDTH)
    x = torch.linspace(-half, half, _GRID_POINTS, dtype=torch.float64)
    dx = 2 * half / (_GRID_POINTS - 1)
    logf = _log_density(x.clamp(-half * (1 - 1e-15), half * (1 - 1e-15)), head_dim)
    f = torch.exp(logf - logf.max())
    cdf, first = _cumulative(f, dx), _cumulative(x * f, dx)
    second_moment = float(_cumulative(x * x * f, dx)[-1] / cdf[-1])

    # Start from equal-probability cells' midpoints: converges from any ordered start.
    probs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = _interp(probs * cdf[-1], cdf, x)
    for _ in range(_MAX_ITERS):
        t = 0.5 * (c[1:] + c[:-1])
        edges = torch.cat((x[:1], t, x[-1:]))
        mass = torch.diff(_interp(edges, x, cdf))
        new_c = torch.diff(_interp(edges, x, first)) / mass
        done = float((new_c - c).abs().max()) < _TOL
        c = new_c
        if done:
            break
    edges = torch.cat((x[:1], 0.5 * (c[1:] + c[:-1]), x[-1:]))
    mass = torch.diff(_interp(edges, x, cdf)) / cdf[-1]
    # With conditional-mean centroids, E[(X - Q(X))^2] = E[X^2] - sum_k P_k c_k^2.
    mse = second_moment - float((mass * c * c).sum())
    return c, mse


@functools.cache
def tq3_codebook(head_dim: int | None) -> Codebook:
    """The TQ3 key codebook for sqrt(d)·u_i (head_dim=d), or the Gaussian limit (None). Cached; CPU."""
    return _sphere_codebook(head_dim, NUM_CODES)


@functools.cache
def key_codebook(head_dim: int | None, bits: int = TQ3_BITS) -> Codebook:
    """The key codebook of a ``bits``-bit key code (``TQ3PageLayout.key_bits``): 3, ``tq3_codebook``
    (the same object); 4, the 16-level Lloyd-Max code of the same density, built the same way
    (centroids and midpoint thresholds in float64, rounded once to fp32). Cached; CPU."""
    if bits not in KEY_BITS_CHOICES:
        raise ValueError(f"key codes are {' or '.join(map(str, KEY_BITS_CHOICES))} bits wide, got bits={bits}")
    return tq3_codebook(head_dim) if bits == TQ3_BITS else _sphere_codebook(head_dim, 1 << bits)


def _sphere_codebook(head_dim: int | None, levels: int) -> Codebook:
    c, mse = lloyd_max(head_dim, levels)
    t = 0.5 * (c[1:] + c[:-1])
    return Codebook(c.to(torch.float32), t.to(torch.float32), head_dim, mse)
