"""The store's conversions on a CUDA side stream (mem_cache/conversion_stream.py), on the device:
the synchronous path's bytes, even behind source writes still queued on the current stream; no use
after free under an emulated overlap scheduler (pages NaN-poisoned as they return to a free list,
a slowed forward on its own stream), and the same run with a shortened quarantine does read NaN;
a decode step's forward (plan, kernels) with no host sync while conversions are pending; a tick behind
an extend's plan (the overlap scheduler's early barrier) converts no page the extend still writes."""

import pytest
import torch

from sglang_minima.codec.fp8 import fp8_quantize
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.mem_cache.conversion_stream import ConversionStream, CudaConversionStream
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.mem_cache.physical_pool import PhysicalPagePool
from sglang_minima.mem_cache.tier_store import StoreShape, TieredPageStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PS, HEADS, DIM, LAYERS, HQ = 64, 4, 128, 2, 16
SLEEP = int(2e8)  # GPU cycles: ~0.1 s on an H200, far longer than the host's work between launches


def _store(num_logical=16, num_hot=8, **kwargs) -> TieredPageStore:
    shape = StoreShape(num_logical_pages=num_logical, num_hot_pages=num_hot, num_layers=LAYERS,
                       hot_dtype=torch.float8_e4m3fn, layout=TQ3PageLayout(HEADS, PS, DIM))
    return TieredPageStore(shape, device="cuda", rotation_seed=5, **kwargs)


def _slots(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PS + torch.arange(PS, device=pages.device)).flatten()


