"""MinimaKVPool, MinimaPagedAllocator and MinimaRadixCache driven through real SGLang objects on CPU."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.mem_cache_utils import finish_req

from sglang_minima.config import CONFIG_ENV, MinimaConfig
from sglang_minima.hooks import scheduler_idle_hook
from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.kv_pool import MinimaKVPool
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3
from sglang_minima.mem_cache.radix_cache import MinimaRadixCache
from sglang_minima.reporting.memory_report import memory_report
from sglang_minima.reporting.server_info import minima_server_info

PS = 16  # TQ3 pages hold whole 16-token MMA tiles
PAGES = 16
HEADS, DIM, LAYERS = 2, 64, 2
N_LONG = 5 * PS + 2  # a prompt of 6 pages, the last one partial


def build(monkeypatch, **config):
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig(**config).to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    req_to_token = ReqToTokenPool(size=4, max_context_len=PAGES * PS, device="cpu", enable_memory_saver=False)
    pool = MinimaKVPool(
        PAGES * PS, page_size=PS, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )
    allocator = MinimaPagedAllocator(PAGES * PS, PS, torch.float32, "cpu", pool, False)
    cache = MinimaRadixCache(
        CacheInitParams(
            req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator, page_size=PS, disable=False,
            tree_components=(ComponentType.FULL,), kv_event_lora_names=KvEventLoraNames(),
        )
    )
    return SimpleNamespace(req_to_token=req_to_token, pool=pool, allocator=allocator, cache=cache)


def new_req(rid: str, tokens: list[int]) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=4))


def prefill(t, rid: str, tokens: list[int]) -> Req:
    """Admission + extend as the scheduler does it: match, row, alloc_extend, KV write of every layer."""
    req = new_req(rid, tokens)
    req.init_next_round_input(t.cache)
    t.req_to_token.alloc([req])
    prefix, n = req.prefix_len, len(tokens)
    row = req.kv.req_pool_idx
    if prefix:
        t.req_to_token.write((row, slice(0, prefix)), t.cache.prefix_device_indices(req).to(torch.int32))
    last = t.req_to_token.req_to_token[row, prefix - 1 : prefix].long() if prefix else torch.tensor([-1])
    lens = lambda x: torch.tensor([x])  # noqa: E731
    # SGLang's allocation: evict the prefix cache for logical room, then the allocator's alloc_extend
    out = alloc_paged_token_slots_extend(t.cache, lens(prefix), lens(prefix), lens(n), lens(n), last, n - prefix)
    t.req_to_token.write((row, slice(prefix, n)), out.to(torch.int32))
    for layer in range(LAYERS):
        t.pool.set_kv_buffer(SimpleNamespace(layer_id=layer), out, torch.randn(n - prefix, HEADS, DIM),
                             torch.randn(n - prefix, HEADS, DIM))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n
    req.output_ids = array("q")
    return req


def release(t, req: Req) -> None:
    finish_req(t.cache, req, req.kv.kv_allocated_len)
    t.cache.on_release(req, checkpointed=True)
    t.req_to_token.free(req)


def idle_invariant(t) -> None:
    """SGLang's own idle check: available + evictable + protected == total."""
    assert t.allocator.available_size() + t.cache.evictable_size() + t.cache.protected_size() == PAGES * PS


def test_request_lifecycle_retier_prefix_hit_by_format_and_eviction(monkeypatch):
    t = build(monkeypatch, recent_pages=1, sink_pages=1, fp8_page_fraction=0.5)
    req = prefill(t, "a", list(range(1, N_LONG + 1)))  # 6 pages, the last one partial
    t.cache.flush_pending_backups()
    pages = t.cache.live_sequences()[0]
    assert t.pool.page_table.fmt[pages].tolist() == [FMT_HOT, FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_TQ3, FMT_HOT]
    release(t, req)
    idle_invariant(t)

    hit = prefill(t, "b", list(range(1, 3 * PS + 1)) + [999, 998])
    assert hit.prefix_len == 3 * PS
    t.cache.flush_pending_backups()
    assert (t.pool.stats.prefix_hit_hot_pages, t.pool.stats.prefix_hit_tq3_pages) == (1, 2)
    release(t, hit)

    t.cache.evict(EvictParams(num_tokens=PAGES * PS))
    store = t.pool.store
    assert t.allocator.available_size() == PAGES * PS
    assert store.num_quarantined > 0  # the evicted pages' physical pages wait for a step's end ...
    scheduler_idle_hook(SimpleNamespace(tree_cache=t.cache))  # ... or the idle scheduler: a sync, then free
    assert store.hot_pool.num_free == store.shape.num_hot_pages and store.tq3_pool.num_free == store.shape.num_tq3_pages
    idle_invariant(t)


