"""PageTable: slot translation, fill tracking."""

import torch

from sglang_minima.mem_cache.page_table import FMT_HOT, FMT_TQ3, TIER_RECENT, PageTable


def test_hot_slots_follow_physical_pages():
    pt = PageTable(8, 4)
    pt.map(torch.tensor([3, 5]), FMT_HOT, torch.tensor([2, 1]), step=0)
    slots = torch.tensor([12, 13, 21, 23])
    assert pt.hot_slots(slots).tolist() == [8, 9, 5, 7]
    assert pt.tier[3] == TIER_RECENT


def test_a_page_is_sealed_once_its_last_slot_is_written():
    pt = PageTable(8, 4)
    pt.map(torch.tensor([2]), FMT_HOT, torch.tensor([1]), step=0)
    pt.note_written(pt.hot_slots(torch.tensor([8, 9, 10])))
    assert not bool(pt.sealed[2])
    pt.note_written(pt.hot_slots(torch.tensor([11])))
    assert bool(pt.sealed[2]) and int(pt.fill[2]) == 4
    pt.publish(torch.tensor([2]), FMT_TQ3, torch.tensor([5]))
    assert bool(pt.sealed[2]) and int(pt.fill[2]) == 4  # a TQ3 page is full
    pt.publish(torch.tensor([2]), FMT_HOT, torch.tensor([3]))  # promoted into another hot page: full
    assert bool(pt.sealed[2]) and pt.fill.tolist() == [0, 0, 4, 0, 0, 0, 0, 0, 0]


def test_a_late_write_to_a_page_freed_and_mapped_again_does_not_seal_the_new_owners_page():
    """SGLang's overlap scheduler: a forward in flight writes logical page 2 (translated at its plan,
    physical page 1) while the scheduler frees page 2 and maps it again for a new request (physical
    page 3: page 1 waits in the release quarantine). The forward's last layer then notes its write."""
    pt = PageTable(8, 4)
    pt.map(torch.tensor([2]), FMT_HOT, torch.tensor([1]), step=0)
    pt.note_written(pt.hot_slots(torch.tensor([8, 9])))
    planned = pt.hot_slots(torch.tensor([10, 11]))  # the forward's plan
    pt.unmap(torch.tensor([2]))
    pt.map(torch.tensor([2]), FMT_HOT, torch.tensor([3]), step=1)
    pt.note_written(planned)  # the forward's last layer, late
    assert not bool(pt.sealed[2]) and int(pt.fill[2]) == 0  # the new owner has written nothing yet
    assert int(pt.hot_fill[1]) == 4  # the quarantined page took the write; its next map resets it
    pt.unmap(torch.tensor([2]))
    pt.map(torch.tensor([6]), FMT_HOT, torch.tensor([1]), step=2)
    assert int(pt.fill[6]) == 0


def test_publish_moves_a_mapped_page_and_unmap_clears_it():
    pt = PageTable(8, 4)
    pt.map(torch.tensor([1]), FMT_HOT, torch.tensor([3]), step=0)
    pt.publish(torch.tensor([1]), FMT_TQ3, torch.tensor([6]))
    assert (int(pt.fmt[1]), int(pt.phys[1])) == (FMT_TQ3, 6)
    pt.unmap(torch.tensor([1]))
    assert not bool(pt.mapped[1]) and int(pt.fmt[1]) == FMT_HOT
