"""Prefill admission is bounded by the hot (FP8) pages one step can get, whatever the logical room."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_minima.mem_cache.hot_page_budget import HotPageBudget
from sglang_minima.mem_cache.stats import MinimaStats

PAGE = 64


def _budget(hot_pages: int, logical_tokens: int = 100 * PAGE) -> HotPageBudget:
    allocator = SimpleNamespace(page_size=PAGE, available_size=lambda: logical_tokens)
    tree = SimpleNamespace(evictable_size=lambda: 0, supports_mamba=lambda: False)
    return HotPageBudget(allocator, tree, hot_tokens=hot_pages * PAGE, stats=MinimaStats())


def _check(budget: HotPageBudget, extend: int, chunk_limit: int | None = 4096):
    return budget.check_prefill(extend_input_len=extend, total_tokens=extend + 16, max_new_tokens=16,
                                input_tokens=extend, swa_host_hit_length=0, chunk_limit=chunk_limit)


def test_admission_chunks_to_the_hot_pages_left():
    budget = _budget(hot_pages=4)
    # 4 hot pages: 3 for the chunk, 1 for the extra page reserve() charges per request.
    assert _check(budget, 1000) == (True, 3 * PAGE)
    assert _check(budget, 1000, chunk_limit=None) == (True, 3 * PAGE)
    assert budget.stats.prefill_hot_deferrals == 0


def test_spent_hot_pages_defer_to_the_next_step_without_closing_admission():
    """A zero chunk (SGLang's OTHER: next step), never a refusal (NO_TOKEN: wait for a request to leave)."""
    budget = _budget(hot_pages=4)
    budget.reserve(3 * PAGE, 0)
    assert budget.has_capacity()
    assert _check(budget, 1000) == (True, 0)
    assert _check(budget, 1000, chunk_limit=None) == (True, 0)
    assert budget.stats.prefill_hot_deferrals == 2


def test_small_request_keeps_sglang_chunk_limit():
    assert _check(_budget(hot_pages=128), 100) == (True, 4096)


def test_logical_room_still_binds():
    budget = _budget(hot_pages=64, logical_tokens=PAGE)
    assert _check(budget, 1000) == (False, None)
    assert budget.stats.prefill_hot_deferrals == 0
