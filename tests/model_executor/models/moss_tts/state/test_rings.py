# SPDX-License-Identifier: Apache-2.0
"""The ring tensors of a pool (state/rings.py): one zeroed tensor per group, one view per layer."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.state.rings import DenseRings, group_tensors

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_group_tensors_are_zeroed_and_every_layer_is_a_view_of_its_group(ring_decoder):
    config = ring_decoder.config
    groups, layers = group_tensors(config, [(2, 7), (3,)], torch.bfloat16, torch.device("cpu"))
    assert [tuple(g.shape) for g in groups] == [(3, 2, 7), (3, 3)]
    assert [tuple(r.shape) for r in layers] == [(2, 7)] * 3 + [(3,)] * 3
    assert all(g.dtype == torch.bfloat16 and not g.any() for g in groups)
    layers[4].fill_(1)
    assert groups[1].sum(dim=1).tolist() == [0, 3, 0]


def test_dense_rings_write_read_and_clear_one_slot(ring_decoder):
    """Ring codec: rings of 5 and 10 cells, 2 heads of 64 dims."""
    rings = DenseRings(ring_decoder.config, torch.float32, torch.device("cpu"))
    rings.allocate(3)
    assert [tuple(g.shape) for g in rings.groups] == [(3, 2, 3, 2, 5, 64), (3, 2, 3, 2, 10, 64)]
    assert len(rings.layers) == 6 and tuple(rings.layers[3].shape) == (2, 3, 2, 10, 64)
    values = torch.arange(2 * 2 * 3 * 64, dtype=torch.float32).reshape(2, 2, 3, 64) + 1
    cells = torch.tensor([9, 0, 4])
    for slot in (0, 1):
        rings.write_cells(3, slot, cells, values)
    assert torch.equal(rings.read_cells(3, 1, cells), values)
    assert torch.equal(rings.read_cells(3, 1, torch.tensor([4])), values[:, :, 2:3])
    assert not rings.read_cells(3, 1, torch.tensor([1, 2, 3, 5, 6, 7, 8])).any()
    assert not rings.layers[4].any() and not rings.layers[3][:, 2].any()  # other layers and slots
    rings.clear(torch.tensor([1]), [1])
    assert not rings.layers[3][:, 1].any() and torch.equal(rings.read_cells(3, 0, cells), values)
    rings.drop()
    assert rings.groups == [] and rings.layers == []
