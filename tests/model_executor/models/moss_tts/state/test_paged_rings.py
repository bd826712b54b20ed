# SPDX-License-Identifier: Apache-2.0
"""Rings held in pages (state/paged_rings.py): page tables on the host and the device, free lists, zeroing."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import PAGED_TEST_CAPACITY as CAPACITY
from moss_codecs import compact_and_paged_pools as _pools
from moss_codecs import random_codes
from moss_codecs import step_valid_rows as _step

from vllm_omni_moss.model_executor.models.moss_tts.state import PageBudget
from vllm_omni_moss.model_executor.models.moss_tts.state.paged_rings import PagedRings


def test_release_zeroes_only_the_reslots_in_use_pages(ring_decoder):
    # Freed pages are filled group by group (one fill per resolution group): the other slot's pages keep
    # their bytes in every layer, and the freed pages return to their group's free list.
    _, pool = _pools(ring_decoder)
    full = pool.free_page_counts()
    _step(pool, random_codes(ring_decoder, 2, 7, seed=4), [7, 5], [0, 1])
    before = [ring.clone() for ring in pool.rings]
    kept = [sorted({int(p) for p in table[1] if p}) for table in pool.page_tables]
    freed = [sorted({int(p) for p in table[0] if p}) for table in pool.page_tables]
    pool.release([0])
    assert pool.free_page_counts() == [f - len(k) for f, k in zip(full, kept)]
    for layer, (ring, old) in enumerate(zip(pool.rings, before)):
        g = pool.store.group_of(layer)
        assert not ring[:, freed[g]].any(), layer
        assert torch.equal(ring[:, kept[g]], old[:, kept[g]]) and bool(ring[:, kept[g]].any()), layer


def test_reserve_writes_the_host_tables_and_a_commit_writes_the_device_once(ring_decoder, monkeypatch):
    """reserve() allocates on the host only; the device page tables get every pending entry at the next
    commit, in one host-to-device copy, and equal the host tables then. A slot released before the commit
    ends with a null row (the commit that release makes first cannot leave its entries behind)."""
    _, pool = _pools(ring_decoder)
    copies = []
    to_device = pool._ids_to_device
    monkeypatch.setattr(pool, "_ids_to_device", lambda ids: copies.append(ids.shape) or to_device(ids))
    assert pool.reserve({0: 7, 1: 3, 2: 1})
    assert copies == [] and all(not table.any() for table in pool.store.page_tables)  # nothing on the device
    pool.commit_page_tables()
    assert len(copies) == 1 and copies[0][0] == 3  # one (rows, cols, pages) copy for every group
    for g, table in enumerate(pool.store.page_tables):
        for slot in range(CAPACITY):
            held = pool.store.host_tables[g][slot]
            assert table[slot, : len(held)].tolist() == held and not table[slot, len(held) :].any()
    pool.commit_page_tables()
    assert len(copies) == 1  # nothing pending: no copy
    assert pool.reserve({1: 12})
    pool.release([1])
    assert all(not table[1].any() for table in pool.store.page_tables)
    assert all(tables[1] == [] for tables in pool.store.host_tables)


# --------------------------------------------------------------------------------------- page rings on their own


def _paged_rings(decoder, pages_per_group):
    """Rings of 5 and 10 cells in pages of 5 (1 and 2 pages a ring), for 2 slots, ids kept on the CPU."""
    rings = PagedRings(PageBudget(decoder.config, torch.float32, 5), torch.device("cpu"), lambda ids: ids)
    rings.allocate(2, pages_per_group)
    return rings


@pytest.mark.cpu
@pytest.mark.core_model
def test_pages_come_off_a_lifo_free_list_and_reach_the_device_tables_at_commit(ring_decoder):
    rings = _paged_rings(ring_decoder, [3, 5])
    assert rings.free == [[2, 1], [4, 3, 2, 1]] and rings.free_counts() == [2, 4]
    assert [tuple(t.shape) for t in rings.page_tables] == [(2, 1), (2, 2)]
    assert [tuple(g.shape) for g in rings.groups] == [(3, 2, 3, 2, 5, 64), (3, 2, 5, 2, 5, 64)]
    plan = rings.extra_by_slot({0: 3, 1: 0})  # 3 frames: 3 tokens in group 0, 6 in group 1
    assert plan == [{0: 1}, {0: 2}] and rings.short(plan) is None
    rings.allocate_pages(plan)
    assert rings.host_tables == [[[1], []], [[1, 2], []]] and rings.free_counts() == [1, 2]
    assert [rings.held_pages(g) for g in (0, 1)] == [1, 2] and rings.held_bytes() == 3 * 15_360
    assert not any(t.any() for t in rings.page_tables)  # the host's tables only
    rings.commit()
    assert rings.page_tables[0].tolist() == [[1], [0]] and rings.page_tables[1].tolist() == [[1, 2], [0, 0]]
    assert rings.extra_by_slot({0: 5}) == [{}, {}]  # slot 0 already holds what 5 frames need
    assert rings.short(rings.extra_by_slot({1: 3})) is None
    assert rings.short([{1: 1}, {1: 3}]) == 1


@pytest.mark.cpu
@pytest.mark.core_model
def test_cells_live_in_the_slots_pages_and_clear_gives_the_pages_back_zeroed(ring_decoder):
    rings = _paged_rings(ring_decoder, [3, 5])
    rings.allocate_pages(rings.extra_by_slot({0: 1, 1: 5}))  # group 1: slot 0 takes page 1, slot 1 pages 2 and 3
    assert rings.host_tables[1] == [[1], [2, 3]]
    values = torch.arange(2 * 2 * 2 * 64, dtype=torch.float32).reshape(2, 2, 2, 64) + 1
    rings.write_cells(3, 1, torch.tensor([1, 7]), values)  # cell 1 in page 2 row 1, cell 7 in page 3 row 2
    layer = rings.layers[3]  # (2, pages, H, page_size, Dh)
    assert torch.equal(layer[:, 2, :, 1], values[:, :, 0]) and torch.equal(layer[:, 3, :, 2], values[:, :, 1])
    assert torch.equal(rings.read_cells(3, 1, torch.tensor([1, 7])), values)
    assert rings.group_of(3) == 1 and rings.group_of(2) == 0
    rings.clear(torch.tensor([1]), [1])
    assert not layer.any() and rings.host_tables[1] == [[1], []]
    assert rings.free[1] == [4, 3, 2] and rings.page_tables[1].tolist() == [[1, 0], [0, 0]]
