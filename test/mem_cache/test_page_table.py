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
    pt.note_written(torch.tensor([8, 9, 10]))
    assert not bool(pt.sealed[2])
    pt.note_written(torch.tensor([11]))
    assert bool(pt.sealed[2]) and int(pt.fill[2]) == 4


def test_publish_moves_a_mapped_page_and_unmap_clears_it():
    pt = PageTable(8, 4)
    pt.map(torch.tensor([1]), FMT_HOT, torch.tensor([3]), step=0)
    pt.publish(torch.tensor([1]), FMT_TQ3, torch.tensor([6]))
    assert (int(pt.fmt[1]), int(pt.phys[1])) == (FMT_TQ3, 6)
    pt.unmap(torch.tensor([1]))
    assert not bool(pt.mapped[1]) and int(pt.fmt[1]) == FMT_HOT
