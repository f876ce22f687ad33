"""The ``minima`` backend (decode through the fused GPU kernels) against ``minima_native`` on the same
pool state: the real MinimaKVPool + allocator on CUDA, FP8 and TQ3 pages mixed, GQA."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_minima.layers.attention.minima_backend import MinimaAttnBackend

from attention_fakes import fake_runner
from test_minima_native_backend import PS, Harness


def test_refuses_the_cpu(monkeypatch):
    h = Harness.real(monkeypatch, device="cpu")
    with pytest.raises(ValueError, match="minima_native"):
        MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))


@pytest.mark.gpu
def test_kernel_decode_matches_minima_native(monkeypatch):
    h = Harness.real(monkeypatch, device="cuda")
    kernels = MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))
    h.step({1: 3 * PS + 1, 2: 5 * PS + 2, 3: PS - 3}, ForwardMode.EXTEND)
    h.retier_prefix(1, 2, skip_first=1)  # row 1: FP8 sink page, 2 TQ3 pages, FP8 tail
    h.retier_prefix(2, 4)  # row 2: 4 TQ3 pages, FP8 tail; row 3: one partial FP8 page only
    for _ in range(3):
        fb = h.batch({1: 1, 2: 1, 3: 1}, ForwardMode.DECODE)
        h.backend.init_forward_metadata(fb)
        kernels.init_forward_metadata(fb)
        for layer in h.layers:
            q, k, v = h.qkv(3)
            want = h.backend.forward(q, k, v, layer, fb)  # writes the new token's K/V
            got = kernels.forward(q, k, v, layer, fb, save_kv_cache=False)
            assert got.shape == want.shape and got.dtype == q.dtype
            # the kernels take bf16 queries and give bf16 outputs: bf16 tolerance
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert kernels._wrapper is not None and h.pool.stats.fallbacks == 0


@pytest.mark.gpu
def test_a_step_the_kernels_refuse_is_attended_by_the_torch_path_and_counted(monkeypatch):
    from minima_kernels import MinimaDecodeWrapper

    h = Harness.real(monkeypatch, device="cuda")
    kernels = MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))
    h.step({1: 2 * PS + 5, 2: PS + 1}, ForwardMode.EXTEND)
    h.retier_prefix(1, 1)

    def refuse(self, *args, **kwargs):
        raise ValueError("num_splits=0: the split combine takes 1 to 1024")  # as choose_path refuses

    monkeypatch.setattr(MinimaDecodeWrapper, "plan", refuse)
    for step in range(2):
        fb = h.batch({1: 1, 2: 1}, ForwardMode.DECODE)
        h.backend.init_forward_metadata(fb)
        kernels.init_forward_metadata(fb)
        for layer in h.layers:
            q, k, v = h.qkv(2)
            want = h.backend.forward(q, k, v, layer, fb)
            got = kernels.forward(q, k, v, layer, fb, save_kv_cache=False)
            torch.testing.assert_close(got, want)  # the torch path itself: the same op, the same bits
        assert h.pool.stats.fallbacks == step + 1  # once per step, not per layer
