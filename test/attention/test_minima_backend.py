"""The ``minima`` backend (decode through the fused GPU kernels) against ``minima_native`` on the same
pool state: the real MinimaKVPool + allocator on CUDA, FP8 and TQ3 pages mixed, GQA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_minima.layers.attention.minima_backend import MinimaAttnBackend

from attention_fakes import fake_runner
from test_minima_native_backend import PS, Harness


def test_refuses_the_cpu(monkeypatch):
    h = Harness.real(monkeypatch, device="cpu")
    with pytest.raises(ValueError, match="minima_native"):
        MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True)], ids=["k3", "k4", "k4-center"])
def test_kernel_decode_matches_minima_native(monkeypatch, key_bits, key_center):
    h = Harness.real(monkeypatch, device="cuda", key_bits=key_bits, key_center=key_center)
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
    assert (kernels._wrapper.layout.key_bits, kernels._wrapper.layout.key_center) == (key_bits, key_center)


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


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True)], ids=["k3", "k4", "k4-center"])
def test_cuda_graph_replays_match_minima_native_as_pages_change_format(monkeypatch, key_bits, key_center):
    """SGLang's decode-graph protocol (init_cuda_graph_state; per batch size out_graph with
    in_capture, an eager warm-up, the capture of in_graph + every layer; per step out_graph and
    replay) over static batch buffers with a padding row: each replay matches minima_native's eager
    step on the same pool state, while new pages are allocated and others converted to TQ3 between
    replays, and is bit-equal to the same captured body run eagerly. The route counts summed in the
    graph are the eager host counts, padding row left out."""
    from test_minima_native_backend import HQ, D

    h = Harness.real(monkeypatch, device="cuda", key_bits=key_bits, key_center=key_center)
    kernels = MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))
    bs, dev = 4, h.device
    kernels.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    h.step({1: 3 * PS + 1, 2: 5 * PS + 2, 3: PS - 3}, ForwardMode.EXTEND)
    h.retier_prefix(2, 2)
    static = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=bs, encoder_lens=None,
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),  # row 0: SGLang's padding row
        seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),  # get_cuda_graph_seq_len_fill_value
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=dev),
    )
    q_in = torch.zeros(len(h.layers), bs, HQ * D, device=dev)
    outs: list[torch.Tensor] = []

    def body() -> list[torch.Tensor]:  # what the graph runner records
        kernels.init_forward_metadata_in_graph(static)
        return [kernels.forward(q_in[i], None, None, layer, static, save_kv_cache=False) for i, layer in enumerate(h.layers)]

    graph = torch.cuda.CUDAGraph()
    expected = torch.zeros(4, dtype=torch.int64)
    real = 3
    for step in range(4):
        fb = h.batch({1: 1, 2: 1, 3: 1}, ForwardMode.DECODE)
        h.backend.init_forward_metadata(fb)  # the reference, eager: it writes each layer's new K/V
        qs, want = [], []
        for layer in h.layers:
            q, k, v = h.qkv(real)
            qs.append(q)
            want.append(h.backend.forward(q, k, v, layer, fb))
        c = h.backend.forward_metadata.counts
        step_counts = torch.tensor([c.hot_pages, c.hot_tokens, c.tq3_pages, c.tq3_tokens])
        static.req_pool_indices.zero_()
        static.seq_lens.fill_(1)
        static.req_pool_indices[:real] = fb.req_pool_indices
        static.seq_lens[:real] = fb.seq_lens
        q_in.zero_()
        for i, q in enumerate(qs):
            q_in[i, :real] = q
        if step == 0:
            kernels.init_forward_metadata_out_graph(static, in_capture=True)
            body()  # the runner's eager warm-up: builds the kernels, binds the buffers
            expected += step_counts
            with torch.cuda.graph(graph):
                outs = body()
        kernels.init_forward_metadata_out_graph(static)
        graph.replay()
        torch.cuda.synchronize()
        got = [o[:real].clone() for o in outs]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)  # bf16 queries and outputs
        eager = body()  # the same body, not captured: the same kernels, splits and bits
        for g, e in zip(got, eager):
            assert torch.equal(g, e[:real])
        expected += 2 * step_counts
        if step == 1:
            h.retier_prefix(1, 2, skip_first=1)  # row 1's sink stays FP8; two pages go Stale
        if step == 2:
            h.retier(h.pages_of(2)[2:4])
    h.pool.store.device_routes.fold(h.pool.stats, wait=True)
    assert h.pool.store.device_routes.totals.cpu().tolist() == expected.tolist()
    assert int(expected[2]) > 0 and h.pool.stats.fallbacks == 0


def _fp8_exact(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to what an FP8 hot page holds (scale a power of two: exact in bf16 too), so the
    prefill's bf16 new tokens and the torch path's FP8 copies of them are the same numbers."""
    from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize

    return fp8_dequantize(fp8_quantize(x, scale), scale)


