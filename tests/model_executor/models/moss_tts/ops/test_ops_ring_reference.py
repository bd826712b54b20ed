# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_reference``: ``attend_gathered_rows`` against attention written out query by
query (each query's softmax over the positions of its window), its writes into the gathered rows, and the logical
view of a paged ring with its inverse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_reference import (
    attend_gathered_rows,
    logical_rings,
    store_logical_rings,
)
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import build_ring_metadata

cpu = pytest.mark.cpu


def _window(capacity: int, head_dim: int) -> SimpleNamespace:
    """The fields of a group that ``build_ring_metadata`` reads: the ring (the window), the head dim, the RoPE base."""
    return SimpleNamespace(ring_capacity=capacity, window=capacity, head_dim=head_dim, max_period=10000.0)


def _by_hand(ring_row, offset, n, q, k, v, ring_semantics):
    """One row, one head: position ``p`` lives in cell ``p mod C`` of ``ring_row`` ``(2, C, Dh)`` before the step
    (``p < offset``) or is chunk token ``p - offset``; query ``t`` sees ``p`` with ``p <= offset + t``, within the
    window ``C``, and under ``"upstream"`` only positions the post-write ring holds (``p >= offset + n - C``)."""
    capacity = ring_row.shape[1]
    out = torch.zeros(n, q.shape[-1], dtype=torch.float64)
    for t in range(n):
        pos = offset + t
        lo = max(0, pos - capacity + 1)
        if ring_semantics == "upstream":
            lo = max(lo, offset + n - capacity)
        keys, values = [], []
        for p in range(lo, pos + 1):
            src = (
                (ring_row[0, p % capacity], ring_row[1, p % capacity]) if p < offset else (k[p - offset], v[p - offset])
            )
            keys.append(src[0].double())
            values.append(src[1].double())
        if keys:
            scores = torch.stack(keys) @ q[t].double() / q.shape[-1] ** 0.5
            out[t] = torch.softmax(scores, 0) @ torch.stack(values)
    return out


@cpu
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_attend_gathered_rows_is_attention_over_each_query_window(ring_semantics):
    gen = torch.Generator().manual_seed(2)
    capacity, heads, T, Dh = 5, 2, 8, 4
    offsets, written = torch.tensor([0, 3, 11]), torch.tensor([8, 2, 6])  # a chunk longer than the ring, wraps
    rows = torch.randn(2, 3, heads, capacity, Dh, generator=gen, dtype=torch.float64)
    q, k, v = (torch.randn(3, heads, T, Dh, generator=gen, dtype=torch.float64) for _ in range(3))
    meta = build_ring_metadata(_window(capacity, Dh), ring_semantics, offsets, written, T)
    before = rows.clone()
    out = attend_gathered_rows(ring_semantics, rows, meta, q, k, v)
    assert out.shape == (3, heads, T, Dh)
    for b in range(3):
        n, o = int(written[b]), int(offsets[b])
        for h in range(heads):
            want = _by_hand(before[:, b, h], o, n, q[b, h], k[b, h], v[b, h], ring_semantics)
            torch.testing.assert_close(out[b, h, :n], want, rtol=1e-9, atol=1e-12)
            # The rows now hold the last min(n, C) tokens at their cells, the other cells as before.
            for t in range(n):
                cell = (o + t) % capacity
                if t >= n - capacity:
                    assert torch.equal(rows[0, b, h, cell], k[b, h, t]) and torch.equal(rows[1, b, h, cell], v[b, h, t])
            kept = {(o + t) % capacity for t in range(n)}
            for cell in set(range(capacity)) - kept:
                assert torch.equal(rows[:, b, h, cell], before[:, b, h, cell])


@cpu
def test_keep_empty_rows_leaves_a_row_that_writes_nothing():
    gen = torch.Generator().manual_seed(4)
    capacity, T, Dh = 4, 3, 4
    offsets, written = torch.tensor([2, 5]), torch.tensor([3, 0])
    rows = torch.randn(2, 2, 1, capacity, Dh, generator=gen)
    q, k, v = (torch.randn(2, 1, T, Dh, generator=gen) for _ in range(3))
    meta = build_ring_metadata(_window(capacity, Dh), "exact", offsets, written, T)
    before = rows.clone()
    attend_gathered_rows("exact", rows, meta, q, k, v, keep_empty_rows=True)
    assert torch.equal(rows[:, 1], before[:, 1])
    assert not torch.equal(rows[:, 0], before[:, 0])


@cpu
def test_logical_rings_and_their_inverse():
    ring = torch.arange(2 * 5 * 1 * 2 * 1, dtype=torch.float32).view(2, 5, 1, 2, 1)  # 5 pages of 2 cells
    assert logical_rings(ring, None) is ring
    table = torch.tensor([[3, 0], [4, 1]])  # slot 0: pages 3, 0; slot 1: pages 4, 1
    rings = logical_rings(ring, table)
    assert rings.shape == (2, 2, 1, 4, 1)
    assert rings[0, :, 0, :, 0].tolist() == [[6.0, 7.0, 0.0, 1.0], [8.0, 9.0, 2.0, 3.0]]
    assert rings[1, :, 0, :, 0].tolist() == [[16.0, 17.0, 10.0, 11.0], [18.0, 19.0, 12.0, 13.0]]
    rings[:, 1] = -1.0
    rings[:, 0] = -2.0
    store_logical_rings(ring, table, rings, torch.tensor([1]))  # slot 1 only: pages 4 and 1
    assert ring[0, :, 0, :, 0].tolist() == [[0.0, 1.0], [-1.0, -1.0], [4.0, 5.0], [6.0, 7.0], [-1.0, -1.0]]
    assert ring[1, 2, 0, :, 0].tolist() == [14.0, 15.0] and ring[1, 1].eq(-1).all()