def test_pressure_converts_fp8_pages_before_sglang_evicts(monkeypatch):
    t = build(monkeypatch, recent_pages=8, sink_pages=0, fp8_page_fraction=0.25)  # 4 FP8 pages, 12 TQ3
    a = prefill(t, "a", list(range(1, 4 * PS + 1)))  # all 4 FP8 pages, all Recent
    t.cache.flush_pending_backups()
    assert t.pool.store.hot_pool.num_free == 0
    b = prefill(t, "b", list(range(1000, 1000 + 2 * PS)))  # needs 2 more: Recent pages of `a` are converted
    assert t.pool.stats.pressure_retier_pages == 2 and t.cache.evictable_size() == 0
    for req in (a, b):
        release(t, req)
    idle_invariant(t)


def admission_pass(t, running: list[Req], queue: list[Req]) -> tuple[list[str], bool]:
    """One pass of SGLang's Scheduler._get_new_batch_prefill_raw over the waiting queue: the
    requests it admits, and whether it closes admission (a NO_TOKEN while requests run marks the
    running batch full: nothing more is admitted until one of them leaves)."""
    adder = PrefillAdder(PS, t.cache, t.allocator, SimpleNamespace(reqs=running), new_token_ratio=1.0,
                         rem_input_tokens=PAGES * PS, rem_chunk_tokens=PAGES * PS)
    closes = False
    for req in queue:
        if adder.budget_state() == AddReqResult.OTHER:
            break
        req.init_next_round_input(t.cache)
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if result != AddReqResult.CONTINUE:
            closes = result == AddReqResult.NO_TOKEN and bool(running or adder.can_run_list)
            break
    for req in adder.can_run_list:  # the tests run the admitted extends themselves
        t.cache.unlock(req.lock)
    return [req.rid for req in adder.can_run_list], closes


@pytest.mark.parametrize("first_pages", [1, 2])
def test_spent_hot_pages_defer_admission_to_the_next_step(monkeypatch, first_pages):
    """A step admits only the hot pages it can get; the next request waits for the next step, when
    the admitted pages are sealed (convertible) again. It must not close admission: that waits for
    a running request to leave, minutes for one decoding long (serving soak, pilot 6). The first
    request leaves one hot page (the next one is refused) or none (the verdict after admitting it)."""
    t = build(monkeypatch, recent_pages=1, sink_pages=0, fp8_page_fraction=0.25)  # 4 FP8 pages, 12 TQ3
    running = [prefill(t, "r", list(range(1, 9)))]  # decoding, writing its first page
    t.cache.flush_pending_backups()
    assert t.pool.lifecycle.hot_reachable() == 3 and t.allocator.available_size() == (PAGES - 1) * PS
    q1 = new_req("q1", list(range(100, 100 + first_pages * PS)))
    q2 = new_req("q2", list(range(200, 200 + PS)))
    assert admission_pass(t, running, [q1, q2]) == (["q1"], False)
    assert t.pool.stats.prefill_hot_deferrals == 1
    running.append(prefill(t, "q1", list(q1.origin_input_ids)))
    t.cache.flush_pending_backups()
    assert admission_pass(t, running, [q2]) == (["q2"], False)
    for req in running:
        release(t, req)
    idle_invariant(t)


@pytest.mark.parametrize("strict", [False, True])
def test_strict_hot_admission_waits_instead_of_taking_a_running_requests_fp8_pages(monkeypatch, strict):
    """A running request holds every hot page but one (a sink and two Recent pages, one of them being
    written). A two-page prompt fits only by converting its sink: admitted that way by default, held
    back with --minima-strict-hot-admission (no chunk this step, nothing converted) until the running
    request leaves and its pages, cached now, may convert."""
    t = build(monkeypatch, recent_pages=2, sink_pages=1, fp8_page_fraction=0.25, strict_hot_admission=strict)
    running = [prefill(t, "r", list(range(1, 3 * PS + 2)))]  # sink, Stale, Recent, Recent (partial)
    for _ in range(3):  # the tick converts the Stale page; its source leaves the quarantine
        t.cache.flush_pending_backups()
    store = t.pool.store
    assert store.hot_pool.num_free == 1 and t.pool.lifecycle.hot_reachable() == 3
    assert t.pool.lifecycle.hot_reachable(admission=True) == (1 if strict else 3)
    q = new_req("q", list(range(100, 100 + PS + 1)))
    if strict:
        assert admission_pass(t, running, [q]) == ([], False)
        assert t.pool.stats.prefill_hot_deferrals == 1 and store.stats.pressure_retier_pages == 0
        release(t, running.pop())
        t.cache.flush_pending_backups()
    assert admission_pass(t, running, [q]) == (["q"], False)
    running.append(prefill(t, "q", list(q.origin_input_ids)))
    kept = store.stats.pressure_retier_tiers["anchor"] + store.stats.pressure_retier_tiers["recent"]
    assert kept == (0 if strict else 1) and store.reference_mismatches() == 0
    for req in running:
        release(t, req)
    idle_invariant(t)


