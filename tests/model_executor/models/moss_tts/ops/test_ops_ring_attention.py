# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.ring_attention``: the attention kernel's launch table, its launch's refusals, and the
grid reference the packed op's reference builds on. The kernel itself is tested through the op that launches it
and through its launch, in ``test_ops_ring_attention_packed.py``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.ops import commit as commit_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention as ring_ops
from vllm_omni_moss.model_executor.models.moss_tts.ops.ring_reference import attend_gathered_rows
from vllm_omni_moss.model_executor.models.moss_tts.step_metadata import apply_rope, build_ring_metadata, rope_tables

cpu = pytest.mark.cpu


@cpu
def test_launch_configuration_follows_the_step_size_and_refuses_unknown_keys():
    pick = ring_ops.attention_launch_config
    cases = [(1, 16, 2), (16, 16, 2), (17, 32, 3), (32, 32, 3), (33, 64, 3), (64, 64, 3), (65, 128, 3), (480, 128, 3)]
    for tokens, block_q, stages in cases:
        expected = dict(block_q=block_q, block_k=64, num_warps=4, num_stages=stages, pv="low", fused_write=tokens <= 32)
        assert pick(tokens, torch.bfloat16) == expected, tokens
        assert pick(tokens, torch.bfloat16, row_heads=128 * 12) == expected, tokens
        assert pick(tokens, torch.float16)["pv"] == "low"
    # Fewer than 256 programs of 128 queries: 64-query blocks (one row of 12 heads at 480 tokens: 48).
    assert pick(480, torch.bfloat16, row_heads=12)["block_q"] == 64
    assert pick(120, torch.bfloat16, row_heads=16 * 12)["block_q"] == 64  # 192 programs
    assert pick(120, torch.bfloat16, row_heads=32 * 12)["block_q"] == 128  # 384
    assert pick(240, torch.bfloat16, row_heads=11 * 12)["block_q"] == 128  # 264
    assert pick(15, torch.float32) == dict(
        block_q=16, block_k=64, num_warps=4, num_stages=2, pv="ieee", fused_write=True
    )
    assert pick(480, torch.float32)["block_q"] == 64 and not pick(480, torch.float32)["fused_write"]
    assert ring_ops._launch_config(30, torch.bfloat16, {"num_warps": 8})["num_warps"] == 8
    assert ring_ops._launch_config(480, torch.bfloat16, {"fused_write": True})["fused_write"] is True
    with pytest.raises(ValueError) as raised:
        ring_ops._launch_config(30, torch.bfloat16, {"blockq": 16})
    assert str(raised.value) == (
        "ring_attention: unknown launch configuration keys ['blockq']; expected some of "
        "('block_q', 'block_k', 'num_warps', 'num_stages', 'pv', 'fused_write')"
    )


def _packed_step():
    """Two packed rows of up to 3 tokens: ``(q, k, v, ring, slot_ids, offsets, valid_tokens, token_start, T)``."""
    q = torch.zeros(1, 2, 6, 16)
    ids = torch.tensor([0, 1])
    return q, q, q, torch.zeros(2, 3, 2, 5, 16), ids, ids, ids, torch.tensor([0, 3]), 3


@cpu
def test_the_launch_needs_triton(monkeypatch):
    monkeypatch.setattr(ring_ops, "HAS_TRITON", False)
    with pytest.raises(RuntimeError) as raised:
        ring_ops.launch_ring_attention_triton(*_packed_step(), "exact", write=True)
    assert str(raised.value) == "ring_attention: the Triton kernel needs the `triton` package"


@cpu
@pytest.mark.skipif(not ring_ops.HAS_TRITON, reason="triton not installed")
def test_the_launch_refuses_unknown_tuning_keys_before_it_launches():
    step = _packed_step()
    ring = step[3]
    with pytest.raises(ValueError, match=r"^ring_attention: unknown launch configuration keys \['warps'\]"):
        ring_ops.launch_ring_attention_triton(*step, "upstream", write=True, tuning={"warps": 8})
    assert not ring.any()


@cpu
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
@pytest.mark.parametrize("rope", [False, True])
def test_reference_is_the_reference_path_with_padding_queries_zeroed(ring_semantics, rope):
    """:func:`ring_attention_write_reference` on a grid step (a padding row on a junk slot id, a row longer than
    the ring, a wrapped row, RoPE given as tables or applied before): bitwise the reference path's outputs at
    valid queries (gather, ``attend_gathered_rows``, ``commit_ring``), zeros elsewhere, and bitwise its rings."""
    gen = torch.Generator().manual_seed(21)
    capacity, heads, T, Dh = 5, 2, 7, 16
    ring = torch.randn(2, 4, heads, capacity, Dh, generator=gen)
    q, k, v = (torch.randn(3, heads, T, Dh, generator=gen) for _ in range(3))
    slot_ids, routed = torch.tensor([2, 0, 99]), torch.tensor([2, 0, 3])
    offsets, written = torch.tensor([3, 12, 0]), torch.tensor([7, 4, 0])
    tables = rope_tables(offsets, T, Dh, 10000.0) if rope else (None, None)
    work = ring.clone()
    got = ring_ops.ring_attention_write_reference(q, k, v, work, slot_ids, offsets, written, ring_semantics, *tables)
    if rope:
        q, k = apply_rope(q, *tables), apply_rope(k, *tables)
    rows = ring.index_select(1, routed)
    meta = build_ring_metadata(ring_ops._Window(capacity, Dh), ring_semantics, offsets, written, T)
    want = attend_gathered_rows(ring_semantics, rows, meta, q, k, v).transpose(1, 2)  # (B, T, H, Dh)
    commit_ops.commit_ring(rows, ring, routed, offsets, written, T)
    valid = torch.arange(T) < written.view(-1, 1)
    assert got.shape == (3, T, heads, Dh)
    assert torch.equal(got[valid], want[valid]) and not got[~valid].any()
    assert torch.equal(work, ring)
