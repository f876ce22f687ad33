"""HotPageBudget: SGLang's prefill budget, also bounded by the FP8 pages an extend can get.

New KV always lands on FP8 pages, and pages being written cannot be converted, so one step can
admit at most the FP8 pages that are free or freeable by conversion, whatever the logical room.

With ``--minima-strict-hot-admission`` the freeable ones exclude the pages the last tick kept FP8
for a live request (Anchor, Recent): admitting a prompt then never converts them.

That bound is per step: the pages admitted now are sealed, so convertible, by the next step, with
no request leaving. SGLang reads a refused admission (``NO_TOKEN``) as "the pool is full until a
running request leaves" and admits nothing more until one does (``running_batch.batch_is_full``),
so the hot bound never refuses: a request that fits the logical pool but not this step's hot pages
gets a chunk of 0 tokens, which SGLang answers with ``OTHER`` (end this pass, try the next step).
"""

from __future__ import annotations

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from sglang_minima.mem_cache.stats import MinimaStats


class HotPageBudget(PrefillBudget):
    def __init__(
        self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0, hot_tokens: int, stats: MinimaStats
    ):
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.hot_tokens = hot_tokens
        self.stats = stats

    @property
    def remaining_hot(self) -> int:
        return self.hot_tokens - self.current_offset

    @property
    def remaining_current(self):
        return min(super().remaining_current, self.remaining_hot)

    def has_capacity(self) -> bool:
        """The logical room only: SGLang's verdict after each admission, where False closes
        admission until a running request leaves (``check_prefill`` defers past the hot pages)."""
        return self.remaining_total > 0 and super().remaining_current > 0

    def check_prefill(self, *, chunk_limit: int | None, **kwargs) -> tuple[bool, int | None]:
        """SGLang's admission check, then cap the request's chunk by the hot pages left: its new
        pages plus the one extra page ``reserve`` charges per request must all be hot."""
        can_admit, limit = super().check_prefill(chunk_limit=chunk_limit, **kwargs)
        if not can_admit:
            return False, None
        hot_limit = max(0, (self.remaining_hot // self.page_size - 1) * self.page_size)
        if hot_limit == 0:
            self.stats.prefill_hot_deferrals += 1
        return True, hot_limit if limit is None else min(limit, hot_limit)

    def available_chunk_tokens(self, chunk_limit: int) -> int | None:
        available = min(chunk_limit, int(self.remaining_total), self.remaining_hot)
        available = available // self.page_size * self.page_size
        return available if available > 0 else super().available_chunk_tokens(chunk_limit)