def test_full_tq3_region_admits_what_the_logical_pool_holds(monkeypatch):
    """The state pilot 6 was seen in: TQ3 region full, 2 FP8 pages free, cached FP8 pages (converting
    one needs a free TQ3 page). Admission may count those as reachable: SGLang evicts the prefix
    cache for logical room before the allocator reserves hot pages, and each page it evicts frees a
    hot page or a TQ3 page for a conversion (#free logical == #free hot + #free TQ3 + #quarantined).
    Admitting it spends the step's hot pages, which must not close admission either."""
    t = build(monkeypatch, recent_pages=1, sink_pages=1, fp8_page_fraction=0.5)  # 8 FP8 pages, 8 TQ3
    for rid, base, pages in (("a", 1, 6), ("b", 1000, 4)):  # cached: 2 FP8 + 4 TQ3, 2 FP8 + 2 TQ3
        req = prefill(t, rid, list(range(base, base + pages * PS)))
        t.cache.flush_pending_backups()
        release(t, req)
    running = [prefill(t, "s", list(range(2000, 2000 + 3 * PS + 2)))]  # FP8, TQ3, TQ3, FP8
    for _ in range(3):  # the step that converts, then two more: the sources leave the quarantine
        t.cache.flush_pending_backups()
    store = t.pool.store
    assert (store.tq3_pool.num_free, store.hot_pool.num_free, t.cache.evictable_size()) == (0, 2, 10 * PS)
    c = new_req("c", list(range(3000, 3000 + 6 * PS)))  # needs 6 FP8 pages
    assert admission_pass(t, running, [c]) == (["c"], False)
    running.append(prefill(t, "c", list(c.origin_input_ids)))  # SGLang evicts "a", then 2 conversions
    assert store.stats.pressure_retier_pages == 2 and store.reference_mismatches() == 0
    for req in running:
        release(t, req)
    idle_invariant(t)


def test_decode_lands_on_new_hot_pages(monkeypatch):
    t = build(monkeypatch, recent_pages=1, sink_pages=0, fp8_page_fraction=0.25)
    req = prefill(t, "a", list(range(1, 2 * PS + 1)))  # two full pages
    assert t.allocator.check_decode_capacity(num_tokens=PS, tree_cache=t.cache)
    row = req.kv.req_pool_idx
    last = t.req_to_token.req_to_token[row, 2 * PS - 1 : 2 * PS].long()
    out = t.allocator.alloc_decode(torch.tensor([2 * PS + 1]), torch.tensor([2 * PS + 1]), last)
    page = int(out[0]) // PS
    assert int(out[0]) % PS == 0 and t.pool.page_table.fmt[page] == FMT_HOT and bool(t.pool.page_table.mapped[page])


def test_auto_dtype_without_stale_stores_exactly_what_sglang_stores(monkeypatch):
    t = build(monkeypatch, hot_dtype="auto", disable_stale=True)
    ref = MHATokenToKVPool(PAGES * PS, page_size=PS, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                           layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    req = prefill(t, "a", list(range(1, N_LONG + 1)))
    t.cache.flush_pending_backups()
    loc = t.req_to_token.req_to_token[req.kv.req_pool_idx, :N_LONG].long()
    k, v = torch.randn(N_LONG, HEADS, DIM), torch.randn(N_LONG, HEADS, DIM)
    for pool in (t.pool, ref):
        pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k.clone(), v.clone())
    assert torch.equal(t.pool.hot_k_buffer(1)[t.pool.hot_slots(loc)], ref.get_key_buffer(1)[loc])
    assert t.pool.stats.retier.pages == 0 and t.pool.store.shape.num_tq3_pages == 0


