"""LifecycleController: which pages are Recent, Anchor or Stale, and the conversions between steps.

Per live request (its logical pages in sequence order):
- Recent: the last ``recent_pages`` pages (the page being written is always one of them);
- Anchor: the first ``sink_pages`` pages (attention sinks), pages of a shared prefix (held by two
  or more live requests, e.g. a system prompt: paid for once), and a budget of ``anchor_pages``
  more pages filled by score: the EWMA attention mass when ``attention_score_anchors`` is on, the
  observation window with ``anchor_window`` (picked once, at the first tick after the request's
  prefill ended: the hot pages its prompt's last queries attended most, kept for its life),
  otherwise recency (the pages just before the Recent window);
- Stale: the rest.
A page held by several requests takes its highest tier. A page held by no live request (a cached
prefix) keeps its format: FP8 pages nobody needs cost nothing, and a prefix hit may want them
again. ``tick`` runs once per scheduler step: it first publishes the conversions whose copy is
done, then launches one batched FP8->TQ3 conversion of sealed Stale pages (``retier_batch_pages``,
or as many as were allocated since the last tick if more; with ``defer_prefill_conversion``, none
held by a request still in prefill), then promotion of TQ3 pages that re-entered Recent/Anchor while FP8 pages are spare.
``reserve_hot`` converts synchronously (waiting for the copy) when an allocation finds no free FP8 page: Stale
pages first (the next tick converts them anyway), then cached ones, then the Stale pages the deferral
keeps hot, then Anchor, then Recent, oldest first; never a page being written. It counts them by what they were (``MinimaStats.pressure_retier_tiers``).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.page_table import (
    FMT_HOT, FMT_TQ3, TIER_ANCHOR, TIER_NAMES, TIER_NONE, TIER_RECENT, TIER_STALE,
)
from sglang_minima.mem_cache.stats import PRESSURE_TIERS
from sglang_minima.mem_cache.tier_store import TieredPageStore
from sglang_minima.ops.host_copy import to_device

_TIER_STRIDE = 1 << 40  # sort key tier * stride + birth step: tiers first, then age
# The pressure path's order: each tier's place in PRESSURE_TIERS (whose names are the tiers', and
# "deferred": Stale pages the deferral keeps hot)
_PRESSURE_INDEX = torch.tensor([PRESSURE_TIERS.index(TIER_NAMES[t]) for t in range(len(TIER_NAMES))])
# Pressure tiers before it: Stale pages the tick converts anyway and cached pages no live request holds
_DEFERRED_INDEX = PRESSURE_TIERS.index("deferred")


class LifecycleController:
    def __init__(self, store: TieredPageStore, config: MinimaConfig):
        self.store = store
        self.config = config
        self._settled: tuple | None = None  # (caller's key, store state) after a tick that found nothing to do
        self._ticked: tuple | None = None  # (live requests, their pages) at the last tick that ran
        self._backlog = False  # the last tick filled a conversion batch: more may be waiting
        # anchor_window: per live request (its identity), its pinned pages and which of them count
        self._window_anchors: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._new_pins: list[torch.Tensor] = []  # this tick's picks, counted in the tick's one device read
        self._deferred: torch.Tensor | None = None  # bool by logical page: the last tick's deferred pages
        self._mapped_at_tick = 0  # the store's mapped_pages at the last tick
        # pressure_batch_pages: bool by logical page, prefixes matched since the last tick (a request about to
        # read them, its tiers not classified yet): the batch converts none of them ahead
        self._matched: torch.Tensor | None = None

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

    def classify(self, sequences: Sequence[torch.Tensor], pinned: torch.Tensor | None = None) -> torch.Tensor:
        """int8 [num_logical_pages + 1]: the tier of every logical page (TIER_NONE if no live request holds it).
        ``pinned`` (bool, by logical page): Anchors of the observation window (``window_pins``)."""
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
        if pinned is not None:
            anchor |= pinned[pages]
        tier = torch.where(recent, TIER_RECENT, torch.where(anchor, TIER_ANCHOR, TIER_STALE))
        if p.anchor_pages > 0 and pinned is None:
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

    def note_matched(self, pages: torch.Tensor) -> None:
        """Logical pages of a prefix the radix cache just matched for a request (``match_prefix``): until
        the next tick classifies the request's pages they read as cached; the pressure batch leaves them."""
        if not self.config.pressure_batch_pages or not pages.numel():
            return
        if self._matched is None:
            self._matched = torch.zeros_like(self.store.page_table.mapped)
        self._matched[pages.to(device=self._matched.device, dtype=torch.int64)] = True

    def tick(self, sequences: Sequence[torch.Tensor], prefilling: Sequence[bool] = (), key: Hashable = None,
             requests: Sequence[Hashable] = (), window_ready: Sequence[bool] = ()) -> None:
        """Between steps: classify, retier one batch, promote what fits beside the decode reserve.

        ``prefilling[i]`` is True while request i's prefill has not ended (chunked prefill); with
        ``defer_prefill_conversion`` its pages are not converted here (``reserve_hot`` still may).
        ``requests[i]`` identifies request i and ``window_ready[i]`` says a window of its reached its
        prompt's end (``anchor_window``: its pinned Anchors; default: every request's has).
        With a ``key`` (see ``settled``), a tick that finds nothing to do records it.
        """
        store, pt, p = self.store, self.store.page_table, self.config
        self._settled = None
        store.stats.lifecycle_ticks += 1
        if self._matched is not None:  # the matched requests' pages are classified now (if admitted)
            self._matched.zero_()
        store.publish_conversions()  # those whose copy is done (no wait)
        in_prefill = list(prefilling) or [False] * len(sequences)
        ready = list(window_ready) or [True] * len(sequences)
        pinned = self.window_pins(sequences, in_prefill, requests, ready) if p.anchor_window else None
        pt.tier.copy_(self.classify(sequences, pinned))
        if p.disable_stale:
            self._new_pins = []  # nothing converts: the pins change nothing to count
            self._settle(key)
            return
        stale = (pt.tier == TIER_STALE) & pt.mapped & (pt.fmt == FMT_HOT)
        # Pages that must stay hot this tick: a request still in prefill (deferred conversion), and
        # one whose prefill ended but whose window has not reached its prompt's end yet (its Anchors
        # are picked at a later tick: nothing of it converts before). The pressure path takes them
        # after the other Stale pages.
        deferred = torch.zeros_like(stale)
        for seq, busy, seen in zip(sequences, in_prefill, ready):
            if (p.defer_prefill_conversion and busy) or (p.anchor_window and not busy and not seen):
                deferred[seq.to(device=stale.device, dtype=torch.int64)] = True
        self._deferred = deferred
        stale &= ~deferred
        sealed = pt.sealed
        # At least as many pages as were allocated since the last tick: conversions keep pace with a
        # wave of prompts on the conversion stream, instead of leaving the backlog to the allocation's
        # pressure path (a synchronous conversion and a device sync between forwards).
        limit = max(p.retier_batch_pages, store.mapped_pages - self._mapped_at_tick)
        self._mapped_at_tick = store.mapped_pages
        pages = self._order(stale & sealed, demote=True)[:limit]
        # launched a batch at a time: a conversion's staging (the torch codec's) stays one batch's
        converted = sum(store.retier(pages[i : i + p.retier_batch_pages]) for i in range(0, len(pages), p.retier_batch_pages))
        self._backlog = converted >= limit
        spare = store.hot_pool.num_free - len(sequences)  # one new page per request next step
        wanted = pt.mapped & (pt.fmt == FMT_TQ3) & (pt.tier >= TIER_ANCHOR)
        # One device read for all: TQ3 pages to promote, Stale pages a forward is still filling, new pins.
        pins = [keep.sum() for keep in self._new_pins]
        self._new_pins = []
        any_wanted, any_unsealed, *pinned_now = torch.stack(
            [wanted.any().long(), (stale & ~sealed).any().long(), *pins]).tolist()
        any_wanted, any_unsealed = bool(any_wanted), bool(any_unsealed)
        store.stats.window_anchor_pages += sum(pinned_now)
        promoted = 0
        if spare > 0 and any_wanted:
            promoted = store.promote(self._order(wanted, demote=False)[: min(spare, p.retier_batch_pages)])
            self._backlog |= promoted >= p.retier_batch_pages
        if converted == 0 and promoted == 0 and not any_unsealed and not (spare > 0 and any_wanted):
            self._settle(key)

    def window_pins(self, sequences: Sequence[torch.Tensor], prefilling: Sequence[bool],
                    requests: Sequence[Hashable], window_ready: Sequence[bool]) -> torch.Tensor:
        """bool [num_logical_pages + 1]: the live requests' observation-window Anchors (one flag of each
        list per sequence). A request whose prefill has ended, whose window has reached its prompt's end
        and that has none yet gets them now: up to ``anchor_pages`` of its hot pages outside the sinks
        and the Recent window, by the mass its last window put on them
        (``note_window_mass``: the extend that ended its prefill), pages with none left out; pages
        already TQ3 are not picked (promoting one would not undo its rounding). Fixed-shape device ops:
        no host read."""
        pt, p = self.store.page_table, self.config
        if len(requests) != len(sequences):
            raise ValueError(f"anchor_window: {len(sequences)} sequences but {len(requests)} request ids")
        live = set(requests)
        for rid in [r for r in self._window_anchors if r not in live]:
            del self._window_anchors[rid]  # released (or retracted): its pins go with it
        for rid, seq, busy, seen in zip(requests, sequences, prefilling, window_ready):
            if busy or not seen or rid in self._window_anchors or seq.numel() == 0:
                continue
            seq = seq.to(device=pt.tier.device, dtype=torch.int64)
            n = seq.numel()
            idx = torch.arange(n, device=seq.device)
            mass = pt.window_mass[seq]
            candidate = (idx >= p.sink_pages) & (idx < n - p.recent_pages) & (pt.fmt[seq] == FMT_HOT) & (mass > 0)
            top = torch.topk(torch.where(candidate, mass, torch.full_like(mass, -1.0)), min(p.anchor_pages, n)).indices
            self._window_anchors[rid] = (seq[top], candidate[top])
            self._new_pins.append(candidate[top])
        counts = torch.zeros(pt.tier.numel(), dtype=torch.int32, device=pt.tier.device)
        for pages, keep in self._window_anchors.values():
            counts.index_add_(0, pages, keep.to(torch.int32))
        return counts > 0

    def _settle(self, key: Hashable) -> None:
        # Attention-score anchors move every step: such a tick is never known to be idle.
        if self.store.conversions_pending:  # the next tick must run to publish them
            return
        if key is not None and not (self.config.attention_score_anchors and self.config.anchor_pages > 0):
            self._settled = (key, self._store_state())

    def hot_reachable(self, *, admission: bool = False) -> int:
        """Hot pages an allocation can get: free and quarantined ones (``reserve_hot`` frees the
        quarantine), those only pending conversions hold (it publishes them first) plus sealed ones
        a conversion would free. For prefill ``admission`` (``HotPageBudget``) with
        ``strict_hot_admission``, not the sealed ones the last tick kept FP8 for a live request
        (Anchor, Recent): admitting a prompt then never converts them."""
        store = self.store
        hot = store.hot_pool
        convertible = store.hot_convertible()
        strict = admission and self.config.strict_hot_admission
        if strict:  # (a pending promotion's page is one of those once published)
            convertible &= store.page_table.tier < TIER_ANCHOR
        held = store.held_by_conversions(hot, live_destinations=not strict)
        return hot.num_free + hot.num_quarantined + held + int(convertible.sum())

    def reserve_hot(self, num_pages: int) -> bool:
        """Make ``num_pages`` hot pages free for an allocation; False if that is impossible.

        First the pending conversions and the quarantine: an allocation runs between forwards, so
        after a device sync no copy runs and no forward reads a freed page. Then pressure: convert sealed hot pages, Stale
        first, then cached, then the deferral's Stale pages, then Anchor, then Recent, oldest first:
        the shortfall, and with ``pressure_batch_pages`` more Stale and cached pages (``_with_batch``),
        published at this call's sync so that the allocations after it need none.
        """
        store = self.store
        short = num_pages - store.hot_pool.num_free
        if short <= 0:
            return True
        self._drain()  # both pools: a conversion needs free TQ3 pages too
        short = num_pages - store.hot_pool.num_free
        if short > 0 and not self.config.disable_stale:
            pages, tiers = self._pressure_order(store.hot_convertible())
            pages, tiers = self._with_batch(pages, tiers, short)
            converted = store.retier(pages)  # after the drain every one is convertible: a prefix converts
            counts = torch.bincount(tiers[:converted], minlength=len(PRESSURE_TIERS)).tolist()
            store.stats.note_pressure(dict(zip(PRESSURE_TIERS, counts)))
            self._drain()  # publishes it and frees its sources, now (a second device sync)
        return store.hot_pool.num_free >= num_pages

    def _with_batch(self, pages: torch.Tensor, tiers: torch.Tensor, short: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pressure path's pages (and their tiers): the order's first ``short``, then, up to
        ``pressure_batch_pages`` in all and the free TQ3 pages, the next Stale and cached pages no prefix
        matched since the last tick (a request about to read it) is among."""
        extra = min(self.config.pressure_batch_pages, self.store.tq3_pool.num_free) - short
        if extra <= 0:
            return pages[:short], tiers[:short]
        rest, rest_tiers = pages[short:], tiers[short:]
        ahead = rest_tiers < _DEFERRED_INDEX
        if self._matched is not None:
            ahead &= ~self._matched[rest]
        return torch.cat([pages[:short], rest[ahead][:extra]]), torch.cat([tiers[:short], rest_tiers[ahead][:extra]])

    def _pressure_order(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical pages of ``mask`` in the pressure path's order, with each one's ``PRESSURE_TIERS``
        index: by that index (the last tick's tiers), then oldest first."""
        pt = self.store.page_table
        pages = torch.nonzero(mask).flatten()
        tier = pt.tier[pages].to(torch.int64)
        index = _PRESSURE_INDEX.to(tier.device)[tier]
        if self._deferred is not None:
            index = torch.where((tier == TIER_STALE) & self._deferred[pages], PRESSURE_TIERS.index("deferred"), index)
        order = torch.argsort(index * _TIER_STRIDE + pt.birth[pages], stable=True)
        return pages[order], index[order]

    def _drain(self) -> None:
        """The store's drain, counted where it waited for the device."""
        self.store.stats.allocation_syncs += self.store.drain_quarantine()

    def _order(self, mask: torch.Tensor, *, demote: bool) -> torch.Tensor:
        """Logical pages of ``mask`` ordered for demotion (lower tier first, oldest first) or for
        promotion (higher tier first, youngest first)."""
        pt = self.store.page_table
        pages = torch.nonzero(mask).flatten()
        key = pt.tier[pages].to(torch.int64) * _TIER_STRIDE + pt.birth[pages]
        return pages[torch.argsort(key if demote else -key, stable=True)]
