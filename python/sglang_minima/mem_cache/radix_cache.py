"""MinimaRadixCache: SGLang's UnifiedRadixCache plus Minima's per-step lifecycle work.

The tree itself is SGLang's, unchanged: it keys logical pages, and a sealed (full) page it holds is
immutable and shared by every prefix hit in whatever format it is in. A request continuing after a
hit always writes a new Recent FP8 page (SGLang matches whole pages only), so sharing is
copy-on-write by construction. Eviction frees logical pages through the allocator, which drops
only the mapping reference; conversions keep their own.

What this class adds:
- it remembers the requests it matched, so the controller can see each live request's pages in
  sequence order (``req_to_token`` row, ``kv_allocated_len``);
- ``flush_pending_backups`` (called once per scheduler step, after the step's result) moves the
  pools' release quarantine on (when nothing is live: publishes pending conversions and frees it) and runs ``LifecycleController.tick`` (telling it which requests are still
  in prefill, for ``defer_prefill_conversion``);
- prefix hits by format: the formats of the pages a request was matched to when it was admitted;
- ``step_listeners``: called with the store after each step's lifecycle work (the plugin's
  radix-cache factory adds the Prometheus metrics here with ``--enable-metrics``).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.mem_cache.page_table import FMT_TQ3
from sglang_minima.mem_cache.tier_store import TieredPageStore
from sglang_minima.ops.host_copy import to_device


class MinimaRadixCache(UnifiedRadixCache):
    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        allocator = params.token_to_kv_pool_allocator
        if not isinstance(allocator, MinimaPagedAllocator):
            raise TypeError(
                f"--radix-cache-backend minima needs MinimaPagedAllocator, got {type(allocator).__name__} "
                "(is --page-size > 1 and sglang_minima's plugin registered?)"
            )
        self.store: TieredPageStore = allocator.kv_pool.store
        self.lifecycle = allocator.kv_pool.lifecycle  # the pool owns it; the allocator shares it
        self.step_listeners: list[Callable[[TieredPageStore], None]] = []
        self._requests: weakref.WeakSet = weakref.WeakSet()
        # Hit pages (hot, tq3) of a request's latest match, counted once it is admitted.
        self._pending_hits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        req = params.req
        if req is not None:
            self._requests.add(req)
            pages = self._matched_pages(result)
            self.lifecycle.note_matched(pages)
            tq3 = int((self.store.page_table.fmt[pages] == FMT_TQ3).sum())
            self._pending_hits[req] = (pages.numel() - tq3, tq3)
        return result

    def _matched_pages(self, result: MatchResult) -> torch.Tensor:
        if result.device_prefix_len == 0:
            return torch.empty(0, dtype=torch.int64)
        slots = self.path_device_indices(result.last_device_node)[: result.device_prefix_len]
        return slots[:: self.page_size].to(torch.int64) // self.page_size

    def on_release(self, req, *, checkpointed: bool) -> None:
        # A request can be admitted and released within one step (a prefill-only request, or one
        # finished by its first token): count its hits here, since no flush saw it live.
        if req.kv.kv_allocated_len > 0:
            self._count_hits(req)
        super().on_release(req, checkpointed=checkpointed)
        self._requests.discard(req)
        self.store.window_ends.pop(req.kv.req_pool_idx, None)  # the slot's next request starts afresh

    def _count_hits(self, req) -> None:
        hits = self._pending_hits.pop(req, None)
        if hits is not None:
            stats = self.store.stats
            stats.prefix_hit_hot_pages += hits[0]
            stats.prefix_hit_tq3_pages += hits[1]

    def flush_pending_backups(self) -> None:
        super().flush_pending_backups()
        with torch.profiler.record_function("minima.lifecycle"):  # between steps: conversions, promotions
            self.store.end_step()
            live = self._live_requests()
            # Host facts only: a step that crossed no page boundary and changed no mapping skips the
            # tick, and so does one that added fewer pages than --minima-tick-min-new-pages since the last.
            members = tuple((req.rid, req.kv.req_pool_idx, req.kv.kv_allocated_len < len(req.origin_input_ids),
                             self._window_ready(req)) for req in live)
            counts = tuple(-(-req.kv.kv_allocated_len // self.page_size) for req in live)
            key = (members, counts)
            if not self.lifecycle.settled(key):
                if self.lifecycle.due(members, sum(counts)):
                    sequences, prefilling = self._sequences(live)
                    self.lifecycle.tick(sequences, prefilling, key=key, requests=[m[:2] for m in members],
                                        window_ready=[m[3] for m in members])
                    self.lifecycle.ticked(members, sum(counts))
                else:
                    self.store.stats.lifecycle_ticks_deferred += 1
            if not live:  # nothing live: no more steps may come to move the quarantine on
                self.store.drain_quarantine()
        for listener in self.step_listeners:
            listener(self.store)

    def _window_ready(self, req) -> bool:
        """``anchor_window``: a window of this request reached its prompt's end (a host fact the backend
        records at the forward's launch; the allocation that ends a prefill runs ahead of it)."""
        return self.store.window_ends.get(req.kv.req_pool_idx, 0) >= len(req.origin_input_ids)

    def live_sequences(self) -> list[torch.Tensor]:
        """Logical pages of every request holding KV, in sequence order."""
        return self._sequences(self._live_requests())[0]

    def _live_requests(self) -> list:
        """Requests holding KV (their prefix hits counted once they are)."""
        live = []
        for req in list(self._requests):
            if not req.kv.holds_kv or req.kv.kv_allocated_len == 0:
                continue
            self._count_hits(req)
            live.append(req)
        return live

    def _sequences(self, live: list) -> tuple[list[torch.Tensor], list[bool]]:
        """Each request's logical pages in sequence order, and whether its prefill has not ended yet
        (a chunked prefill between chunks: less KV allocated than the prompt has tokens). Every
        request's pages come from one gather of their ``req_to_token`` rows (three launches a tick,
        not two per live request: at 32 decoding requests a page boundary is crossed most steps)."""
        if not live:
            return [], []
        p, req_to_token = self.page_size, self.req_to_token_pool.req_to_token
        counts = [-(-req.kv.kv_allocated_len // p) for req in live]
        rows = to_device([req.kv.req_pool_idx for req in live], torch.int64, req_to_token.device)
        pages = req_to_token[rows, : max(counts) * p : p].to(torch.int64) // p  # [live, pages]; a row's tail is stale
        sequences = [pages[i, :n] for i, n in enumerate(counts)]
        return sequences, [req.kv.kv_allocated_len < len(req.origin_input_ids) for req in live]
