"""Fixed randomized rotations of K/V head vectors, one per (layer, kv head).

Power-of-two head dims (64, 128, 256, ...): R = H_d · diag(signs) / sqrt(d), applied with a fast
Walsh-Hadamard transform whose butterflies run in a fixed order in fp32. Every output element is a
chain of IEEE fp32 adds/subs plus one final multiply by fp32(1/sqrt(d)), so CPU and GPU produce the
same bits (no reductions whose order a backend could choose, nothing an FMA could contract).

Other head dims (multiples of 8, e.g. 80 or 96): a seeded random orthogonal matrix (QR of a Gaussian
matrix in float64 on CPU, sign-fixed so it is unique), applied as an fp32 matmul. That matrix is the
same everywhere, but a matmul's summation order is not, so the rotated values of this fallback are
reproducible only to rounding, not bit for bit.

Signs and matrices come from a CPU ``torch.Generator`` seeded by (seed, layer_id, kv_head), then move
to the target device, so every process and device sees the same rotation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROTATION_DIM_MULTIPLE = 8  # the rotation itself works for any multiple of 8; TQ3 pages need 64

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, layer_id: int, kv_head: int) -> int:
    """One well-mixed 63-bit generator seed per (seed, layer_id, kv_head)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (layer_id & _MASK64))
    x = _splitmix64(x ^ (kv_head & _MASK64))
    return x & ((1 << 63) - 1)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fp32_inv_sqrt(head_dim: int) -> float:
    """fp32(1/sqrt(head_dim)), the Hadamard path's one multiply (kernels bake the same value in)."""
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last dim (a power of two), fp32, fixed order.

    Stage h = 1, 2, 4, ...: for each block of 2h elements, (a, b) -> (a + b, a - b) with a the
    element at i and b the one at i + h. Returns H_d x with H_d the Sylvester Hadamard matrix.
    """
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"fwht needs a power-of-two last dim, got {d}")
    lead = x.shape[:-1]
    y = x.to(torch.float32).reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, d)


def _hadamard_signs(head_dim: int, seed: int, layer_id: int, kv_head: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(stream_seed(seed, layer_id, kv_head))
    return torch.randint(0, 2, (head_dim,), generator=g, dtype=torch.int64).to(torch.float32) * 2 - 1


def _random_orthogonal(head_dim: int, seed: int, layer_id: int, kv_head: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(stream_seed(seed, layer_id, kv_head))
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    # Fix the QR sign ambiguity so the matrix is a function of the seed alone (Haar-distributed).
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32)


@dataclass(frozen=True)
class LayerRotation:
    """The rotations of all KV heads of one layer.

    ``rotate(x, head_axis)`` applies R_h to x[..., h, ..., :] along the last dim, where the size of
    ``head_axis`` is num_kv_heads or a multiple of it (GQA query heads: q head i uses kv head
    i // group). ``unrotate`` applies R_h^T.
    """

    num_kv_heads: int
    head_dim: int
    layer_id: int
    seed: int = 0
    device: torch.device | str = "cpu"
    # Hadamard dims: signs [H, D] (+-1). Fallback dims: matrices [H, D, D] (rotate(x) = R @ x).
    signs: torch.Tensor | None = field(init=False, repr=False, compare=False)
    matrices: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        d = self.head_dim
        if d <= 0 or d % ROTATION_DIM_MULTIPLE != 0:
            raise ValueError(
                f"rotation needs head_dim to be a positive multiple of {ROTATION_DIM_MULTIPLE}, got {d}"
            )
        if self.num_kv_heads <= 0:
            raise ValueError(f"rotation needs num_kv_heads > 0, got {self.num_kv_heads}")
        heads = range(self.num_kv_heads)
        signs = matrices = None
        if self.is_hadamard:
            signs = torch.stack([_hadamard_signs(d, self.seed, self.layer_id, h) for h in heads])
            signs = signs.to(self.device)
        else:
            matrices = torch.stack([_random_orthogonal(d, self.seed, self.layer_id, h) for h in heads])
            matrices = matrices.to(self.device)
        object.__setattr__(self, "signs", signs)
        object.__setattr__(self, "matrices", matrices)

    @property
    def is_hadamard(self) -> bool:
        return is_power_of_two(self.head_dim)

    @property
    def inv_sqrt_d(self) -> float:
        """The one multiply of the Hadamard path, fp32(1/sqrt(d))."""
        return fp32_inv_sqrt(self.head_dim)

    def _heads_last(self, x: torch.Tensor, head_axis: int) -> tuple[torch.Tensor, int]:
        """x as fp32 [..., n, D] with the head axis moved next to head_dim, and n // num_kv_heads."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"rotation: last dim must be head_dim={self.head_dim}, got {x.shape[-1]}")
        if head_axis % x.dim() == x.dim() - 1:
            raise ValueError("rotation: head_axis must not be the last (head_dim) axis")
        n = x.shape[head_axis]
        if n % self.num_kv_heads != 0:
            raise ValueError(
                f"rotation: size {n} of head axis {head_axis} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        return x.to(torch.float32).movedim(head_axis, -2), n // self.num_kv_heads

    def rotate(self, x: torch.Tensor, head_axis: int = -2) -> torch.Tensor:
        """x' = R x over the last dim (fp32)."""
        xm, group = self._heads_last(x, head_axis)
        if self.is_hadamard:
            signs = self.signs.to(x.device).repeat_interleave(group, dim=0)
            y = fwht(xm * signs) * self.inv_sqrt_d
        else:
            r = self.matrices.to(x.device).repeat_interleave(group, dim=0)
            y = (r @ xm.unsqueeze(-1)).squeeze(-1)
        return y.movedim(-2, head_axis)

    def unrotate(self, x: torch.Tensor, head_axis: int = -2) -> torch.Tensor:
        """x = R^T x' over the last dim (fp32)."""
        xm, group = self._heads_last(x, head_axis)
        if self.is_hadamard:
            signs = self.signs.to(x.device).repeat_interleave(group, dim=0)
            y = fwht(xm) * self.inv_sqrt_d * signs
        else:
            r = self.matrices.to(x.device).repeat_interleave(group, dim=0)
            y = (r.transpose(-1, -2) @ xm.unsqueeze(-1)).squeeze(-1)
        return y.movedim(-2, head_axis)

    def matrix(self) -> torch.Tensor:
        """Dense R as fp32 [num_kv_heads, D, D], rotate(x)[h] == R[h] @ x[h] (for tests and kernels)."""
        if not self.is_hadamard:
            return self.matrices.clone()
        eye = torch.eye(self.head_dim, dtype=torch.float32, device=self.signs.device)
        cols = self.rotate(eye.unsqueeze(1).expand(-1, self.num_kv_heads, -1), head_axis=1)  # [D(i), H, D]
        return cols.permute(1, 2, 0).contiguous()  # R[h][:, i] = R_h e_i