def _kv(n_pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(2, LAYERS, n_pages * PS, HEADS, DIM, device="cuda", generator=g)


def _write(store, pages, kv, tokens=None):
    """MinimaKVPool.set_kv_buffer's work for every layer, on the current stream; seals what it fills."""
    slots = _slots(pages)[:tokens]
    hot = store.page_table.hot_slots(slots)
    for layer in range(LAYERS):
        store.hot_k[layer][hot] = fp8_quantize(kv[0, layer, : slots.numel()]).view(torch.uint8)
        store.hot_v[layer][hot] = fp8_quantize(kv[1, layer, : slots.numel()]).view(torch.uint8)
    store.page_table.note_written(hot)


@pytest.fixture(scope="module", autouse=True)
def _modules_loaded():
    """Every kernel these tests launch, launched once before any of them slows a stream. A kernel's
    first launch in a process loads its module (CUDA's lazy loading, torch's default), which waits for
    the whole device, the slowed stream's sleep included: the test then finds the slowed work done.
    Under pytest-xdist a test may be its worker's first (2026-12-06 on an H100, ``-n 10``: three
    tests found their slowed extend or conversion done before their first check)."""
    store, _, pages = _tick_behind_a_slowed_extend(note_fill_first=False, sleep=0)  # writes, a tick, a retier
    store.publish_conversions(wait=True)
    store.end_step()
    store.end_step()
    store.promote(pages[:1])
    store.publish_conversions(wait=True)
    torch.cuda.synchronize()


def test_side_stream_conversions_write_the_synchronous_bytes(monkeypatch):
    side, sync = _store(), _store(conversion_stream=ConversionStream())  # sync: the current stream, at once
    assert isinstance(side.conversion_stream, CudaConversionStream) and side.kernels is not None
    for store in (side, sync):
        # each kernel's first launch loads its module (CUDA's lazy loading), which waits for the whole
        # device: the conversion launched below would then find the late writes done, and be done itself
        # before it can be seen pending. Padding page 0 of both buffers, all-zero in both stores
        # (TieredPageStore allocates its buffers zeroed), so the stores stay byte-equal.
        zero = torch.zeros(1, dtype=torch.int64, device="cuda")
        store.kernels.encode(zero, zero)
        store.kernels.decode(zero, zero)
    torch.cuda.synchronize()
    pages, kv = torch.arange(1, 9, device="cuda"), _kv(8, 0)
    for store in (side, sync):
        store.map_new(pages)
    _write(sync, pages, kv)
    side.page_table.note_written(side.page_table.hot_slots(_slots(pages)))  # sealed, but its bytes come late:
    real = side.conversion_stream.launch

    def launch_behind_late_writes(copy):
        torch.cuda._sleep(SLEEP)  # the forward writing the pages' K/V, still queued on the current stream
        _write(side, pages, kv)
        return real(copy)

    monkeypatch.setattr(side.conversion_stream, "launch", launch_behind_late_writes)
    stale = torch.tensor([2, 3, 5, 7, 8, 1], device="cuda")
    assert side.retier(stale) == 6
    # checked before the synchronous store converts: its conversion waits for the current stream (the
    # late writes), by which time the side stream's copy has run as well
    assert side.conversions_pending and (side.page_table.fmt[stale] == FMT_HOT).all()  # not published yet
    assert sync.retier(stale) == 6
    side.publish_conversions(wait=True)
    for name in ("fmt", "phys"):
        assert torch.equal(getattr(side.page_table, name), getattr(sync.page_table, name))
    for layer in range(LAYERS):
        assert torch.equal(side.tq3[layer], sync.tq3[layer]), f"layer {layer}: TQ3 bytes differ"

    monkeypatch.setattr(side.conversion_stream, "launch", real)
    for store in (side, sync):  # the retiered pages' FP8 sources leave the quarantine two steps on
        store.end_step()
        store.end_step()
    back = torch.tensor([3, 8], device="cuda")
    assert side.promote(back) == sync.promote(back) == 2
    side.publish_conversions(wait=True)
    assert torch.equal(side.page_table.phys, sync.page_table.phys)
    rows = side.page_table.hot_slots(_slots(back))
    for layer in range(LAYERS):
        assert torch.equal(side.hot_k[layer][rows], sync.hot_k[layer][rows])
        assert torch.equal(side.hot_v[layer][rows], sync.hot_v[layer][rows])
    assert side.reference_mismatches() == 0 and side.stats.retier.pages == 6 and side.stats.promote.pages == 2


def _read(store, rows):
    """A forward's read of its planned rows (layer 0, K and V): finite unless it reads a poisoned page."""
    k = store.hot_k[0][rows].view(torch.float8_e4m3fn).float()
    v = store.hot_v[0][rows].view(torch.float8_e4m3fn).float()
    return (k * v).sum(-1)


def _overlap_run(steps=8):
    """SGLang's overlap scheduler, emulated: forward i runs (slowed) on its own stream while the host
    processes result i-1 on the current stream: it frees two pages forward i reads, frees the request
    before's other pages (converted, or their conversion still pending), ends the step, publishes the
    conversions done and converts this request's other two pages on the side stream. Pages are
    NaN-poisoned as they return to a free list. Returns each forward's output and its unslowed value."""
    store = _store(num_logical=48, num_hot=24, debug_poison=True)
    fwd = torch.cuda.Stream()
    free_logical = list(range(1, 49))
    outs, refs, prev_done, prev_pages = [], [], None, None
    for i in range(steps):
        pages = torch.tensor(free_logical[:4], device="cuda")
        del free_logical[:4]
        store.map_new(pages)
        _write(store, pages, _kv(4, i))
        rows = store.page_table.hot_slots(_slots(pages))  # forward i's plan
        refs.append(_read(store, rows))
        fwd.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(fwd):
            torch.cuda._sleep(SLEEP)
            outs.append(_read(store, rows))
        rows.record_stream(fwd)  # freed by the host below while the slowed forward may still read it
        done = torch.cuda.Event()
        done.record(fwd)
        if prev_done is not None:
            prev_done.synchronize()  # result i-1 (forward i still runs)
        store.unmap(pages[:2])
        freed = pages[:2].tolist()
        if prev_pages is not None:
            store.unmap(prev_pages)
            freed += prev_pages.tolist()
        free_logical += freed
        store.end_step()
        store.publish_conversions()  # the tick
        store.retier(pages[2:])
        prev_done, prev_pages = done, pages[2:]
    torch.cuda.synchronize()
    assert store.reference_mismatches() == 0
    return outs, refs


def test_no_forward_reads_a_freed_page_under_the_overlap_scheduler():
    outs, refs = _overlap_run()
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert torch.isfinite(out).all(), f"forward {i} read a poisoned page"
        assert torch.equal(out, ref), f"forward {i} read changed bytes"


def test_a_shortened_quarantine_lets_a_forward_read_a_poisoned_page(monkeypatch):
    """The test above can fail: with pages free at the first end_step, forward i reads what the host
    wrote there meanwhile: the poison, or (once the page is handed out again) the next request's KV."""
    monkeypatch.setattr(PhysicalPagePool, "end_step", PhysicalPagePool.drain)
    outs, refs = _overlap_run()
    assert any(not torch.isfinite(out).all() or not torch.equal(out, ref) for out, ref in zip(outs, refs))


def test_a_decode_step_has_no_host_sync_while_conversions_are_pending(monkeypatch):
    from minima_kernels import MinimaDecodeWrapper

    from sglang_minima.layers.attention.forward_plan import plan_forward

    store = _store()
    pages = torch.arange(1, 9, device="cuda")  # two requests of four pages, the last ones partial
    store.map_new(pages)
    for req in (pages[:4], pages[4:]):
        _write(store, req, _kv(4, int(req[0])), tokens=4 * PS - 5)
    req_to_token = torch.zeros(3, 4 * PS, dtype=torch.int32, device="cuda")
    req_to_token[1], req_to_token[2] = _slots(pages[:4]), _slots(pages[4:])
    rows = torch.tensor([1, 2], device="cuda")
    kv_lens = torch.full((2,), 4 * PS - 5, device="cuda")
    q_lens = torch.ones(2, dtype=torch.int64, device="cuda")
    q = torch.randn(2, HQ, DIM, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = MinimaDecodeWrapper(workspace, HQ, HEADS, DIM, PS)

    def decode_step():
        """A captured decode step's work: the plan from the live page table, then the kernels."""
        plan = plan_forward(req_to_token, rows, kv_lens, q_lens, store.page_table.fmt, store.page_table.phys,
                            PS, max_pages=4)
        wrapper.plan_graph(plan.hot.indptr, plan.hot.pages, plan.hot_last_page_len, plan.tq3.indptr,
                           plan.tq3.pages, max_pages=4)
        out = []
        for layer in range(LAYERS):
            k = store.hot_k[layer].view(torch.float8_e4m3fn).view(-1, PS, HEADS, DIM)
            v = store.hot_v[layer].view(torch.float8_e4m3fn).view(-1, PS, HEADS, DIM)
            o, _ = wrapper.run(q, (k, v), store.tq3[layer], store.rotations[layer].signs,
                               k_scale=store.k_scales[layer], v_scale=store.v_scales[layer])
            out.append(o.clone())
        return torch.stack(out)

    before = decode_step()  # builds the kernels (host work allowed here)
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    store.kernels.encode(zero, zero)  # loaded now (padding page 0): see _modules_loaded
    real = store.conversion_stream.launch
    monkeypatch.setattr(store.conversion_stream, "launch", lambda copy: real(lambda: (torch.cuda._sleep(SLEEP), copy())))
    assert store.retier(torch.tensor([1, 2, 5, 6], device="cuda")) == 4
    assert store.conversions_pending
    torch.cuda.set_sync_debug_mode("error")
    try:
        during = decode_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert store.conversions_pending  # the forward neither waited for nor published them
    torch.testing.assert_close(during, before, rtol=1e-3, atol=1e-3)  # it read the sources, in FP8
    store.publish_conversions(wait=True)
    assert (store.page_table.fmt[torch.tensor([1, 2, 5, 6], device="cuda")] == FMT_TQ3).all()
    assert torch.isfinite(decode_step()).all()


def _tick_behind_a_slowed_extend(note_fill_first: bool, sleep: int = SLEEP):
    """SGLang's overlap scheduler with an extend that declares its shared reads done at its plan
    (``MinimaAttnBackend._snapshot_prefill_shared_reads``): the schedule stream waits for the plan's
    event only, then ticks while the slowed extend still writes. The extend finishes page 4 (its first
    half was written by an earlier step) and writes page 5; pages 1-3 are sealed Stale pages, page 4
    turns Stale once full (one Recent page). Returns the store, the controller and the pages."""
    from sglang_minima.config import MinimaConfig
    from sglang_minima.mem_cache.controller import LifecycleController

    store = _store()
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    store.kernels.encode(zero, zero)  # loaded now: a kernel's first launch (CUDA's lazy loading) waits for the device
    ctl = LifecycleController(store, MinimaConfig(recent_pages=1, sink_pages=0, anchor_pages=0, retier_batch_pages=8))
    pages = torch.arange(1, 6, device="cuda")
    store.map_new(pages)
    kv = _kv(5, 7)
    _write(store, pages, kv, tokens=3 * PS + PS // 2)  # earlier steps: pages 1-3 and half of page 4
    torch.cuda.synchronize()
    fwd, plan_done = torch.cuda.Stream(), torch.cuda.Event()
    fwd.wait_stream(torch.cuda.current_stream())
    slots = _slots(pages)[3 * PS + PS // 2 : 4 * PS + 3]  # the extend's new tokens
    with torch.cuda.stream(fwd):
        hot = store.page_table.hot_slots(slots)  # the plan's write slots (MinimaKVPool.prepare_write)
        plan_done.record(fwd)  # the read-done event SGLang records after the plan
        if note_fill_first:  # a fill raised before the layers' writes: what the last-layer order prevents
            store.page_table.note_written(hot)
        torch.cuda._sleep(sleep)  # the extend's layers
        for layer in range(LAYERS):
            store.hot_k[layer][hot] = fp8_quantize(kv[0, layer, 3 * PS + PS // 2 : 4 * PS + 3]).view(torch.uint8)
            store.hot_v[layer][hot] = fp8_quantize(kv[1, layer, 3 * PS + PS // 2 : 4 * PS + 3]).view(torch.uint8)
        store.page_table.note_written(hot)  # after the last layer's write (MinimaKVPool.set_kv_buffer)
    torch.cuda.current_stream().wait_event(plan_done)  # _apply_war_barrier at PRE_REPLAY
    ctl.tick([pages])
    torch.cuda.synchronize()
    return store, ctl, pages


def _page4_bytes_as_written_whole(pages):
    """Page 4's TQ3 bytes per layer when its whole content is written first, then converted."""
    ref = _store()
    ref.map_new(pages)
    _write(ref, pages, _kv(5, 7), tokens=4 * PS + 3)
    assert ref.retier(pages[:4]) == 4
    ref.publish_conversions(wait=True)
    return [ref.tq3[layer][ref.page_table.phys[pages[3]].long()] for layer in range(LAYERS)]


def _page4_bytes(store, pages):
    return [store.tq3[layer][store.page_table.phys[pages[3]].long()] for layer in range(LAYERS)]


def test_a_tick_behind_an_extends_plan_converts_no_page_the_extend_still_writes():
    store, ctl, pages = _tick_behind_a_slowed_extend(note_fill_first=False)
    store.publish_conversions(wait=True)
    # the early tick read page 4's fill from before the extend's last layer: 1-3 converted, 4 left hot
    assert store.page_table.fmt[pages].tolist() == [FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT, FMT_HOT]
    ctl.tick([pages])  # the next tick, the extend done: page 4 is sealed now
    store.publish_conversions(wait=True)
    assert store.page_table.fmt[pages].tolist() == [FMT_TQ3] * 4 + [FMT_HOT]
    for layer, (got, want) in enumerate(zip(_page4_bytes(store, pages), _page4_bytes_as_written_whole(pages))):
        assert torch.equal(got, want), f"layer {layer}: page 4 converted from other bytes"
    assert store.reference_mismatches() == 0


def test_a_fill_raised_before_the_writes_converts_a_half_written_page():
    """The test above can fail: had the extend raised page 4's fill before its layers wrote it, the
    early tick would convert page 4 from its first half."""
    store, _, pages = _tick_behind_a_slowed_extend(note_fill_first=True)
    store.publish_conversions(wait=True)
    assert store.page_table.fmt[pages[3]].item() == FMT_TQ3
    got, want = _page4_bytes(store, pages), _page4_bytes_as_written_whole(pages)
    assert any(not torch.equal(g, w) for g, w in zip(got, want))
