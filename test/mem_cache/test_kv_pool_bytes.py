"""Hot FP8 pages hold exactly the bytes SGLang's own FP8 KV pool stores for the same tokens, on the
CPU and on CUDA (where SGLang writes through its store_cache kernel, not index_put)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_minima.config import CONFIG_ENV, MinimaConfig
from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.kv_pool import MinimaKVPool

H, D, PS, LAYERS, PAGES = 3, 64, 16, 2, 32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_hot_rows_are_sglangs_fp8_bytes(monkeypatch, device):
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig(fp8_page_fraction=0.5).to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    size = PAGES * PS
    pool = MinimaKVPool(size, page_size=PS, dtype=torch.bfloat16, head_num=H, head_dim=D, layer_num=LAYERS,
                        device=device, enable_memory_saver=False)
    allocator = MinimaPagedAllocator(size, PS, torch.bfloat16, device, pool, False)
    sglang = MHATokenToKVPool(size, page_size=PS, dtype=torch.float8_e4m3fn, head_num=H, head_dim=D,
                              layer_num=LAYERS, device=device, enable_memory_saver=False)
    g = torch.Generator().manual_seed(0)
    n = 5 * PS - 3
    held = allocator.alloc(2 * PS)
    loc = allocator.alloc(5 * PS)
    allocator.free(held)
    loc = torch.cat([allocator.alloc(2 * PS), loc])[:n]  # pages out of order: logical != hot physical
    # The model's dtype, with outliers near e4m3's largest value (448): rounding near the top.
    k = (torch.randn(n, H, D, generator=g) * 40).clamp(-440, 440).to(torch.bfloat16).to(device)
    v = torch.randn(n, H, D, generator=g).to(torch.bfloat16).to(device)
    for layer_id in range(LAYERS):
        layer = SimpleNamespace(layer_id=layer_id)  # all a KV pool reads of a RadixAttention
        pool.set_kv_buffer(layer, KVWriteLoc(loc), k.clone(), v.clone())
        sglang.set_kv_buffer(layer, loc, k.clone(), v.clone())
        hot = pool.page_table.hot_slots(loc)
        assert not torch.equal(hot, loc)  # logical and hot physical slots differ: the test reads the mapping
        assert torch.equal(pool.hot_k_buffer(layer_id)[hot].cpu(), sglang.k_buffer[layer_id][loc].cpu())
        assert torch.equal(pool.hot_v_buffer(layer_id)[hot].cpu(), sglang.v_buffer[layer_id][loc].cpu())


def _cpu_pool(monkeypatch, layers: int) -> tuple[MinimaKVPool, MinimaPagedAllocator]:
    monkeypatch.setenv(CONFIG_ENV, MinimaConfig(fp8_page_fraction=0.5).to_json())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    pool = MinimaKVPool(PAGES * PS, page_size=PS, dtype=torch.bfloat16, head_num=H, head_dim=D,
                        layer_num=layers, device="cpu", enable_memory_saver=False)
    return pool, MinimaPagedAllocator(PAGES * PS, PS, torch.bfloat16, "cpu", pool, False)


def test_a_page_seals_only_after_the_last_layer_of_its_tokens_is_written(monkeypatch):
    """Between steps a conversion encodes every layer of a sealed page. Under the overlap scheduler
    the next batch is already running then, so a page must not read as sealed while that batch has
    written only its first layers: the pool records the writes after the last layer's."""
    layers = 3
    pool, allocator = _cpu_pool(monkeypatch, layers)
    loc = allocator.alloc(2 * PS)
    pages = torch.unique(loc // PS)
    k = torch.randn(2 * PS, H, D).to(torch.bfloat16)
    for layer_id in range(layers):
        assert not bool(pool.page_table.sealed[pages].any()), f"sealed after {layer_id} of {layers} layers"
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), KVWriteLoc(loc), k.clone(), k.clone())
    assert bool(pool.page_table.sealed[pages].all())
    assert pool.store.retier(pages) == 2  # now convertible


def test_a_forward_translates_its_slots_once_and_again_after_a_mapping_change(monkeypatch):
    """Every layer of a forward writes the same logical slots: the pool maps them to hot slots at the
    first layer's write only (a small model's step is launch-bound, 5 ops a layer), and again where
    the mapping changed meanwhile (the store's version) or a new forward writes new slots."""
    pool, allocator = _cpu_pool(monkeypatch, layers=4)
    translate = pool.page_table.hot_slots
    calls = []
    monkeypatch.setattr(pool.page_table, "hot_slots", lambda slots: calls.append(slots) or translate(slots))

    def write(loc, layer_id):
        k = torch.randn(loc.numel(), H, D).to(torch.bfloat16)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), KVWriteLoc(loc), k.clone(), k.clone())
        hot = translate(loc)
        assert torch.equal(pool.hot_k_buffer(layer_id)[hot], k.to(torch.float8_e4m3fn).view(torch.uint8))

    loc = allocator.alloc(2 * PS)
    write(loc, 0)
    write(loc, 1)
    assert len(calls) == 1
    allocator.alloc(PS)  # maps a page: the store's version moves, so the next layer maps its slots again
    write(loc, 2)
    write(loc, 3)
    assert len(calls) == 2
    write(loc, 0)  # after the last layer: a new forward, even with the same slots tensor
    assert len(calls) == 3
    loc[:] = loc.flip(0).clone()  # a slots buffer refilled in place, the mapping unchanged
    write(loc, 1)
    assert len(calls) == 4
    write(allocator.alloc(PS), 0)  # the next forward's new slots
    assert len(calls) == 5


