"""Property test of the page lifecycle: random append / retier / promote / seal / finish / evict /
abort / read sequences over a tiered store, with SGLang's logical ownership modelled beside it. Conversions may
be held pending on the conversion stream (as on a GPU's side stream) until a ``copies_finish`` rule.

After every step: no physical page is leaked or doubly freed (reference counts equal mappings; the
free lists and the release quarantine hold exactly the unreferenced pages), #free logical == #free
FP8 + #free TQ3 + #quarantined + #held by pending conversions alone, no page a forward in flight read (planned since the end of the step
before last; a device sync ends them all) is back on a free list or mapped to another logical page,
every live logical page is readable (a pending conversion's page in its old format), and attention over the mixed formats equals attention over the
dense K/V up to codec error. Every allocation admission allows (logical room, and hot pages free or
sealed: ``hot_reachable``) succeeds, however full the TQ3 region is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang_minima.layers.attention.plan import plan_request
from sglang_minima.config import MinimaConfig
from sglang_minima.mem_cache.controller import LifecycleController
from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, TIER_ANCHOR, TIER_RECENT
from sglang_minima.ops.dense import attend, causal_mask
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention
from store_helpers import DIM, HEADS, LAYERS, PS, HeldConversionStream, make_store, read_page, rel_err, write_tokens

NUM_LOGICAL = 24
NUM_HOT = 10
PAGE_ERR = 0.45  # TQ3 (and TQ3 -> FP8) reconstruction error bound; a mixed-up page errs by ~1.4
ATTN_EXACT = 1e-4  # against dense attention over each page's current reconstruction
ATTN_ERR = 0.6  # against dense attention over the original K/V


@dataclass
class Request:
    pages: list[int] = field(default_factory=list)
    shared: int = 0  # leading pages borrowed from the tree (a prefix hit), not the request's to free
    prefilling: bool = False  # a chunked prefill between chunks (its pages wait with --minima-defer-prefill-conversion)
    k: list[torch.Tensor] = field(default_factory=list)  # per token: [LAYERS, H, D]
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.k)

    def slots(self) -> torch.Tensor:
        pages = torch.tensor(self.pages, dtype=torch.int64)
        return (pages[:, None] * PS + torch.arange(PS)).flatten()[: self.tokens]


class Lifecycle(RuleBasedStateMachine):
    steps_run = 0  # operations executed over all examples (benchmark/reliability/lifecycle_soak.py reports it)
    ticks_skipped = 0  # steps LifecycleController.settled let skip (each checked against a real tick)
    ticks_deferred = 0  # steps LifecycleController.due let wait for new pages (--minima-tick-min-new-pages)
    attention_every = 1  # the soak checks attention every N operations; the ownership invariants always
    pressure_orders_checked = 0  # pressure conversions that left some convertible pages hot (order checked)

    @initialize(anchors=st.integers(0, 3), fill=st.sampled_from(["age", "score", "window"]), hold=st.booleans(),
                tick_pages=st.sampled_from([1, 3]), defer=st.booleans(), strict=st.booleans(),
                pressure_batch=st.sampled_from([0, 4]))
    def setup(self, anchors, fill, hold=False, tick_pages=1, defer=True, strict=False, pressure_batch=0):
        self.stream = HeldConversionStream(hold)  # hold: conversions stay pending until copies_finish
        self.store = make_store(NUM_LOGICAL, NUM_HOT, stream=self.stream)
        # Forwards in flight, by the (format, physical page, logical page) they read: those planned
        # since the last step end, and those planned before it (done at the next step end).
        self.reads_now: list[tuple[int, int, int]] = []
        self.reads_before: list[tuple[int, int, int]] = []
        drain = self.store.drain_quarantine

        def drain_after_sync() -> bool:  # a device sync inside it ends every forward in flight
            synced = drain()
            if synced:
                self.reads_now, self.reads_before = [], []
            return synced

        self.store.drain_quarantine = drain_after_sync
        self.ctl = LifecycleController(
            self.store,
            MinimaConfig(recent_pages=2, sink_pages=1, anchor_pages=anchors, attention_score_anchors=fill == "score",
                         anchor_window=PS if fill == "window" and anchors else 0,
                         retier_batch_pages=3, tick_min_new_pages=tick_pages, defer_prefill_conversion=defer,
                         strict_hot_admission=strict, pressure_batch_pages=pressure_batch),
        )
        self.free_logical = list(range(1, NUM_LOGICAL + 1))
        self.reqs: dict[int, Request] = {}
        self.tree: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sealed cached page -> its K, V
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(1234)

    # ------------------------------------------------------------------ SGLang's side, modelled

    def _alloc_pages(self, n: int) -> list[int] | None:
        """What MinimaPagedAllocator does: logical pages, each backed by a hot page found first."""
        # Admission's promise (HotPageBudget counts every sealed hot page as reachable, and SGLang
        # frees logical room first): both together suffice, however full the TQ3 region is.
        admissible = n <= len(self.free_logical) and n <= self.ctl.hot_reachable()
        # --minima-strict-hot-admission's promise: what it admits converts no Anchor or Recent page
        strict = n <= len(self.free_logical) and n <= self.ctl.hot_reachable(admission=True)
        tiers_before = dict(self.store.stats.pressure_retier_tiers)
        pt = self.store.page_table
        sealed = torch.nonzero(self.store.hot_convertible() & ~self.store.converting.bool()).flatten()
        tiers = pt.tier[sealed].clone()
        ok = n <= len(self.free_logical) and self.ctl.reserve_hot(n)  # may sync and free the quarantine
        # the pressure path's order (by the last tick's tiers): no Anchor page converted while a cached
        # or Stale one stays hot, no Recent page while an Anchor one does
        group = (tiers >= TIER_ANCHOR).long() + (tiers >= TIER_RECENT).long()
        converted = pt.fmt[sealed] == FMT_TQ3
        if converted.any() and (~converted).any():
            type(self).pressure_orders_checked += 1
            assert group[converted].max() <= group[~converted].min(), (tiers[converted], tiers[~converted])
        if strict and self.ctl.config.strict_hot_admission:
            after = self.store.stats.pressure_retier_tiers
            assert (after["anchor"], after["recent"]) == (tiers_before["anchor"], tiers_before["recent"])
        if not ok:
            assert not admissible, (n, len(self.free_logical), self.store.tq3_pool.num_free)
            return None
        pages, self.free_logical = self.free_logical[:n], self.free_logical[n:]
        self.store.map_new(torch.tensor(pages))
        return pages

    def _free_pages(self, pages: list[int]) -> None:
        if pages:
            self.store.unmap(torch.tensor(pages))
            self.free_logical.extend(pages)

    def _append(self, req: Request, n: int) -> bool:
        room = len(req.pages) * PS - req.tokens
        new = self._alloc_pages(max(0, -(-(n - room) // PS)))
        if new is None:
            return False
        req.pages += new
        k = torch.randn(LAYERS, n, HEADS, DIM, generator=self.gen)
        v = torch.randn(LAYERS, n, HEADS, DIM, generator=self.gen)
        start = req.tokens
        req.k += list(k.unbind(1))
        req.v += list(v.unbind(1))
        write_tokens(self.store, req.slots()[start:], k, v)
        return True

    # ------------------------------------------------------------------ rules

    @rule(n=st.integers(1, 3 * PS), prefilling=st.booleans())
    def new_request(self, n, prefilling=False):
        req = Request(prefilling=prefilling)
        if self._append(req, n):
            self.reqs[self.next_id] = req
            self.next_id += 1
        else:
            self._free_pages(req.pages)

    @precondition(lambda self: bool(self.tree))
    @rule(data=st.data())
    def prefix_hit(self, data):
        """A new request matched cached pages: it reads them in whatever format they are in."""
        pages = sorted(self.tree)
        take = data.draw(st.integers(1, len(pages)))
        req = Request(pages=pages[:take], shared=take)
        for p in pages[:take]:
            k, v = self.tree[p]
            req.k += list(k.unbind(1))
            req.v += list(v.unbind(1))
        self.store.stats.prefix_hit_tq3_pages += int((self.store.page_table.fmt[pages[:take]] == FMT_TQ3).sum())
        self.ctl.note_matched(torch.tensor(pages[:take]))  # MinimaRadixCache.match_prefix's note
        self.reqs[self.next_id] = req
        self.next_id += 1

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), n=st.integers(1, PS + 1))
    def append(self, data, n):
        self._append(self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))], n)

    @precondition(lambda self: any(r.prefilling for r in self.reqs.values()))
    @rule(data=st.data())
    def prefill_ends(self, data):
        """A chunked prefill's last chunk: the request decodes from now on (its pages may convert)."""
        self.reqs[data.draw(st.sampled_from(sorted(r for r, q in self.reqs.items() if q.prefilling)))].prefilling = False

    @rule()
    def step(self):
        """One scheduler step: the forward reads every live request's pages and reports attention
        mass; after its result, the step ends and the controller retiers / promotes."""
        for req in self.reqs.values():
            self._read(req)
        self.store.end_step()
        self.reads_before, self.reads_now = self.reads_now, []
        sequences = [torch.tensor(r.pages) for r in self.reqs.values()]
        prefilling = [r.prefilling for r in self.reqs.values()]
        members = tuple((rid, r.prefilling) for rid, r in self.reqs.items())
        counts = tuple(len(r.pages) for r in self.reqs.values())
        key = (members, counts)  # what the radix cache passes
        waiting = self._deferred_hot_pages()
        if self.ctl.settled(key):
            # The skip is sound: a tick now would change no page's tier, format or mapping.
            type(self).ticks_skipped += 1
            before = self._lifecycle_state()
            self.ctl.tick(sequences, prefilling, requests=list(self.reqs))
            assert self._lifecycle_state() == before
        elif self.ctl.due(members, sum(counts)):  # with tick_min_new_pages > 1 some steps wait (no check:
            self.ctl.tick(sequences, prefilling, key=key, requests=list(self.reqs))  # (they skip real work; the
            # invariants below must hold anyway)
            self.ctl.ticked(members, sum(counts))
        else:
            type(self).ticks_deferred += 1
        # The deferred conversion: a tick converts no hot page of a request still in prefill (only an
        # allocation that finds no free hot page may: reserve_hot, in _alloc_pages)
        pt = self.store.page_table
        assert (pt.fmt[waiting] == FMT_HOT).all() and not self.store.converting[waiting].any()

    def _deferred_hot_pages(self) -> torch.Tensor:
        """Hot pages of requests still in prefill, none of them converting, when the deferral is on."""
        if not self.ctl.config.defer_prefill_conversion:
            return torch.empty(0, dtype=torch.int64)
        pages = torch.tensor(sorted({p for r in self.reqs.values() if r.prefilling for p in r.pages}), dtype=torch.int64)
        pt = self.store.page_table
        return pages[(pt.fmt[pages] == FMT_HOT) & ~self.store.converting[pages].bool()]

    def _lifecycle_state(self):
        pt, store = self.store.page_table, self.store
        return (pt.fmt.tolist(), pt.phys.tolist(), pt.tier.tolist(), store.hot_pool.num_free,
                store.tq3_pool.num_free, store.stats.retier.pages, store.stats.promote.pages)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def read(self, data):
        """A forward still in flight (no step end yet) reads a request's pages."""
        self._read(self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))])

    def _read(self, req: Request) -> None:
        pages = torch.tensor(req.pages)
        pt = self.store.page_table
        self.reads_now += [(int(pt.fmt[p]), int(pt.phys[p]), int(p)) for p in pages]
        self.store.note_read(pages)
        self.store.note_page_scores(pages, torch.rand(pages.numel(), generator=self.gen), decay=0.5)
        self.store.note_window_mass(pages, torch.rand(pages.numel(), generator=self.gen), {})

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def finish(self, data):
        """Seal: the tree keeps the request's full pages; the partial tail is freed."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        full = req.tokens // PS
        for i, p in enumerate(req.pages[req.shared:full], start=req.shared):
            tok = slice(i * PS, (i + 1) * PS)
            self.tree[p] = (torch.stack(req.k[tok], 1), torch.stack(req.v[tok], 1))
        self._free_pages(req.pages[max(full, req.shared):])

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def abort(self, data):
        req = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs))))
        self._free_pages(req.pages[req.shared:])

    @precondition(lambda self: bool(self.reqs) or bool(self.tree))
    @rule(data=st.data(), promote=st.booleans())
    def convert(self, data, promote):
        """A conversion outside the tick (the pressure path's retier, a promotion) of some live pages."""
        live = sorted({p for r in self.reqs.values() for p in r.pages} | set(self.tree))
        pages = torch.tensor(data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True)))
        (self.store.promote if promote else self.store.retier)(pages)

    @rule()
    def copies_finish(self):
        """The side stream finishes every copy launched so far (published at the next tick)."""
        self.stream.complete()

    @precondition(lambda self: self.store.conversions_pending)
    @rule(data=st.data())
    def convert_again(self, data):
        """A page whose conversion is pending is not converted again, either way."""
        conv = data.draw(st.sampled_from(self.store.pending))
        busy = conv.pages[self.store.converting[conv.pages_host] == conv.id]
        held = (self.store.hot_pool.num_held, self.store.tq3_pool.num_held)
        assert self.store.retier(busy) == 0 and self.store.promote(busy) == 0
        assert (self.store.hot_pool.num_held, self.store.tq3_pool.num_held) == held

    @precondition(lambda self: bool(self.tree))
    @rule(n=st.integers(1, 4))
    def evict(self, n):
        """Tree eviction: cached pages no live request holds (the tree's LRU, here oldest first)."""
        held = {p for r in self.reqs.values() for p in r.pages[: r.shared]}
        victims = [p for p in sorted(self.tree) if p not in held][:n]
        for p in victims:
            del self.tree[p]
        self._free_pages(victims)

    def teardown(self):
        """The scheduler goes idle: every pending conversion publishes and the quarantine drains."""
        self.store.drain_quarantine()
        assert not self.store.conversions_pending and self.store.num_quarantined == 0
        self.no_leaked_or_doubly_freed_page()
        self.every_live_page_is_readable()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def count_step(self):
        type(self).steps_run += 1

    @invariant()
    def no_leaked_or_doubly_freed_page(self):
        store = self.store
        pt = store.page_table
        mapped = pt.mapped
        for pool, fmt in ((store.hot_pool, FMT_HOT), (store.tq3_pool, FMT_TQ3)):
            expected = torch.zeros_like(pool.refcount)
            phys = pt.phys[mapped & (pt.fmt == fmt)].long()
            expected.index_add_(0, phys, torch.ones_like(phys, dtype=torch.int32))
            for conv in store.pending:  # one reference on each source and each destination
                for ids in ([conv.src] if conv.src_pool is pool else []) + ([conv.dst] if conv.dst_pool is pool else []):
                    expected.index_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int32))
            assert torch.equal(pool.refcount, expected)
            free, quarantined = pool._free, pool._freed + pool._cooling
            assert len(free) + len(quarantined) == len(set(free) | set(quarantined))
            assert set(free) | set(quarantined) == set(torch.nonzero(pool.refcount[1:] == 0).flatten().add(1).tolist())
            # what a forward in flight reads is not handed out again
            owner = {int(q): int(lp) for lp, q in zip(torch.nonzero(mapped & (pt.fmt == fmt)).flatten(), phys)}
            for read_fmt, read_phys, logical in self.reads_now + self.reads_before:
                if read_fmt == fmt:
                    assert read_phys not in free, (read_phys, logical)
                    assert owner.get(read_phys, logical) == logical, (read_phys, logical)
        assert store.reference_mismatches() == 0  # the store's own check agrees with this one
        held = store.held_by_conversions(store.hot_pool) + store.held_by_conversions(store.tq3_pool)
        assert len(self.free_logical) == store.hot_pool.num_free + store.tq3_pool.num_free + store.num_quarantined + held
        live = {p for r in self.reqs.values() for p in r.pages} | set(self.tree)
        assert set(torch.nonzero(mapped).flatten().tolist()) == live

    @invariant()
    def pending_conversions_still_read_their_sources(self):
        """Each logical page a pending conversion will publish is mapped to its source, in one
        conversion at most; no other page is marked converting."""
        store, pt = self.store, self.store.page_table
        marked = set()
        for conv in store.pending:
            live = store.converting[conv.pages_host] == conv.id
            src_fmt = FMT_HOT if conv.src_pool is store.hot_pool else FMT_TQ3
            assert (pt.fmt[conv.pages[live]] == src_fmt).all()
            assert torch.equal(pt.phys[conv.pages[live]].long(), conv.src[live])
            marked |= set(conv.pages_host[live].tolist())
        assert marked == set(torch.nonzero(store.converting).flatten().tolist())
        if not store.pending:
            assert not store.converting.any()

    def _pages(self):
        """Every live logical page with its written K, V [LAYERS, n, H, D] (n < PS for a tail)."""
        for p, kv in self.tree.items():
            yield p, kv
        for req in self.reqs.values():
            k, v = torch.stack(req.k, 1), torch.stack(req.v, 1)
            for i, p in enumerate(req.pages[req.shared :], start=req.shared):
                tok = slice(i * PS, min((i + 1) * PS, req.tokens))
                yield p, (k[:, tok], v[:, tok])

    @invariant()
    def every_live_page_is_readable(self):
        for p, (k, v) in self._pages():
            n = k.shape[1]
            for layer in range(LAYERS):
                kk, vv = read_page(self.store, p, layer)
                assert rel_err(kk[:n], k[layer]) < PAGE_ERR and rel_err(vv[:n], v[layer]) < PAGE_ERR

    @invariant()
    @precondition(lambda self: type(self).steps_run % type(self).attention_every == 0)
    def attention_matches_dense_reference(self):
        store = self.store
        for req in self.reqs.values():
            slots = req.slots()
            route = plan_request(slots, store.page_table.fmt, store.page_table.phys, PS, q_start=0, q_len=1)
            q = torch.randn(1, 2 * HEADS, DIM, generator=self.gen)
            mask = causal_mask(route.q_positions, torch.arange(req.tokens))
            k_all, v_all = torch.stack(req.k, 1), torch.stack(req.v, 1)
            for layer in range(LAYERS):
                hot = HotPagedKV(store.hot_k[layer], store.hot_v[layer], route.hot_slots, route.hot_positions)
                tq3 = Tq3PagedKV(store.tq3[layer], route.tq3_pages, store.layout, store.codebook, route.tq3_page_starts)
                out, _ = mixed_paged_attention(q, hot, tq3, store.rotations[layer], DIM**-0.5, route.q_positions)
                pages = [read_page(store, p, layer) for p in req.pages]
                k_now = torch.cat([k for k, _ in pages])[: req.tokens]
                v_now = torch.cat([v for _, v in pages])[: req.tokens]
                exact, _ = attend(q, k_now, v_now, DIM**-0.5, mask)
                dense, _ = attend(q, k_all[layer], v_all[layer], DIM**-0.5, mask)
                assert rel_err(out, exact) < ATTN_EXACT
                assert rel_err(out, dense) < ATTN_ERR


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_machine_skips_ticks_it_checks():
    """The soundness check above has something to check: a short deterministic run skips ticks."""
    Lifecycle.ticks_skipped = 0
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", hold=False)
    machine.new_request(2 * PS)
    for _ in range(3):
        machine.step()  # the first tick retiers what it can, the next ones find nothing to do
    machine.teardown()
    assert Lifecycle.ticks_skipped >= 1


