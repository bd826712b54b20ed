# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_write``: the grid reference of the ring write, the write kernel's launch on packed
rows against it (in Triton's interpreter, RoPE tables and paged rings included), the page table's check, and the
kernels' RoPE and paging arguments.

``test_triton_interpreter_subprocess`` re-runs this file in a ``TRITON_INTERPRET=1`` child selecting the
``*interpreted*`` tests, which the parent skips.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_write as write_ops
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import rope_tables

cpu = pytest.mark.cpu


@cpu
def test_ring_write_keeps_the_last_capacity_tokens_of_each_row():
    C, T = 4, 10
    ring = torch.full((2, 3, 1, C, 1), -1.0)
    k = torch.arange(20.0).view(2, 1, T, 1)
    v = -k
    # Row 0: 10 tokens from offset 6 -> tokens 6..9 at positions 12..15 -> cells 0..3.
    # Row 1: 3 tokens from offset 1 -> positions 1..3 -> cells 1..3. Row 2 (padding, junk slot id).
    write_ops.ring_write_reference(
        torch.cat([k, torch.zeros(1, 1, T, 1)]),
        torch.cat([v, torch.zeros(1, 1, T, 1)]),
        ring,
        torch.tensor([2, 0, 99]),
        torch.tensor([6, 1, 0]),
        torch.tensor([10, 3, 0]),
    )
    assert ring[0, 2, 0, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert ring[1, 2, 0, :, 0].tolist() == [-6.0, -7.0, -8.0, -9.0]
    assert ring[0, 0, 0, :, 0].tolist() == [-1.0, 10.0, 11.0, 12.0]
    assert ring[:, 1].eq(-1).all()


@cpu
def test_the_reference_writes_a_paged_ring_through_its_page_table():
    # Slot 1's ring of 4 cells is pages 2 and 0 (2 cells each); 3 tokens from offset 1 land in cells 1..3.
    ring = torch.zeros(2, 3, 1, 2, 1)
    table = torch.tensor([[1, 1], [2, 0]])
    k = torch.tensor([5.0, 6.0, 7.0]).view(1, 1, 3, 1)
    write_ops.ring_write_reference(
        k, -k, ring, torch.tensor([1]), torch.tensor([1]), torch.tensor([3]), page_table=table
    )
    assert ring[0, :, 0, :, 0].tolist() == [[6.0, 7.0], [0.0, 0.0], [0.0, 5.0]]
    assert ring[1, :, 0, :, 0].tolist() == [[-6.0, -7.0], [0.0, 0.0], [0.0, -5.0]]


@cpu
@pytest.mark.parametrize(
    "page_table,error,message",
    [
        ([0], TypeError, "`page_table` must be a tensor or None, got list"),
        (torch.zeros(3, dtype=torch.long), ValueError, "`page_table` must be (S, pages per ring) with at least one page, got (3,)"),
        (torch.zeros(3, 0, dtype=torch.long), ValueError, "`page_table` must be (S, pages per ring) with at least one page, got (3, 0)"),
        (torch.zeros(2, 3), ValueError, "`page_table` must be int32 or int64, got torch.float32"),
        (torch.zeros(2, 3, dtype=torch.int16), ValueError, "`page_table` must be int32 or int64, got torch.int16"),
        (torch.zeros(2, 3, dtype=torch.long, device="meta"), ValueError, "`page_table` is on meta, the ring on cpu"),
    ],
)  # fmt: skip
def test_check_page_table_names_the_op_and_the_fault(page_table, error, message):
    ring = torch.zeros(2, 6, 1, 4, 8)
    for good in (None, torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.long)):
        write_ops.check_page_table("some_op", good, ring)
    with pytest.raises(error) as raised:
        write_ops.check_page_table("some_op", page_table, ring)
    assert type(raised.value) is error and str(raised.value) == f"some_op: {message}"


@cpu
def test_paging_and_rope_arguments():
    ring, fallback = torch.zeros(2, 6, 1, 4, 8), torch.zeros(3, dtype=torch.long)
    assert write_ops.paging_arguments(ring, None, fallback) == (4, (fallback, 0, 0), False, 1)
    table = torch.zeros(5, 3, dtype=torch.int32)
    capacity, (arg, stride_s, stride_p), paged, page_size = write_ops.paging_arguments(ring, table, fallback)
    assert (capacity, stride_s, stride_p, paged, page_size) == (12, 3, 1, True, 4) and arg is table
    assert write_ops.rope_arguments(None, None, fallback) == ((fallback, fallback, 0, 0), False)
    cos, sin = torch.zeros(1, 1, 10, 8), torch.zeros(1, 1, 10, 8)
    (c, s, stride_t, stride_d), rope = write_ops.rope_arguments(cos, sin, fallback)
    assert c is cos and s is sin and (stride_t, stride_d, rope) == (8, 1, True)


@cpu
def test_the_launch_needs_triton(monkeypatch):
    monkeypatch.setattr(write_ops, "HAS_TRITON", False)
    k, ids = torch.zeros(1, 1, 2, 8), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError) as raised:
        write_ops.launch_ring_write_triton(k, k, torch.zeros(2, 2, 1, 4, 8), ids, ids, ids, ids, 2)
    assert str(raised.value) == "ring_write: the Triton kernel needs the `triton` package"


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=600)


def _packed(x: torch.Tensor) -> torch.Tensor:
    B, heads, T, D = x.shape
    return x.transpose(0, 1).reshape(1, heads, B * T, D)


@cpu
@needs_interpreter
@pytest.mark.parametrize("capacity,T", [(8, 1), (8, 5), (8, 20), (13, 40)])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_write_kernel_interpreted_equals_the_reference(capacity, T, rope, paged):
    """Rows packed full (row ``b`` from ``b x T``), at every phase of the ring (empty, wrapped, past 2**31 tokens,
    a chunk longer than the ring, a padding row with a junk slot id): the write kernel's rings bitwise the
    reference's, keys rotated by the tables as ``apply_rope`` rotates them."""
    gen = torch.Generator().manual_seed(capacity * T)
    heads, Dh = 2, 16
    offsets = torch.tensor([0, 3, capacity - 1, 4 * capacity + 3, 3 * 2**31 + 5, 0])
    written = torch.tensor([T, max(T - 1, 0), 1, T, min(T, 2), 0])
    slot_ids = torch.tensor([4, 0, 2, 1, 3, 99])
    k, v = (torch.randn(6, heads, T, Dh, generator=gen) for _ in range(2))
    tables = rope_tables(offsets, T, Dh, 10000.0) if rope else (None, None)
    pages = 2 if capacity % 2 == 0 else 1  # pages per ring, of capacity / pages cells
    table = torch.randperm(12, generator=gen)[: 5 * pages].view(5, pages) if paged else None
    ring = torch.randn(2, 12 if paged else 5, heads, capacity // pages if paged else capacity, Dh, generator=gen)
    before, want = ring.clone(), ring.clone()
    write_ops.ring_write_reference(k, v, want, slot_ids, offsets, written, *tables, page_table=table)
    packed_tables = [None if t is None else _packed(t) for t in tables]
    starts = torch.arange(6) * T
    write_ops.launch_ring_write_triton(
        _packed(k), _packed(v), ring, slot_ids, offsets, written, starts, T, *packed_tables, page_table=table
    )
    assert torch.equal(ring, want) and not torch.equal(ring, before)
