# SPDX-License-Identifier: Apache-2.0
"""Rings held in pages (state/paged_rings.py): page tables on the host and the device, free lists, zeroing."""

from __future__ import annotations

import torch
from moss_codecs import PAGED_TEST_CAPACITY as CAPACITY
from moss_codecs import compact_and_paged_pools as _pools
from moss_codecs import random_codes
from moss_codecs import step_valid_rows as _step


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
