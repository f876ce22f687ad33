"""MinimaNativeAttnBackend on a fake pool: decode, extend and chunked prefill over mixed FP8/TQ3
pages against dense softmax attention over the decoded cache; and against SGLang's torch_native.
The real pool + allocator run on CPU and, on a GPU machine, on CUDA (pools, page table, conversions
and the tiled attention all on the device)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_minima.config import CONFIG_ENV, MinimaConfig

from sglang_minima.layers.attention import MINIMA_NATIVE_BACKEND, register_attention_backends
from sglang_minima.layers.attention.minima_native_backend import MinimaNativeAttnBackend
from sglang_minima.layers.attention.plan import RouteCounts
from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.kv_pool import MinimaKVPool
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3

from attention_fakes import FakeLayer, FakeMinimaPool, fake_runner, reference_attention

HQ, HKV, D, PS, LAYERS = 4, 2, 64, 16, 2  # TQ3: head_dim a multiple of 64, pages of whole 16-token tiles
ATOL = 2e-5


class Harness:
    """Requests on a Minima pool, driven through the backend the way ModelRunner drives it.

    ``new_page()`` allocates and maps one logical page (the allocator's job), ``retier(pages)``
    converts sealed hot pages to TQ3 (the controller's job).
    """

    def __init__(self, pool, new_page: Callable[[], int], retier: Callable[[list[int]], None],
                 num_rows: int = 4, max_len: int = 8 * PS, device: str = "cpu", runner_pool=None,
                 layer_ids: tuple[int, ...] = tuple(range(LAYERS))):
        self.pool = pool
        self.new_page = new_page
        self.retier = retier
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(num_rows, max_len, dtype=torch.int32, device=device)
        self.lens = [0] * num_rows
        self.backend = MinimaNativeAttnBackend(fake_runner(runner_pool or self.pool, self.req_to_token))
        # The model's attention layers and, for each, the pool's index of it (dense in a hybrid's pool).
        self.layers = [FakeLayer(i, HQ, HKV, D, scaling=1 / math.sqrt(D)) for i in layer_ids]
        self.pool_layer = {i: n for n, i in enumerate(layer_ids)} if runner_pool is not None else {i: i for i in layer_ids}
        self._gen = torch.Generator().manual_seed(0)

    @classmethod
    def fake(cls, hot_dtype: str = "fp8_e4m3", score_anchors: bool = False, key_bits: int = 3,
             anchor_window: int = 0) -> Harness:
        pool = FakeMinimaPool(
            num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, page_size=PS, num_logical_pages=64,
            num_hot_pages=40, num_tq3_pages=40, score_anchors=score_anchors, key_bits=key_bits,
            anchor_window=anchor_window,
            hot_dtype=torch.float32 if hot_dtype == "auto" else hot_dtype,
        )
        # Logical pages handed out in a scrambled order, so logical and physical ids differ.
        free = (torch.randperm(63, generator=torch.Generator().manual_seed(1)) + 1).tolist()

        def new_page() -> int:
            page = free.pop()
            pool.map_hot([page])
            return page

        return cls(pool, new_page, pool.retier)

    @classmethod
    def real(cls, monkeypatch, hot_dtype: str = "fp8_e4m3", score_anchors: bool = False, device: str = "cpu",
             hybrid_layer_ids: tuple[int, ...] | None = None, key_bits: int = 3, key_center: bool = False) -> Harness:
        """MinimaKVPool and MinimaPagedAllocator, the classes the server runs, on ``device``; with
        ``hybrid_layer_ids``, inside SGLang's HybridLinearKVPool as a linear-attention model builds it
        (the full-attention layers ``hybrid_layer_ids`` of the model, densely indexed in the pool)."""
        config = MinimaConfig(hot_dtype=hot_dtype, attention_score_anchors=score_anchors, fp8_page_fraction=0.6,
                              key_bits=key_bits, key_center=key_center)
        monkeypatch.setenv(CONFIG_ENV, config.to_json())
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
        size = 64 * PS
        wrapper = None
        if hybrid_layer_ids is None:
            pool = MinimaKVPool(size, page_size=PS, dtype=torch.float32, head_num=HKV, head_dim=D,
                                layer_num=LAYERS, device=device, enable_memory_saver=False)
        else:
            wrapper = HybridLinearKVPool(
                size, torch.float32, PS, HKV, D, list(hybrid_layer_ids), device, mamba_pool=None,
                full_kv_pool_class=MinimaKVPool,
            )
            pool = wrapper.full_kv_pool
        allocator = MinimaPagedAllocator(size, PS, torch.float32, device, wrapper or pool, False)

        def retier(pages: list[int]) -> None:
            assert pool.store.retier(torch.tensor(pages)) == len(pages)
            pool.store.publish_conversions(wait=True)  # on CUDA the copy runs on a side stream: published now

        kwargs = {} if wrapper is None else {"runner_pool": wrapper, "layer_ids": hybrid_layer_ids}
        return cls(pool, lambda: int(allocator.alloc(PS)[0]) // PS, retier, device=device, **kwargs)

    def pages_of(self, row: int) -> list[int]:
        """Logical pages of a row in position order."""
        return [int(s) // PS for s in self.req_to_token[row, : self.lens[row] : PS]]

    def _alloc(self, row: int, n: int) -> torch.Tensor:
        """Logical slots for n new tokens of a row: continue its last page, then new hot pages."""
        slots = []
        lp = int(self.req_to_token[row, self.lens[row] - 1]) // PS if self.lens[row] else None
        for pos in range(self.lens[row], self.lens[row] + n):
            if pos % PS == 0:
                lp = self.new_page()
            slots.append(lp * PS + pos % PS)
        out = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self.req_to_token[row, self.lens[row] : self.lens[row] + n] = out
        self.lens[row] += n
        return out.to(torch.int64)

    def batch(self, new_tokens: dict[int, int], mode: ForwardMode) -> SimpleNamespace:
        """Allocate {row: new tokens} and build the ForwardBatch fields the backends read."""
        rows = list(new_tokens)
        locs = [self._alloc(r, new_tokens[r]) for r in rows]
        seq_lens = torch.tensor([self.lens[r] for r in rows])
        extend_lens = torch.tensor([new_tokens[r] for r in rows])
        dev = self.device
        return SimpleNamespace(
            forward_mode=mode,
            batch_size=len(rows),
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=seq_lens.to(dev),
            seq_lens_cpu=seq_lens,
            extend_seq_lens=extend_lens.to(dev),
            extend_prefix_lens=(seq_lens - extend_lens).to(dev),
            extend_seq_lens_cpu=extend_lens.tolist(),
            extend_prefix_lens_cpu=(seq_lens - extend_lens).tolist(),
            encoder_lens=None,
            out_cache_loc=torch.cat(locs),
        )

    def qkv(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q [t, HQ*D], k and v [t, HKV, D], as RadixAttention hands them to a backend."""
        q = torch.randn(t, HQ * D, generator=self._gen)
        k = torch.randn(t, HKV, D, generator=self._gen) * 2
        v = torch.randn(t, HKV, D, generator=self._gen)
        return q.to(self.device), k.to(self.device), v.to(self.device)

    def step(self, new_tokens: dict[int, int], mode: ForwardMode, window: int = 0) -> dict[int, torch.Tensor]:
        """One forward over {row: new tokens}, every layer checked against the reference; returns
        each row's reference attention mass per page (position order), summed over layers (with
        ``window``, of its last ``window`` queries only)."""
        fb = self.batch(new_tokens, mode)
        self.backend.init_forward_metadata(fb)
        t = int(fb.out_cache_loc.numel())
        page_mass = {r: torch.zeros((self.lens[r] + PS - 1) // PS) for r in new_tokens}
        for layer in self.layers:
            q, k, v = self.qkv(t)
            o = self.backend.forward(q, k, v, layer, fb)
            assert o.shape == (t, HQ * D) and o.dtype == q.dtype
            start = 0
            for r, n in new_tokens.items():
                want, key_mass = reference_attention(
                    self.pool, self.pool_layer[layer.layer_id], q[start : start + n].view(n, HQ, D),
                    self.req_to_token[r, : self.lens[r]], layer.scaling,
                )
                torch.testing.assert_close(o[start : start + n].view(n, HQ, D), want, atol=ATOL, rtol=1e-4)
                if window and window < n:  # the window's queries sit at the request's last positions
                    w = q[start + n - window : start + n].view(window, HQ, D)
                    _, key_mass = reference_attention(self.pool, self.pool_layer[layer.layer_id], w,
                                                      self.req_to_token[r, : self.lens[r]], layer.scaling)
                page_mass[r].index_add_(0, torch.arange(self.lens[r]) // PS, key_mass.cpu())
                start += n
        return page_mass

    def retier_prefix(self, row: int, num_pages: int, skip_first: int = 0) -> None:
        self.retier(self.pages_of(row)[skip_first : skip_first + num_pages])


@pytest.fixture(params=["fake_pool", "minima_kv_pool", pytest.param("minima_kv_pool_cuda", marks=pytest.mark.gpu)])
def make_harness(request, monkeypatch) -> Callable[..., Harness]:
    """Harness factory over the test fake and over the real MinimaKVPool + allocator (CPU, CUDA)."""
    if request.param == "fake_pool":
        return Harness.fake
    device = "cuda" if request.param.endswith("_cuda") else "cpu"
    return lambda **kw: Harness.real(monkeypatch, device=device, **kw)


@pytest.mark.parametrize("key_bits", [3, 4])
def test_decode_over_mixed_formats_gqa(make_harness, key_bits):
    h = make_harness(key_bits=key_bits)
    assert h.pool.layout.key_bits == key_bits
    h.step({1: 3 * PS + 1, 2: 5 * PS + 2}, ForwardMode.EXTEND)
    h.retier_prefix(1, 2, skip_first=1)  # pages 1-2 of row 1 stale, sink page 0 stays hot
    h.retier_prefix(2, 4)
    for _ in range(3):
        h.step({1: 1, 2: 1}, ForwardMode.DECODE)
    counts = h.backend.forward_metadata.counts
    assert (counts.tq3_pages, counts.tq3_tokens) == (6, 6 * PS)
    assert counts.hot_tokens == (3 * PS + 4 - 2 * PS) + (5 * PS + 5 - 4 * PS)
    assert h.pool.stats.route_tq3_pages == 3 * 6  # the pool's route counters, over all steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hybrid_model_pool_holds_only_full_attention_layers(monkeypatch, device):
    """Qwen3.5-style hybrid: model layers 1 and 3 attend (the others are linear attention); SGLang's
    HybridLinearKVPool builds the Minima pool for those two only, indexed 0 and 1."""
    h = Harness.real(monkeypatch, device=device, hybrid_layer_ids=(1, 3))
    assert h.pool.layer_num == 2 and h.backend.token_to_kv_pool is h.pool
    h.step({0: 3 * PS + 2, 1: 2 * PS + 5}, ForwardMode.EXTEND)
    h.retier_prefix(0, 2)
    h.step({0: 1, 1: 1}, ForwardMode.DECODE)
    h.step({0: PS, 2: 4}, ForwardMode.MIXED)
    assert h.pool.stats.route_tq3_pages == 2 + 2


@pytest.mark.parametrize("key_bits", [3, 4])
def test_chunked_prefill_reads_stale_pages_of_earlier_chunks(make_harness, key_bits):
    h = make_harness(key_bits=key_bits)
    h.step({0: 2 * PS + 2}, ForwardMode.EXTEND)  # chunk 1
    h.retier_prefix(0, 2)  # both full pages of chunk 1 become TQ3
    assert [int(h.pool.page_table.fmt[lp]) for lp in h.pages_of(0)] == [FMT_TQ3, FMT_TQ3, FMT_HOT]
    h.step({0: 2 * PS + 1}, ForwardMode.EXTEND)  # chunk 2: TQ3 prefix + partial hot page + new tokens, causal
    assert h.backend.forward_metadata.counts == RouteCounts(
        hot_pages=3, hot_tokens=2 * PS + 3, tq3_pages=2, tq3_tokens=2 * PS
    )
    h.retier_prefix(0, 2, skip_first=2)
    h.step({0: PS + 3}, ForwardMode.EXTEND)  # chunk 3
    h.step({0: 1}, ForwardMode.DECODE)
    assert (h.pool.stats.route_tq3_pages, h.pool.stats.route_tq3_tokens) == (2 + 4 + 4, (2 + 4 + 4) * PS)


def test_mixed_batch_of_prefill_and_decode_requests(make_harness):
    h = make_harness()
    h.step({0: 2 * PS + 1, 3: 4 * PS + 1}, ForwardMode.EXTEND)
    h.retier_prefix(3, 3)
    h.step({0: PS + 1, 3: 1, 1: PS + 2}, ForwardMode.MIXED)


def test_all_stale_but_the_new_tokens(make_harness):
    h = make_harness()
    h.step({2: 4 * PS}, ForwardMode.EXTEND)
    h.retier_prefix(2, 4)
    h.step({2: 3}, ForwardMode.EXTEND)
    assert h.backend.forward_metadata.counts == RouteCounts(hot_pages=1, hot_tokens=3, tq3_pages=4, tq3_tokens=4 * PS)


class DenseKV:
    """SGLang's plain pool layout: one dense K and V buffer per layer, indexed by slot id."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu"):
        self.k = [torch.zeros(num_slots, HKV, D, device=device) for _ in range(LAYERS)]
        self.v = [torch.zeros(num_slots, HKV, D, device=device) for _ in range(LAYERS)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.k[layer.layer_id][loc.loc] = cache_k.view(-1, HKV, D)
        self.v[layer.layer_id][loc.loc] = cache_v.view(-1, HKV, D)


def test_model_dtype_hot_pages_without_stale_match_torch_native(make_harness):
    """hot_dtype auto, Stale disabled: the same batches through SGLang's torch_native backend (over a
    dense pool indexed by the logical slots) give the same outputs."""
    h = make_harness(hot_dtype="auto")
    native = TorchNativeAttnBackend(fake_runner(DenseKV(64 * PS, h.device), h.req_to_token))
    steps = [
        (ForwardMode.EXTEND, {0: 2 * PS + 3, 1: PS + 2}),
        (ForwardMode.EXTEND, {0: PS, 1: 2, 2: 2 * PS + 1}),
        (ForwardMode.DECODE, {0: 1, 1: 1, 2: 1}),
        (ForwardMode.DECODE, {0: 1, 1: 1, 2: 1}),
    ]
    for mode, new in steps:
        fb = h.batch(new, mode)
        h.backend.init_forward_metadata(fb)
        native.init_forward_metadata(fb)
        for layer in h.layers:
            q, k, v = h.qkv(sum(new.values()))
            o_minima = h.backend.forward(q, k, v, layer, fb)
            o_native = native.forward(q, k, v, layer, fb)
            torch.testing.assert_close(o_minima, o_native, atol=1e-5, rtol=1e-5)
    assert h.pool.stats.route_tq3_pages == h.pool.stats.route_tq3_tokens == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(is_cross_attention=True), "decoder self-attention"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "decoder self-attention"),
        (dict(sliding_window_size=8), "sliding-window"),
        (dict(logit_cap=30.0), "logit capping"),
    ],
)
def test_rejects_unsupported_layers(change, match):
    h = Harness.fake()
    h.step({0: 3}, ForwardMode.EXTEND)
    layer = FakeLayer(0, HQ, HKV, D, scaling=1.0, **change)
    with pytest.raises(NotImplementedError, match=match):
        h.backend.forward_decode(torch.zeros(1, HQ * D), None, None, layer, SimpleNamespace(), save_kv_cache=False)


def test_reports_pages_read_once_per_step():
    h = Harness.fake()
    h.step({0: 2 * PS + 1, 1: PS + 1}, ForwardMode.EXTEND)
    h.retier_prefix(0, 1)
    h.step({0: 1, 1: 1}, ForwardMode.DECODE)
    assert len(h.pool.reads) == 2
    assert torch.equal(h.pool.reads[-1], h.backend.forward_metadata.logical_pages)
    assert h.pool.reads[-1].tolist() == h.pages_of(0) + h.pages_of(1)
    assert not h.pool.page_scores  # page attention mass is computed only for score Anchors


def test_page_attention_mass_for_score_anchors():
    h = Harness.fake(score_anchors=True)
    h.step({0: 3 * PS + 2, 1: 2 * PS + 1}, ForwardMode.EXTEND)
    h.retier_prefix(0, 2, skip_first=1)
    for mode, new in ((ForwardMode.EXTEND, {0: PS + 1, 1: 3}), (ForwardMode.DECODE, {0: 1, 1: 1})):
        want = h.step(new, mode)
        pages, mass = h.pool.page_scores[-1]
        assert torch.equal(pages, h.backend.forward_metadata.logical_pages)
        torch.testing.assert_close(mass, torch.cat([want[r] for r in new]), atol=1e-4, rtol=1e-4)
        # Every query row's weights sum to one, in every layer.
        assert float(mass.sum()) == pytest.approx(LAYERS * HQ * sum(new.values()), rel=1e-5)
    assert len(h.pool.page_scores) == 3  # once per step


def test_window_mass_is_the_last_queries_of_each_request_in_extend_steps_only():
    window = 5
    h = Harness.fake(anchor_window=window)
    h.step({0: 3 * PS + 2, 1: 2 * PS + 1}, ForwardMode.EXTEND, window=window)
    h.retier_prefix(0, 2, skip_first=1)  # the window reads TQ3 pages too
    # a chunk shorter than the window (row 1: 3 queries) gives all of its queries
    want = h.step({0: PS + 1, 1: 3}, ForwardMode.EXTEND, window=window)
    pages, mass, ends = h.pool.window_masses[-1]
    assert torch.equal(pages, h.backend.forward_metadata.logical_pages)
    assert ends == {0: 4 * PS + 3, 1: 2 * PS + 4}  # each request's length after the step, by its row
    torch.testing.assert_close(mass, torch.cat([want[0], want[1]]), atol=1e-4, rtol=1e-4)
    assert float(mass.sum()) == pytest.approx(LAYERS * HQ * (window + 3), rel=1e-5)
    h.step({0: 1, 1: 1}, ForwardMode.DECODE)
    assert len(h.pool.window_masses) == 2 and not h.pool.page_scores  # decode steps collect nothing


def test_needs_the_minima_pool():
    h = Harness.fake()
    with pytest.raises(ValueError, match="radix-cache-backend minima"):
        MinimaNativeAttnBackend(fake_runner(DenseKV(8), h.req_to_token))


def test_idle_batch_plans_nothing():
    h = Harness.fake()
    h.backend.init_forward_metadata(SimpleNamespace(forward_mode=ForwardMode.IDLE))
    assert h.backend.forward_metadata.requests == ()


def test_registration_is_idempotent():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    register_attention_backends()
    register_attention_backends()
    assert ATTENTION_BACKEND_CHOICES.count(MINIMA_NATIVE_BACKEND) == 1
    h = Harness.fake()
    backend = ATTENTION_BACKENDS[MINIMA_NATIVE_BACKEND](fake_runner(h.pool, h.req_to_token))
    assert isinstance(backend, MinimaNativeAttnBackend)


def test_a_decode_over_tq3_pages_reports_its_scratch():
    """What the backend tells the pool (note_scratch_bytes) is the decoded TQ3 tile at least."""
    h = Harness.fake()
    h.step({1: 3 * PS + 1}, ForwardMode.EXTEND)
    h.retier_prefix(1, 3)
    h.pool.stats.peak_scratch_bytes = 0  # count the decode alone
    h.step({1: 1}, ForwardMode.DECODE)
    assert h.pool.stats.peak_scratch_bytes >= 2 * 3 * HKV * PS * D * 4  # K and V of 3 pages, fp32


def test_the_pool_says_when_it_holds_tq3_pages(monkeypatch):
    """MinimaKVPool.holds_tq3_pages, from the TQ3 free list alone: False until a page converts (the
    extend split then skips its device read), True while any is mapped."""
    h = Harness.real(monkeypatch)
    h.step({1: 3 * PS + 1}, ForwardMode.EXTEND)
    assert not h.pool.holds_tq3_pages
    h.retier_prefix(1, 2)
    assert h.pool.holds_tq3_pages and int((h.pool.page_table.fmt == FMT_TQ3).sum()) == 2