def _scrambled(pool, allocator, n_pages: int) -> torch.Tensor:
    """Slots of ``n_pages`` logical pages whose hot physical pages have other ids."""
    allocator.free(allocator.alloc(3 * PS))  # their hot pages wait in the quarantine: the logical ids come back first
    loc = allocator.alloc(n_pages * PS)
    assert not torch.equal(pool.page_table.hot_slots(loc), loc)
    return loc


def test_slots_translated_at_the_plan_are_the_layers_and_the_fill_goes_to_their_physical_pages(monkeypatch):
    """``prepare_write`` (the minima backend's plan, before SGLang's read-done event): no layer reads
    the page table again, even handed another tensor of the step's slots (a breakable prefill graph's
    copy), and the last layer notes the fill of the physical pages it wrote. A plan that does not
    prepare (None) leaves the first layer to translate."""
    pool, allocator = _cpu_pool(monkeypatch, layers=3)
    loc = _scrambled(pool, allocator, 2)[: PS + 5]
    translate = pool.page_table.hot_slots
    calls = []
    monkeypatch.setattr(pool.page_table, "hot_slots", lambda slots: calls.append(slots) or translate(slots))
    pool.prepare_write(loc)
    assert len(calls) == 1
    k = torch.randn(loc.numel(), H, D).to(torch.bfloat16)
    for layer_id in range(3):
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), KVWriteLoc(loc.clone()), k.clone(), k.clone())
    assert len(calls) == 1  # the layers wrote the plan's slots
    hot = translate(loc)
    assert pool.page_table.hot_fill[hot[[0, -1]] // PS].tolist() == [PS, 5]
    assert pool.page_table.fill[loc[[0, -1]] // PS].tolist() == [PS, 5]
    pool.prepare_write(None)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), KVWriteLoc(loc), k.clone(), k.clone())
    assert len(calls) == 2  # prepare_write(None) translated nothing; the first layer did


@pytest.mark.parametrize("planned", [True, False])
def test_a_page_freed_and_mapped_again_while_its_forward_runs(monkeypatch, planned):
    """The overlap scheduler, in host order: a forward's plan translates its slots, SGLang then frees
    its page and maps it again for the next batch (a new hot page: the old one waits in the release
    quarantine), then the forward's layers write. With the plan's translation (``planned``) they write
    the old physical page and the new owner's page stays empty and unsealed; translated at the first
    layer, they write into the new owner's page and seal it: what ``prepare_write`` prevents."""
    pool, allocator = _cpu_pool(monkeypatch, layers=2)
    loc = _scrambled(pool, allocator, 1)
    page = loc[:1] // PS
    old = pool.page_table.phys[page].clone()
    pool.prepare_write(loc if planned else None)
    pool.store.unmap(page)
    pool.store.map_new(page)
    new = pool.page_table.phys[page].clone()
    assert not torch.equal(new, old)
    k = torch.randn(loc.numel(), H, D).to(torch.bfloat16) + 1
    for layer_id in range(2):
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), KVWriteLoc(loc), k.clone(), k.clone())
    new_rows = (new.long() * PS + torch.arange(PS))
    assert bool(pool.page_table.sealed[page]) is not planned
    assert bool((pool.hot_k_buffer(0)[new_rows] == 0).all()) is planned  # the new page: written or not
    assert int(pool.page_table.hot_fill[old.long()]) == (PS if planned else 0)


def test_a_fresh_view_of_the_same_slots_per_layer_is_translated_once(monkeypatch):
    """SGLang's breakable prefill graphs give every layer's attention a new slice of one slots buffer
    (attention_input_scope: ``out_cache_loc[:n]``): the pool's cache must see the same slots, not a
    new tensor, and still see a different extent, a refill and the next forward."""
    pool, allocator = _cpu_pool(monkeypatch, layers=4)
    translate = pool.page_table.hot_slots
    calls = []
    monkeypatch.setattr(pool.page_table, "hot_slots", lambda slots: calls.append(slots) or translate(slots))
    buffer = torch.zeros(4 * PS, dtype=torch.int64)  # the graph runner's static slots, padded
    n = 3 * PS
    buffer[:n] = allocator.alloc(n)

    def write(layer_id, tokens=n):
        loc = buffer[:tokens]  # a new view object at every layer, as attention_input_scope makes
        k = torch.randn(tokens, H, D).to(torch.bfloat16)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), KVWriteLoc(loc), k.clone(), k.clone())
        assert torch.equal(pool.hot_k_buffer(layer_id)[translate(loc)], k.to(torch.float8_e4m3fn).view(torch.uint8))

    for layer_id in range(3):
        write(layer_id)
    assert len(calls) == 1  # one translation for three layers' slices
    buffer[: 2 * PS] = torch.cat([buffer[PS : 2 * PS], buffer[:PS]])  # refilled in place through the base: every view's version moves
    write(3)
    assert len(calls) == 2
    write(0, tokens=2 * PS)  # the next forward (after the last layer), fewer tokens of the same buffer
    write(1, tokens=PS)  # another extent: other slots
    write(2, tokens=PS)
    assert len(calls) == 4
    # a forward that stopped before its last layer, then slots written where no version counter sees
    # it (a graph replay's kernel): the next forward's first layer translates again all the same
    buffer.data[:PS] = buffer.data[PS : 2 * PS].clone().flip(0)
    write(0, tokens=PS)
    assert len(calls) == 5