def test_server_info_reconciles_bytes_with_the_pool(monkeypatch):
    t = build(monkeypatch, recent_pages=1, sink_pages=1, fp8_page_fraction=0.5)
    req = prefill(t, "a", list(range(1, N_LONG + 1)))  # the scheduler holds running requests
    t.cache.flush_pending_backups()
    assert t.cache.live_sequences()[0].numel() == req.kv.kv_allocated_len // PS + 1
    args = SimpleNamespace(attention_backend="minima_native", prefill_attention_backend=None, device="cpu")
    info = minima_server_info(SimpleNamespace(token_to_kv_pool_allocator=t.allocator, server_args=args))
    memory = info["memory"]
    assert info["pool"]["prefill_scratch_reserve_bytes"] == 0  # the torch path's tiles are a few pages
    args.attention_backend, args.device = "minima", "cuda"  # the kernels' tile: K and V in bf16
    info = minima_server_info(SimpleNamespace(token_to_kv_pool_allocator=t.allocator, server_args=args))
    assert info["pool"]["prefill_scratch_reserve_bytes"] == HEADS * 16384 * DIM * 2 * 2
    assert info["active"] and info["pool"]["hot_pages"] == 8 and info["pool"]["tq3_pages"] == 8
    assert memory["accounted_bytes"] == memory["allocated_bytes"] == sum(t.pool.get_kv_size_bytes())
    assert memory["rows"]["stale"]["pages"] == 4 and memory["live_tokens"] == N_LONG
    assert info["stats"]["fallbacks"] == 0
    assert info["stats"]["peak_scratch_bytes"] > 0  # the retier's staging (no attention ran here)
    # the most pages of each format held at once: the prompt's, hot, then the 4 Stale ones as TQ3
    assert info["pool"]["peak_hot_pages_held"] == 6  # 5 full + 1 partial, all hot until the tick
    assert info["pool"]["peak_tq3_pages_held"] == 4
    report = memory_report(t.pool.store)
    assert report.bytes_per_live_token == report.live_bytes / N_LONG


def test_minima_radix_cache_rejects_a_plain_allocator(monkeypatch):
    t = build(monkeypatch)
    plain = PagedTokenToKVPoolAllocator(PAGES * PS, PS, torch.float32, "cpu", t.pool, False)
    with pytest.raises(TypeError, match="MinimaPagedAllocator"):
        MinimaRadixCache(
            CacheInitParams(
                req_to_token_pool=t.req_to_token, token_to_kv_pool_allocator=plain, page_size=PS,
                disable=False, tree_components=(ComponentType.FULL,), kv_event_lora_names=KvEventLoraNames(),
            )
        )


