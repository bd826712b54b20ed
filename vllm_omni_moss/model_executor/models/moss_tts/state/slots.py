# SPDX-License-Identifier: Apache-2.0
"""Slot ids of a pool: which are free and which are in use (a stream's state lives in its slot)."""

from __future__ import annotations

from ..checks import check_count

__all__ = ["MAX_CONTEXT_FRAMES", "SlotAllocator"]

#: Most frames of context a reservation may name: 2**40 frames (about 2,800 years at 12.5 frames/s) keeps
#: every page count a machine integer; a larger value is a caller's error, not a stream.
MAX_CONTEXT_FRAMES = 1 << 40


class SlotAllocator:
    """The live slot ids ``0..capacity-1`` of a pool: a LIFO free list and the set in use.

    LIFO: the slot released last is acquired next, while its memory is warm. A fresh allocator hands out
    ``0, 1, 2, ...``. Extra slots a pool keeps beyond the live ones (the null slot, scratch slots) are
    never here.

    Args:
        capacity: live slots (``>= 0``; 0 for a closed pool).
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    def __contains__(self, slot) -> bool:
        return slot in self._in_use

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._in_use)

    def acquire(self) -> int:
        """A free slot id, now in use.

        Raises:
            RuntimeError: every live slot is in use.
        """
        if not self._free:
            raise RuntimeError(f"no free decoder state slot: all {self.capacity} live slots are in use")
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def check_release(self, ids: list[int]) -> None:
        """Check that ``ids`` may be released together: live ids, each in use, none twice.

        Raises:
            ValueError: naming the first id that is not a live slot id or not in use, or the repeated ids.
        """
        for i in ids:
            if not 0 <= i < self.capacity:
                raise ValueError(f"slot id {i} is not a live slot id (0..{self.capacity - 1})")
            if i not in self._in_use:
                raise ValueError(f"slot {i} is not in use (released twice?)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"slot ids released twice in one call: {sorted({i for i in ids if ids.count(i) > 1})}")

    def release(self, ids: list[int]) -> None:
        """Return ``ids`` (checked by :meth:`check_release`) to the free list, the last one on top."""
        self._in_use.difference_update(ids)
        self._free.extend(ids)

    def check_frames(self, frames_by_slot, op: str) -> dict[int, int]:
        """``frames_by_slot`` (slot in use -> frames of context), checked.

        Raises:
            TypeError: ``frames_by_slot`` is not a dict.
            ValueError: a slot that is not in use, or frames that are not an integer in
                ``0..MAX_CONTEXT_FRAMES`` (both named).
        """
        if not isinstance(frames_by_slot, dict):
            raise TypeError(f"{op} takes a dict of slot -> frames, got {type(frames_by_slot).__name__}")
        self.in_use_ids(frames_by_slot, op)
        for slot, frames in frames_by_slot.items():
            check_count(frames, f"{op}: the frames of slot {slot}")
            if frames > MAX_CONTEXT_FRAMES:
                raise ValueError(f"{op}: the frames of slot {slot} must be at most {MAX_CONTEXT_FRAMES}, got {frames}")
        return frames_by_slot

    def in_use_ids(self, ids, op: str) -> list[int]:
        """``ids`` as ints, each a slot in use.

        Raises:
            ValueError: ``"{op}: slot ... is not in use (...)"`` naming the first that is not.
        """
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i not in self._in_use:
                raise ValueError(f"{op}: slot {i!r} is not in use (0..{self.capacity - 1}, acquired and not released)")
            out.append(i)
        return out