def test_the_machine_defers_ticks_for_new_pages():
    """The deferred path has something to check: with ticks every 3 new pages, steps that added fewer
    wait, and the pages still convert once enough are added."""
    Lifecycle.ticks_deferred = 0
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", hold=False, tick_pages=3)
    machine.new_request(2 * PS)
    machine.step()  # the first tick
    req = machine.reqs[0]
    for _ in range(2):
        machine._append(req, PS)  # one page more: not yet due
        machine.step()
        machine.no_leaked_or_doubly_freed_page()
    assert Lifecycle.ticks_deferred == 2 and machine.store.stats.retier.pages == 0
    machine._append(req, PS)  # the third new page: the tick runs and converts the aged pages
    machine.step()
    assert machine.store.stats.retier.pages > 0
    machine.no_leaked_or_doubly_freed_page()
    machine.teardown()


def test_the_machine_holds_conversions_across_steps():
    """The pending path has something to check: conversions stay pending over steps until the copies
    finish, and the tick after that publishes them."""
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", hold=True)
    machine.new_request(5 * PS)  # a sink page, two Stale pages, two Recent ones
    machine.step()  # launches the conversion of the Stale pages
    for _ in range(2):
        assert machine.store.conversions_pending and machine.store.stats.retier.pages == 0
        machine._read(machine.reqs[0])  # a forward reads them in FP8
        machine.step()
        machine.no_leaked_or_doubly_freed_page()
        machine.every_live_page_is_readable()
    machine.copies_finish()
    machine.step()
    assert not machine.store.conversions_pending and machine.store.stats.retier.pages == 2
    machine.no_leaked_or_doubly_freed_page()
    machine.teardown()


