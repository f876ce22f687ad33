"""LifecycleController: which pages are Recent, Anchor or Stale, and the conversions between steps.

Per live request (its logical pages in sequence order):
- Recent: the last ``recent_pages`` pages (the page being written is always one of them);
- Anchor: the first ``sink_pages`` pages (attention sinks), pages of a shared prefix (held by two
  or more live requests, e.g. a system prompt: paid for once), and a budget of ``anchor_pages``
  more pages filled by score: the EWMA attention mass when ``attention_score_anchors`` is on,
  otherwise recency (the pages just before the Recent window);
- Stale: the rest.
A page held by several requests takes its highest tier. A page held by no live request (a cached
prefix) keeps its format: FP8 pages nobody needs cost nothing, and a prefix hit may want them
again. ``tick`` runs once per scheduler step: it first publishes the conversions whose copy is
done, then launches one batched FP8->TQ3 conversion of sealed Stale pages (with ``defer_prefill_conversion``, none held by a request still in prefill), then promotion of TQ3 pages that re-entered Recent/Anchor while FP8 pages are spare.
``reserve_hot`` converts synchronously (waiting for the copy) when an allocation finds no free FP8 page: cached
and Stale pages first, then Anchor, then Recent, oldest first; never a page being written.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, TIER_ANCHOR, TIER_NONE, TIER_RECENT, TIER_STALE
from sglang_minima.mem_cache.tier_store import TieredPageStore
from sglang_minima.ops.host_copy import to_device

_TIER_STRIDE = 1 << 40  # sort key tier * stride + birth step: tiers first, then age


class LifecycleController:
    def __init__(self, store: TieredPageStore, config: MinimaConfig):
        self.store = store
        self.config = config
        self._settled: tuple | None = None  # (caller's key, store state) after a tick that found nothing to do
        self._ticked: tuple | None = None  # (live requests, their pages) at the last tick that ran
        self._backlog = False  # the last tick filled a conversion batch: more may be waiting

    def settled(self, key: Hashable) -> bool:
        """True if a tick now would do nothing: the last tick with this ``key`` (the caller's summary
        of the live requests: each one's identity, page count and prefill state) found nothing to
        convert, promote or wait for, and no page was mapped, freed or converted since. Most decode
        steps cross no page boundary, so they skip the tick's classification and its launches.
        Never while conversions are pending: the tick publishes them."""
        return (
            self._settled is not None
            and not self.store.conversions_pending
            and self._settled == (key, self._store_state())
        )

    def due(self, members: tuple, pages: int) -> bool:
        """Whether a tick is due by ``tick_min_new_pages``: ``members`` identifies the live requests
        and their prefill state (any change is due at once), ``pages`` counts their pages. So is the
        tick after one that filled its conversion batch (a backlog: a long prefill's Stale pages
        convert batch after batch, as without the lever). Between ticks the pages a request fills
        stay FP8 longer, and the tiers the pressure path orders by are the last tick's; the
        allocator's pressure path still converts at once where it finds no free FP8 page. Host facts only."""
        step, last, store = self.config.tick_min_new_pages, self._ticked, self.store
        if step <= 1 or last is None or last[0] != members or store.conversions_pending or self._backlog:
            return True
        return pages - last[1] >= step or store.hot_pool.num_free < len(members) + step

    def ticked(self, members: tuple, pages: int) -> None:
        """A tick ran with these live requests and pages (``due`` counts from here)."""
        self._ticked = (members, pages)

    def _store_state(self) -> tuple[int, int, int]:
        store = self.store
        return store.version, store.hot_pool.num_free, store.tq3_pool.num_free

    def classify(self, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
        """int8 [num_logical_pages + 1]: the tier of every logical page (TIER_NONE if no live request holds it)."""
        pt = self.store.page_table
        labels = torch.full_like(pt.tier, TIER_NONE)
        sequences = [s for s in sequences if s.numel() > 0]
        if not sequences:
            return labels
        device = pt.tier.device
        pages = torch.cat([s.to(device=device, dtype=torch.int64) for s in sequences])
        # the lengths are host facts: no wait for the device (a pageable copy, or an output size
        # repeat_interleave would have to read)
        lens = to_device([s.numel() for s in sequences], torch.int64, device)
        starts = torch.cumsum(lens, 0) - lens
        seq_id = torch.repeat_interleave(torch.arange(len(sequences), device=device), lens, output_size=pages.numel())
        idx = torch.arange(pages.numel(), device=device) - starts[seq_id]
        p = self.config
        recent = idx >= lens[seq_id] - p.recent_pages
        holders = torch.zeros(pt.tier.numel(), dtype=torch.int32, device=device)  # (bincount reads its max)
        shared = holders.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))[pages] > 1
        anchor = (idx < p.sink_pages) | shared
        tier = torch.where(recent, TIER_RECENT, torch.where(anchor, TIER_ANCHOR, TIER_STALE))
        if p.anchor_pages > 0:
            key = pt.score[pages] if p.attention_score_anchors else idx.to(torch.float32)
            candidate = tier == TIER_STALE
            key = torch.where(candidate, key, torch.full_like(key, float("-inf")))
            order = torch.argsort(key, descending=True, stable=True)
            order = order[torch.argsort(seq_id[order], stable=True)]
            rank = torch.empty_like(idx)
            rank[order] = torch.arange(pages.numel(), device=device) - starts[seq_id[order]]
            tier = torch.where(candidate & (rank < p.anchor_pages), TIER_ANCHOR, tier)
        labels.scatter_reduce_(0, pages, tier.to(labels.dtype), reduce="amax")
        return labels

    def tick(self, sequences: Sequence[torch.Tensor], prefilling: Sequence[bool] = (), key: Hashable = None) -> None:
        """Between steps: classify, retier one batch, promote what fits beside the decode reserve.

        ``prefilling[i]`` is True while request i's prefill has not ended (chunked prefill); with
        ``defer_prefill_conversion`` its pages are not converted here (``reserve_hot`` still may).
        With a ``key`` (see ``settled``), a tick that finds nothing to do records it.
        """
        store, pt, p = self.store, self.store.page_table, self.config
        self._settled = None
        store.stats.lifecycle_ticks += 1
        store.publish_conversions()  # those whose copy is done (no wait)
        pt.tier.copy_(self.classify(sequences))
        if p.disable_stale:
            self._settle(key)
            return
        stale = (pt.tier == TIER_STALE) & pt.mapped & (pt.fmt == FMT_HOT)
        if p.defer_prefill_conversion:
            for seq, in_prefill in zip(sequences, prefilling):
                if in_prefill:
                    stale[seq.to(device=stale.device, dtype=torch.int64)] = False
        sealed = pt.sealed
        converted = store.retier(self._order(stale & sealed, demote=True)[: p.retier_batch_pages])
        self._backlog = converted >= p.retier_batch_pages
        spare = store.hot_pool.num_free - len(sequences)  # one new page per request next step
        wanted = pt.mapped & (pt.fmt == FMT_TQ3) & (pt.tier >= TIER_ANCHOR)
        # One device read for both: TQ3 pages to promote, Stale pages a forward is still filling.
        any_wanted, any_unsealed = torch.stack([wanted.any(), (stale & ~sealed).any()]).tolist()
        promoted = 0
        if spare > 0 and any_wanted:
            promoted = store.promote(self._order(wanted, demote=False)[: min(spare, p.retier_batch_pages)])
            self._backlog |= promoted >= p.retier_batch_pages
        if converted == 0 and promoted == 0 and not any_unsealed and not (spare > 0 and any_wanted):
            self._settle(key)

    def _settle(self, key: Hashable) -> None:
        # Attention-score anchors move every step: such a tick is never known to be idle.
        if self.store.conversions_pending:  # the next tick must run to publish them
            return
        if key is not None and not (self.config.attention_score_anchors and self.config.anchor_pages > 0):
            self._settled = (key, self._store_state())

    def hot_reachable(self) -> int:
        """Hot pages an allocation can get: free and quarantined ones (``reserve_hot`` frees the
        quarantine), those only pending conversions hold (it publishes them first) plus sealed ones
        a conversion would free."""
        store = self.store
        hot = store.hot_pool
        return (hot.num_free + hot.num_quarantined + store.held_by_conversions(hot)
                + int(store.hot_convertible().sum()))

    def reserve_hot(self, num_pages: int) -> bool:
        """Make ``num_pages`` hot pages free for an allocation; False if that is impossible.

        First the pending conversions and the quarantine: an allocation runs between forwards, so
        after a device sync no copy runs and no forward reads a freed page. Then pressure: convert sealed hot pages, cached and Stale
        first, then Anchor, then Recent, oldest first.
        """
        store = self.store
        short = num_pages - store.hot_pool.num_free
        if short <= 0:
            return True
        if store.num_quarantined or store.conversions_pending:  # both pools: a conversion needs free TQ3 pages too
            store.drain_quarantine()
            short = num_pages - store.hot_pool.num_free
        if short > 0 and not self.config.disable_stale:
            store.stats.pressure_retier_pages += store.retier(self._order(store.hot_convertible(), demote=True)[:short])
            store.drain_quarantine()  # publishes it and frees its sources, now (a second device sync)
        return store.hot_pool.num_free >= num_pages

    def _order(self, mask: torch.Tensor, *, demote: bool) -> torch.Tensor:
        """Logical pages of ``mask`` ordered for demotion (lower tier first, oldest first) or for
        promotion (higher tier first, youngest first)."""
        pt = self.store.page_table
        pages = torch.nonzero(mask).flatten()
        key = pt.tier[pages].to(torch.int64) * _TIER_STRIDE + pt.birth[pages]
        return pages[torch.argsort(key if demote else -key, stable=True)]
