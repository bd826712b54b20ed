# SPDX-License-Identifier: Apache-2.0
"""Offsets of a pool's slots (state/offsets.py): one frame counter per slot, or upstream's per-layer table."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.state.offsets import FrameCounters, OffsetTable, offset_table_rows

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

CPU = torch.device("cpu")


def test_frame_counters_give_every_layer_frames_times_tokens_per_frame(ring_decoder):
    """Ring codec: two groups of 3 layers, 1 and 2 tokens per frame."""
    counters = FrameCounters(ring_decoder.config)
    assert counters.tensors() == []
    counters.allocate(3, CPU)
    assert counters.frames_decoded.dtype == torch.int64 and counters.frames_decoded.tolist() == [0, 0, 0]
    counters.frames_decoded[1] = 4
    column = counters.column(1)
    assert column.tolist() == [4]
    assert counters.layer_offsets(column).tolist() == [4, 4, 4, 8, 8, 8]
    column[0] = 9  # a copy
    assert counters.frames_decoded.tolist() == [0, 4, 0]
    counters.write_column(2, column)
    assert counters.frames_decoded.tolist() == [0, 4, 9]
    counters.reset(torch.tensor([2]))
    assert counters.frames_decoded.tolist() == [0, 4, 0]
    assert counters.tensors() == [counters.frames_decoded]
    counters.drop()
    assert counters.tensors() == [] and counters.frames_decoded is None


def test_the_v2_offset_table_keeps_two_rows_per_layer_and_one_per_group(ring_decoder):
    config = ring_decoder.config
    table = OffsetTable(config)
    assert offset_table_rows(config) == 14  # 2 groups x (3 layers x 2 + 1)
    assert table.layer_rows == [(0, 1), (2, 3), (4, 5), (7, 8), (9, 10), (11, 12)]
    assert table.group_rows == {2: 6, 5: 13}
    table.allocate(2, CPU)
    assert tuple(table.offset_table.shape) == (14, 2)
    column = torch.arange(14, dtype=torch.long) + 100
    table.write_column(1, column)
    assert table.layer_offsets(table.column(1)).tolist() == [100, 102, 104, 107, 109, 111]  # the attention rows
    assert table.column(0).tolist() == [0] * 14
    table.reset(torch.tensor([1]))
    assert not table.offset_table.any()
    table.drop()
    assert table.tensors() == []


def test_the_v1_offset_table_keeps_one_row_per_layer(ring_decoder_v1):
    config = ring_decoder_v1.config
    table = OffsetTable(config)
    assert offset_table_rows(config) == len(table.layer_rows) == sum(g.num_layers for g in config.groups)
    assert table.layer_rows == [(r, r) for r in range(len(table.layer_rows))] and table.group_rows == {}
    table.allocate(3, CPU)
    table.write_column(2, torch.arange(len(table.layer_rows), dtype=torch.long) * 3)
    assert table.layer_offsets(table.column(2)).tolist() == [3 * r for r in range(len(table.layer_rows))]
    table.reset(torch.tensor([0, 2]))
    assert not table.offset_table.any()
