"""MinimaPagedAllocator: SGLang's paged allocator over logical pages, with FP8 pages found first.

SGLang sees the logical capacity L = P8 + P3 (``size``), so its accounting, eviction and idle
invariant (available + evictable + protected == total) are exactly its own. Every logical page it
hands out is backed by a hot (FP8) physical page; when none is free, sealed FP8 pages are
converted to TQ3 first (``LifecycleController.reserve_hot``). Because #free logical ==
#free FP8 + #free TQ3, a TQ3 page is free for each such conversion, so SGLang evicts cached
prefixes or retracts requests only when the logical capacity itself is exhausted.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from sglang_minima.mem_cache.hot_page_budget import HotPageBudget
from sglang_minima.mem_cache.kv_pool import MinimaKVPool


def minima_pool_of(kvcache) -> MinimaKVPool:
    """The Minima pool itself, or the full-attention pool of a hybrid (linear-attention) pool."""
    for pool in (kvcache, getattr(kvcache, "full_kv_pool", None)):
        if isinstance(pool, MinimaKVPool):
            return pool
    raise TypeError(f"MinimaPagedAllocator needs a MinimaKVPool, got {type(kvcache).__name__}")


class MinimaPagedAllocator(PagedTokenToKVPoolAllocator):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache, need_sort: bool):
        self.kv_pool = minima_pool_of(kvcache)  # before super(): its __init__ calls clear()
        self.controller = self.kv_pool.lifecycle  # the pool's (pressure conversions reserve hot pages)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    # ---------------------------------------------------------------- allocation

    def alloc(self, need_size: int):
        if not self.controller.reserve_hot(need_size // self.page_size):
            return None
        out = super().alloc(need_size)
        if out is not None:
            self._map_new_pages(out)
        return out

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ):
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
        if not self.controller.reserve_hot(num_new_pages):
            return None
        out = super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        if out is not None:
            self._map_new_pages(out)
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        if not self.controller.reserve_hot(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)):
            return None
        out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if out is not None:
            self._map_new_pages(out)
        return out

    def _map_new_pages(self, out: torch.Tensor) -> None:
        # A new page is always filled from offset 0; a continued page never sees offset 0 again.
        self.kv_pool.store.map_new(out[out % self.page_size == 0] // self.page_size)

    # ---------------------------------------------------------------- release

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        for ids in page_ids:
            self.kv_pool.store.unmap(ids)
        super()._release_page_ids(*page_ids)

    def clear(self) -> None:
        super().clear()
        self.kv_pool.store.reset()

    # ---------------------------------------------------------------- scheduler capacity hooks

    def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None) -> bool:
        fits = super().check_decode_capacity(
            num_tokens=num_tokens, tree_cache=tree_cache, requests=requests, spec_algorithm=spec_algorithm
        )
        return fits and self.controller.reserve_hot(-(-num_tokens // self.page_size))

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens: int = 0) -> HotPageBudget:
        return HotPageBudget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens,
            hot_tokens=self.controller.hot_reachable(admission=True) * self.page_size, stats=self.kv_pool.stats,
        )