@pytest.mark.parametrize("defer", [True, False])
def test_the_machine_checks_the_deferred_conversion(defer):
    """The deferral's check has something to check: a request in prefill keeps its Stale pages hot
    through the ticks while the deferral is on, and they convert at the first tick after its prefill
    ends; with the deferral off they convert at once."""
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", defer=defer)
    machine.new_request(5 * PS, prefilling=True)  # a sink page, two Stale pages, two Recent ones
    machine.step()
    assert len(machine._deferred_hot_pages()) == (5 if defer else 0)
    assert machine.store.stats.retier.pages == (0 if defer else 2)
    machine.reqs[0].prefilling = False  # its last chunk
    machine.step()
    assert machine.store.stats.retier.pages == 2
    machine.no_leaked_or_doubly_freed_page()
    machine.teardown()


def test_the_machine_checks_the_pressure_order():
    """The pressure order's check has something to check: an allocation short of hot pages converts a
    Stale page of a request in prefill (its deferred pages, the lowest tier here), not its sink or
    Recent pages."""
    Lifecycle.pressure_orders_checked = 0
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", defer=True)
    machine.new_request(5 * PS, prefilling=True)  # a sink page, two Stale pages, two Recent ones
    machine.step()  # classified; the deferral keeps them hot
    pages = machine._alloc_pages(NUM_HOT - 5 + 1)  # one hot page more than are free
    assert pages is not None and Lifecycle.pressure_orders_checked == 1
    req = machine.reqs[0].pages
    assert machine.store.page_table.fmt[req].tolist() == [FMT_HOT, FMT_TQ3, FMT_HOT, FMT_HOT, FMT_HOT]
    assert machine.store.stats.pressure_retier_tiers["deferred"] == 1
    machine._free_pages(pages)
    machine.no_leaked_or_doubly_freed_page()
    machine.teardown()


def test_the_machine_checks_strict_admission():
    """The strict admission's check has something to check: with a prompt's sink, two deferred Stale
    and two Recent pages hot, admission counts the free pages and the two Stale ones; one page more
    than that converts the sink, which only the pressure path may do, not an admission."""
    machine = Lifecycle()
    machine.setup(anchors=0, fill="age", defer=True, strict=True)
    machine.new_request(5 * PS, prefilling=True)
    machine.step()
    assert machine.ctl.hot_reachable() == NUM_HOT and machine.ctl.hot_reachable(admission=True) == NUM_HOT - 3
    pages = machine._alloc_pages(NUM_HOT - 3)  # admissible: the Stale pages convert, nothing else
    assert pages is not None and machine.store.stats.pressure_retier_tiers["deferred"] == 2
    machine._free_pages(pages)
    machine.step()
    machine.step()  # the freed pages leave the quarantine
    pages = machine._alloc_pages(NUM_HOT - 2)  # past it: the sink goes
    assert pages is not None and machine.store.stats.pressure_retier_tiers["anchor"] == 1
    machine._free_pages(pages)
    machine.no_leaked_or_doubly_freed_page()
    machine.teardown()
