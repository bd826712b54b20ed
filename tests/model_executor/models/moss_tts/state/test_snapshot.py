# SPDX-License-Identifier: Apache-2.0
"""One slot's state on the host (state/snapshot.py): its geometry, the cells in use, and the checks a restore
makes before it changes anything."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import acquire_all as _acquire_all
from moss_codecs import make_state_pool
from moss_codecs import slot_bits as _slot_bits
from moss_codecs import step_every_row as _decode

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder
from vllm_omni_moss.model_executor.models.moss_tts.state.snapshot import cells_in_use, check_slot_state, ring_geometry

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


# --------------------------------------------------------------------------------------------- restore checks


@pytest.mark.parametrize(
    "make_target,message",
    [
        (lambda d: make_state_pool(d, "legacy"), r"the state's pool kind is 'compact'; this pool's is 'legacy'"),
        (
            lambda d: make_state_pool(d, dtype=torch.float64),
            r"the state's ring dtype is torch.float32; this pool's is torch.float64",
        ),
        (
            lambda d: make_state_pool(d, ring_semantics="exact"),
            r"the state's ring semantics is 'upstream'; this pool's is 'exact'",
        ),
    ],
)
def test_restore_refuses_a_state_of_another_pool_and_changes_nothing(make_target, message, ring_decoder):
    source = make_state_pool(ring_decoder)
    source.initialize(2)
    _acquire_all(source)  # restore_slot writes slots in use only
    _decode(source, [0], 3, seed=2)
    state = source.save_slot(0)
    target = make_target(ring_decoder)
    target.initialize(2)
    _acquire_all(target)  # restore_slot writes slots in use only
    for layer, ring in enumerate(target.rings):  # a slot holding something: the refusal must leave it
        ring[:, 1].fill_(0.5 + layer)
    target.offset_tensors()[0][..., 1] = 7
    before = _slot_bits(target, 1)
    with pytest.raises(ValueError, match=f"restore_slot: {message}"):
        target.restore_slot(1, state)
    after = _slot_bits(target, 1)
    assert all(torch.equal(x, y) for x, y in zip(before[0] + before[1], after[0] + after[1]))


def test_restore_refuses_another_geometry_and_tampered_states(ring_decoder):
    import dataclasses

    source = make_state_pool(ring_decoder)
    source.initialize(2)
    _acquire_all(source)  # restore_slot writes slots in use only
    _decode(source, [0], 3, seed=4)
    state = source.save_slot(0)
    tiny = make_state_pool(CodecDecoder(preset_config("tiny-v2")))
    tiny.initialize(1)
    _acquire_all(tiny)  # restore_slot writes slots in use only
    with pytest.raises(
        ValueError, match=r"restore_slot: the state's codec geometry .* is \(\(3, 2, 5, 64, 1\), \(3, 2, 10, 64, 2\)\)"
    ):
        tiny.restore_slot(0, state)
    pool = make_state_pool(ring_decoder)
    pool.initialize(2)
    _acquire_all(pool)  # restore_slot writes slots in use only
    cases = [
        (dataclasses.replace(state, offsets=torch.tensor([-1])), r"state offsets must be >= 0, got \[-1\]"),
        (
            dataclasses.replace(state, offsets=torch.tensor([2])),
            r"layer 0 cells must be \(2, 2, 2, 64\) torch.float32 for offset 2",
        ),
        (dataclasses.replace(state, offsets=torch.tensor([3.0])), r"state offsets must be int64 of shape \(1,\)"),
        (dataclasses.replace(state, cells=state.cells[:-1]), r"the state has 5 layers of cells; the codec has 6"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=f"restore_slot: {message}"):
            pool.restore_slot(0, bad)
        assert all(not ring[:, 0].any() for ring in pool.rings) and int(pool.frames_decoded[0]) == 0
    with pytest.raises(TypeError, match="restore_slot: state must be a SlotState"):
        pool.restore_slot(0, {"cells": []})
    for op in (pool.save_slot, lambda s: pool.restore_slot(s, state)):
        with pytest.raises(ValueError, match=r"slot 2 is not a live slot id \(0..1\)"):
            op(2)


# ------------------------------------------------------------------------------------------ geometry and cells


def test_ring_geometry_lists_each_groups_layers_heads_capacity_width_and_rate(ring_decoder):
    assert ring_geometry(ring_decoder.config) == ((3, 2, 5, 64, 1), (3, 2, 10, 64, 2))


@pytest.mark.parametrize(
    ("offset", "capacity", "cells"),
    [
        (0, 5, []),
        (3, 5, [0, 1, 2]),
        (5, 5, [0, 1, 2, 3, 4]),
        (7, 5, [2, 3, 4, 0, 1]),
        (12, 10, [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]),
    ],
)
def test_cells_in_use_are_the_latest_positions_oldest_first(offset, capacity, cells):
    got = cells_in_use(offset, capacity)
    assert got.dtype == torch.int64 and got.tolist() == cells


def test_a_saved_state_holds_the_cells_in_use_of_each_layer_bit_for_bit(ring_decoder):
    """3 frames: 3 of 5 cells in use in the first group's layers, 6 of 10 in the second's."""
    pool = make_state_pool(ring_decoder)
    pool.initialize(2)
    _acquire_all(pool)
    _decode(pool, [0, 1], 3, seed=7)
    state = pool.save_slot(1)
    assert (state.pool_kind, state.dtype, state.ring_semantics) == ("compact", torch.float32, "upstream")
    assert state.geometry == ring_geometry(ring_decoder.config) and state.offsets.tolist() == [3]
    assert [tuple(c.shape) for c in state.cells] == [(2, 2, 3, 64)] * 3 + [(2, 2, 6, 64)] * 3
    for layer, (saved, ring) in enumerate(zip(state.cells, pool.rings)):
        assert torch.equal(saved, ring[:, 1, :, : saved.shape[2]]), layer
    assert state.nbytes == 3 * (2 * 2 * 3 * 64 * 4) + 3 * (2 * 2 * 6 * 64 * 4) + 8


def test_a_restore_refuses_what_is_not_a_slot_state(ring_decoder):
    pool = make_state_pool(ring_decoder)
    pool.initialize(1)
    with pytest.raises(TypeError, match=r"^restore_slot: state must be a SlotState \(from save_slot\), got list$"):
        check_slot_state(pool, [])
