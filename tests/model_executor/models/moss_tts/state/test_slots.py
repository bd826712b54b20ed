# SPDX-License-Identifier: Apache-2.0
"""Slot ids of a pool (state/slots.py): the LIFO free list, the slots in use, and the checks of a release or a
reservation."""

from __future__ import annotations

import pytest

from vllm_omni_moss.model_executor.models.moss_tts.state.slots import MAX_CONTEXT_FRAMES, SlotAllocator

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_a_fresh_allocator_hands_out_ids_in_order_and_the_last_released_comes_back_first():
    slots = SlotAllocator(4)
    assert slots.free_count == 4 and len(slots) == 0 and slots.in_use == frozenset()
    assert [slots.acquire() for _ in range(3)] == [0, 1, 2]
    assert slots.in_use == {0, 1, 2} and len(slots) == 3 and slots.free_count == 1
    assert 1 in slots and 3 not in slots
    slots.release([0, 2])  # the last one of a release is on top of the free list
    assert slots.in_use == {1} and slots.free_count == 3
    assert [slots.acquire() for _ in range(3)] == [2, 0, 3]


@pytest.mark.parametrize("capacity", [0, 2])
def test_acquire_from_a_full_allocator_names_its_capacity(capacity):
    slots = SlotAllocator(capacity)
    for _ in range(capacity):
        slots.acquire()
    with pytest.raises(RuntimeError, match=rf"^no free decoder state slot: all {capacity} live slots are in use$"):
        slots.acquire()


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([2], r"^slot id 2 is not a live slot id \(0..1\)$"),
        ([0, -1], r"^slot id -1 is not a live slot id \(0..1\)$"),
        ([1], r"^slot 1 is not in use \(released twice\?\)$"),
        ([0, 0], r"^slot ids released twice in one call: \[0\]$"),
    ],
)
def test_check_release_names_the_first_bad_id_and_releases_nothing(ids, message):
    slots = SlotAllocator(2)
    slots.acquire()
    with pytest.raises(ValueError, match=message):
        slots.check_release(ids)
    assert slots.in_use == {0} and slots.free_count == 1


def test_check_frames_bounds_the_context_and_takes_slots_in_use_only():
    slots = SlotAllocator(2)
    slot = slots.acquire()
    assert MAX_CONTEXT_FRAMES == 2**40
    frames = {slot: MAX_CONTEXT_FRAMES}
    assert slots.check_frames(frames, "reserve") is frames
    with pytest.raises(ValueError, match=rf"^reserve: the frames of slot 0 must be at most {2**40}, got {2**40 + 1}$"):
        slots.check_frames({slot: MAX_CONTEXT_FRAMES + 1}, "reserve")
    with pytest.raises(TypeError, match=r"^reserve takes a dict of slot -> frames, got tuple$"):
        slots.check_frames(((slot, 3),), "reserve")
    with pytest.raises(ValueError, match=r"^reserve: slot 1 is not in use \(0..1, acquired and not released\)$"):
        slots.check_frames({1: 3}, "reserve")


def test_in_use_ids_returns_ints_and_refuses_bools_and_other_types():
    slots = SlotAllocator(2)
    slots.acquire()
    slots.acquire()
    assert slots.in_use_ids([1, 0], "op") == [1, 0]
    for bad in (True, 1.0, "1", 2):
        with pytest.raises(ValueError, match=rf"^op: slot {bad!r} is not in use \(0..1, acquired and not released\)$"):
            slots.in_use_ids([0, bad], "op")
