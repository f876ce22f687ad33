"""Rotations: orthogonality, exact inverse, GQA heads, determinism across runs and devices."""

from __future__ import annotations

import pytest
import torch

from sglang_minima.codec.rotation import LayerRotation, fwht, stream_seed


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_fwht_is_sylvester_hadamard(d):
    x = torch.randn(5, d)
    assert torch.allclose(fwht(x), x @ _sylvester(d).T, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128, 256, 96, 80])
def test_orthogonal_and_inverse(d):
    rot = LayerRotation(num_kv_heads=3, head_dim=d, layer_id=5, seed=11)
    r = rot.matrix()
    assert torch.allclose(r @ r.transpose(1, 2), torch.eye(d).expand(3, d, d), atol=1e-5)
    x = torch.randn(4, 3, 7, d)
    y = rot.rotate(x, head_axis=1)
    assert torch.allclose(torch.einsum("hij,bhtj->bhti", r, x), y, atol=1e-5)
    assert torch.allclose(rot.unrotate(y, head_axis=1), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_gqa_query_heads_use_their_kv_head():
    rot = LayerRotation(num_kv_heads=2, head_dim=64, layer_id=0)
    q = torch.randn(3, 6, 64)  # 3 query heads per kv head
    r = rot.matrix()
    want = torch.einsum("hij,thj->thi", r.repeat_interleave(3, 0), q)
    assert torch.allclose(rot.rotate(q), want, atol=1e-5)


def test_heads_differ_and_seeds_are_distinct():
    rot = LayerRotation(num_kv_heads=4, head_dim=128, layer_id=0)
    assert len({tuple(s.tolist()) for s in rot.signs}) == 4
    seeds = {stream_seed(0, layer, head) for layer in range(64) for head in range(16)}
    assert len(seeds) == 64 * 16


def test_deterministic_across_instances():
    a, b = LayerRotation(2, 128, 7, seed=3), LayerRotation(2, 128, 7, seed=3)
    assert torch.equal(a.signs, b.signs)
    x = torch.randn(10, 2, 128)
    assert torch.equal(a.rotate(x), b.rotate(x))
    assert not torch.equal(a.signs, LayerRotation(2, 128, 8, seed=3).signs)


def test_signs_are_pinned():
    # Guards the generator recipe: a change here changes every stored TQ3 page.
    rot = LayerRotation(1, 64, layer_id=0, seed=0)
    assert rot.signs[0, :16].tolist() == PINNED_SIGNS


PINNED_SIGNS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]


def test_bad_head_dims():
    with pytest.raises(ValueError, match="got 100"):
        LayerRotation(1, 100, 0)
    rot = LayerRotation(2, 64, 0)
    with pytest.raises(ValueError, match="head_dim=64, got 32"):
        rot.rotate(torch.randn(2, 2, 32))
    with pytest.raises(ValueError, match="size 3 of head axis"):
        rot.rotate(torch.randn(2, 3, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bit_identical_on_gpu(d):
    cpu = LayerRotation(4, d, 3)
    gpu = LayerRotation(4, d, 3, device="cuda")
    x = torch.randn(257, 4, d) * 10
    assert torch.equal(cpu.rotate(x), gpu.rotate(x.cuda()).cpu())
    assert torch.equal(cpu.unrotate(x), gpu.unrotate(x.cuda()).cpu())
