"""HotPageBudget: SGLang's prefill budget, also bounded by the FP8 pages an extend can get.

New KV always lands on FP8 pages, and pages being written cannot be converted, so one step can
admit at most the FP8 pages that are free or freeable by conversion, whatever the logical room.
"""

from __future__ import annotations

from sglang.srt.mem_cache.prefill_budget import PrefillBudget


class HotPageBudget(PrefillBudget):
    def __init__(self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0, hot_tokens: int):
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.hot_tokens = hot_tokens

    @property
    def remaining_hot(self) -> int:
        return self.hot_tokens - self.current_offset

    @property
    def remaining_current(self):
        return min(super().remaining_current, self.remaining_hot)

    def check_prefill(self, *, chunk_limit: int | None, **kwargs) -> tuple[bool, int | None]:
        """SGLang's admission check, then cap the request's chunk by the hot pages left: its new
        pages plus the one extra page ``reserve`` charges per request must all be hot."""
        can_admit, limit = super().check_prefill(chunk_limit=chunk_limit, **kwargs)
        hot_limit = (self.remaining_hot // self.page_size - 1) * self.page_size
        if not can_admit or hot_limit <= 0:
            return False, None
        return True, hot_limit if limit is None else min(limit, hot_limit)

    def available_chunk_tokens(self, chunk_limit: int) -> int | None:
        available = min(chunk_limit, int(self.remaining_total), self.remaining_hot)
        available = available // self.page_size * self.page_size
        return available if available > 0 else super().available_chunk_tokens(chunk_limit)