def test_hybrid_linear_pool_builds_minima_for_its_full_attention_layers(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig().to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    hybrid = HybridLinearKVPool(
        size=PAGES * PS, dtype=torch.float32, page_size=PS, head_num=HEADS, head_dim=DIM,
        full_attention_layer_ids=[3, 7], device="cpu", mamba_pool=None, full_kv_pool_class=MinimaKVPool,
    )
    allocator = MinimaPagedAllocator(PAGES * PS, PS, torch.float32, "cpu", hybrid, False)
    assert allocator.kv_pool is hybrid.full_kv_pool and allocator.kv_pool.layer_num == 2
    loc = allocator.alloc(PS)
    k = torch.randn(PS, HEADS, DIM)
    hybrid.set_kv_buffer(SimpleNamespace(layer_id=7), loc, k, torch.randn(PS, HEADS, DIM))
    stored = allocator.kv_pool.hot_k_buffer(1)[allocator.kv_pool.hot_slots(loc)]
    assert torch.equal(stored, k.to(torch.float8_e4m3fn).view(torch.uint8))


def test_defer_prefill_conversion_waits_for_the_last_chunk(monkeypatch):
    t = build(monkeypatch, recent_pages=1, sink_pages=1, fp8_page_fraction=0.5, defer_prefill_conversion=True)
    req = prefill(t, "a", list(range(1, N_LONG + 1)))
    prompt = req.origin_input_ids
    req.origin_input_ids = array("q", range(1, N_LONG + 2 * PS))  # first chunk of a longer prompt
    t.cache.flush_pending_backups()
    pages = t.cache.live_sequences()[0]
    assert t.pool.page_table.fmt[pages].tolist() == [FMT_HOT] * 6
    req.origin_input_ids = prompt  # the last chunk is in
    t.cache.flush_pending_backups()
    assert t.pool.page_table.fmt[pages].tolist() == [FMT_HOT] + [FMT_TQ3] * 4 + [FMT_HOT]


def _encoder_fault(monkeypatch) -> list[bool]:
    """Make every TQ3 encode raise while ``fault[0]`` is True (the conversion's torch path)."""
    from sglang_minima.mem_cache import tier_store

    real, fault = tier_store.encode_pages, [True]

    def encode(*args, **kwargs):
        if fault[0]:
            raise RuntimeError("injected encoder fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(tier_store, "encode_pages", encode)
    return fault


def test_conversion_fault_between_steps_keeps_pages_and_serving(monkeypatch):
    t = build(monkeypatch, recent_pages=1, sink_pages=1, fp8_page_fraction=0.5)
    req = prefill(t, "a", list(range(1, N_LONG + 1)))
    fault = _encoder_fault(monkeypatch)
    store = t.pool.store
    hot_before = [b.clone() for b in store.hot_k + store.hot_v]
    t.cache.flush_pending_backups()  # the step's retier raises inside; the step itself does not
    pages = t.cache.live_sequences()[0]
    phys = store.page_table.phys[pages].clone()
    assert store.page_table.fmt[pages].tolist() == [FMT_HOT] * 6
    assert all(torch.equal(a, b) for a, b in zip(store.hot_k + store.hot_v, hot_before))
    assert t.pool.stats.retier.failed_pages == 4 and t.pool.stats.retier.pages == 0
    assert store.tq3_pool.num_free == store.shape.num_tq3_pages
    other = prefill(t, "b", list(range(500, 500 + 2 * PS)))  # serving goes on: 2 of the 2 free FP8 pages
    assert store.hot_pool.num_free == 0
    fault[0] = False
    t.cache.flush_pending_backups()
    assert store.page_table.fmt[pages].tolist() == [FMT_HOT] + [FMT_TQ3] * 4 + [FMT_HOT]
    assert not torch.equal(store.page_table.phys[pages], phys)
    for r in (req, other):
        release(t, r)
    idle_invariant(t)


def test_conversion_fault_under_pressure_refuses_the_allocation_without_leaking(monkeypatch):
    """No FP8 page free and the conversion that would free one raises: the allocation answers
    None (SGLang's out-of-memory answer) and nothing moved; once the fault clears it succeeds."""
    t = build(monkeypatch, recent_pages=8, sink_pages=0, fp8_page_fraction=0.25)  # 4 FP8 pages, 12 TQ3
    a = prefill(t, "a", list(range(1, 4 * PS + 1)))
    t.cache.flush_pending_backups()
    store = t.pool.store
    fault = _encoder_fault(monkeypatch)
    hot_before = [b.clone() for b in store.hot_k + store.hot_v]
    available = t.allocator.available_size()
    lens = lambda x: torch.tensor([x])  # noqa: E731
    out = t.allocator.alloc_extend(lens(0), lens(0), lens(2 * PS), lens(2 * PS), torch.tensor([-1]), 2 * PS)
    assert out is None
    assert t.allocator.available_size() == available
    assert store.hot_pool.num_free == 0 and store.tq3_pool.num_free == store.shape.num_tq3_pages
    assert all(torch.equal(a_, b_) for a_, b_ in zip(store.hot_k + store.hot_v, hot_before))
    assert store.stats.retier.failed_pages == 2 and store.stats.pressure_retier_pages == 0
    fault[0] = False
    b = prefill(t, "b", list(range(1000, 1000 + 2 * PS)))
    assert store.stats.pressure_retier_pages == 2
    for req in (a, b):
        release(t, req)
    idle_invariant(t)


def test_live_sequences_are_each_requests_pages_from_one_gather():
    # req_to_token rows in scrambled logical slots, 4 slots wider than 8 pages (SGLang's rows are the
    # context length + 4): request A 3 pages and a partial one, B exactly 2 pages, C one token, D a
    # whole row (its last page partial, at the row's end); the rows' tails hold stale slots of
    # earlier requests, which no sequence may include
    g = torch.Generator().manual_seed(3)
    width = 8 * PS + 4
    req_to_token = (torch.randperm(5 * width, generator=g).view(5, width) + PS).to(torch.int32)
    lens = {1: 3 * PS + 5, 2: 2 * PS, 4: 1, 3: width}
    live = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row, kv_allocated_len=n), origin_input_ids=[0] * (2 * PS))
            for row, n in lens.items()]
    cache = SimpleNamespace(page_size=PS, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    sequences, prefilling = MinimaRadixCache._sequences(cache, live)
    for seq, (row, n) in zip(sequences, lens.items()):
        want = req_to_token[row, :n][::PS].to(torch.int64) // PS  # the per-request reading it replaces
        assert seq.dtype == torch.int64 and seq.tolist() == want.tolist()
    assert prefilling == [False, False, True, False]
    assert MinimaRadixCache._sequences(cache, []) == ([], [])