@pytest.mark.gpu
@pytest.mark.parametrize("key_bits,key_center", [(3, False), (4, False), (4, True)], ids=["k3", "k4", "k4-center"])
def test_kernel_extend_matches_minima_native(monkeypatch, key_bits, key_center):
    """Extend, chunked prefill over the request's own TQ3 pages, a fresh prompt beside them (no hot
    prefix: an empty paged state) and a mixed batch (a decode row among extend rows), with FP8
    scales != 1: the FlashInfer + TQ3-tile prefill against minima_native on the same pool state."""
    from minima_kernels.prefill import MinimaPrefillWrapper

    h = Harness.real(monkeypatch, device="cuda", key_bits=key_bits, key_center=key_center)
    for layer in h.layers:  # the scales a checkpoint gives its layers: every write and read uses them
        layer.k_scale_float, layer.v_scale_float = 0.5, 0.25
    kernels = MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))
    plans = []
    real_plan = MinimaPrefillWrapper.plan

    def spy(self, *args):
        plans.append(args)
        return real_plan(self, *args)

    monkeypatch.setattr(MinimaPrefillWrapper, "plan", spy)
    read_ends = []

    def run(new_tokens, mode):
        fb = h.batch(new_tokens, mode)
        h.backend.init_forward_metadata(fb)
        kernels.init_forward_metadata(fb)
        t = int(fb.out_cache_loc.numel())
        # where SGLang's overlap scheduler may let its next batch (and Minima's tick) write: after the plan
        read_ends.append(kernels.resolve_prefill_shared_read_ends(fb, num_qo_tokens=t))
        for layer in h.layers:
            q, k, v = h.qkv(t)
            k, v = _fp8_exact(k, 0.5), _fp8_exact(v, 0.25)
            # each backend its own copy: SGLang's FP8 write divides k and v by the scales in place
            want = h.backend.forward(q, k.clone(), v.clone(), layer, fb)  # writes the new tokens' K/V
            got = kernels.forward(q, k, v, layer, fb, save_kv_cache=False)
            assert got.shape == want.shape and got.dtype == q.dtype
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 queries and outputs

    run({1: 3 * PS + 1, 2: 5 * PS + 2}, ForwardMode.EXTEND)  # fresh prompts: the causal part only
    h.retier_prefix(1, 2, skip_first=1)  # row 1: FP8 sink page, 2 TQ3 pages, FP8 tail
    h.retier_prefix(2, 4)  # row 2: 4 TQ3 pages, FP8 tail
    run({1: 20, 2: 7, 3: PS + 5}, ForwardMode.EXTEND)  # next chunks over TQ3 pages; row 3 a fresh prompt
    run({1: 1, 2: 9, 3: 1}, ForwardMode.MIXED)
    assert kernels._prefill is not None and h.pool.stats.fallbacks == 0
    # the first extend's layers may take the torch path (it plans at its layer): the whole forward;
    # then the kernels' steps end their shared reads at the plan; a mixed batch is SGLang's coarse case
    assert read_ends == [SharedReadEnds.UNKNOWN, SharedReadEnds.PRE_REPLAY, SharedReadEnds.UNKNOWN]
    assert kernels._prefill._dequant.key_bits == key_bits  # the tile decoder of the pool's key width
    qo, prefix_indptr, _, prefix_rows, tq3 = plans[1]
    assert qo.tolist() == [0, 20, 27, 27 + PS + 5]
    assert prefix_indptr.diff().tolist() == [PS + 1, PS + 2, 0]  # sink or FP8 page + the partial page
    assert prefix_rows is not None and int(prefix_rows.sum()) == 27
    assert [s.pages.numel() for s in tq3] == [2, 4]
    assert plans[0][3] is None and plans[0][4] == () and int(plans[0][1][-1]) == 0
    assert h.pool.k_scale(0) == 0.5 and h.pool.v_scale(1) == 0.25


@pytest.mark.gpu
def test_an_extend_the_split_refuses_is_attended_by_the_torch_path_and_counted(monkeypatch):
    import sglang_minima.layers.attention.minima_backend as backend_module

    h = Harness.real(monkeypatch, device="cuda")
    kernels = MinimaAttnBackend(fake_runner(h.pool, h.req_to_token))

    def refuse(plan, q_lens, kv_lens, *, tq3_possible=True):  # split_extend's signature
        raise ValueError("a TQ3 page overlaps the new tokens")

    monkeypatch.setattr(backend_module, "split_extend", refuse)
    for step in range(2):
        fb = h.batch({1: PS + 3, 2: 5}, ForwardMode.EXTEND)
        h.backend.init_forward_metadata(fb)
        kernels.init_forward_metadata(fb)
        for layer in h.layers:
            q, k, v = h.qkv(int(fb.out_cache_loc.numel()))
            want = h.backend.forward(q, k, v, layer, fb)
            got = kernels.forward(q, k, v, layer, fb, save_kv_cache=False)
            torch.testing.assert_close(got, want)  # the torch path itself
        assert h.pool.stats.fallbacks == step + 1
        # the torch path planned at its first layer, after SGLang's snapshot point: the whole forward
        assert kernels.resolve_prefill_shared_read_ends(fb, num_qo_tokens=PS + 8) is SharedReadEnds.UNKNOWN
