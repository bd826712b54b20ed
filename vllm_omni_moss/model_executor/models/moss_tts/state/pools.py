# SPDX-License-Identifier: Apache-2.0
"""The three pool kinds, each holding only its own policy, and the one table that picks them.

``LegacyDecoderStatePool`` (kind ``"legacy"``): vLLM-Omni 0.30.0's behaviour
    (``vllm_omni/model_executor/models/moss_tts/``): ``state_capacity + scratch`` slots (one scratch slot per
    graph padding row); per-layer attention offsets and ring end offsets plus per-group offsets in one
    ``(R, S)`` int64 table (:class:`~.offsets.OffsetTable`); every layer gathers its offsets, rebuilds its
    metadata, gathers the complete ring and writes the whole ring back for every row. The default for v1
    codecs; the baseline for v2.

``CompactDecoderStatePool`` (kind ``"compact"``): the default for v2 codecs. ``state_capacity + 1`` slots
    whatever scratch is asked for; slot ``state_capacity`` is the *null slot*: never acquired, all zeros
    forever, the target of every invalid row. Offsets are one frame counter per slot
    (:class:`~.offsets.FrameCounters`). Ring metadata and RoPE tables are built once per group per step;
    persistent writes touch only ring cells valid tokens wrote, only for rows that wrote (padding rows never
    write, not even to the null slot). Attention backend ``"sdpa"`` gathers rings and runs the legacy pool's
    reference computation (audio and live state bit-identical to it); ``"triton"`` reads rings in place
    (``ops/ring_attention.py``): the same keys per query and bitwise the same ring contents, its own
    arithmetic.

``PagedDecoderStatePool`` (kind ``"paged"``): the compact pool with each group's rings held in pages of a
    shared page pool (:class:`~.paged_rings.PagedRings`, sized by :class:`~.page_budget.PageBudget`): a
    stream holds pages only for the context it has reached. Same audio and logical state as the compact pool
    bit for bit; attention backend ``"triton"`` only.

Memory arithmetic: docs/memory.md.
"""

from __future__ import annotations

import torch

from ..checks import check_count
from .offsets import FrameCounters, OffsetTable
from .page_budget import PageBudget
from .paged_rings import PagedRings, PagesExhausted
from .pool import DecoderStatePool
from .rings import DenseRings
from .spec import StateSpec

__all__ = [
    "POOL_CLASSES",
    "CompactDecoderStatePool",
    "LegacyDecoderStatePool",
    "PagedDecoderStatePool",
    "build_pool",
]


def _check_padding_count(count) -> None:
    check_count(count, "padding row count", 0)


class LegacyDecoderStatePool(DecoderStatePool):
    """vLLM-Omni 0.30.0's pool: scratch slots for padding rows, per-layer offsets, whole-ring write-back.

    Offsets: ``offset_table`` ``(R, S)`` int64 in upstream's row layout (docs/memory.md).
    """

    kind = "legacy"

    def _make_store(self):
        return DenseRings(self.config, self.dtype, self.device)

    def _make_offsets(self):
        return OffsetTable(self.config)

    @property
    def offset_table(self) -> torch.Tensor | None:
        return self.offsets.offset_table

    def _scratch_capacity(self, requested: int) -> int:
        return requested

    def _resettable_limit(self) -> int:
        return self.num_slots

    def scratch_slots_for(self, padding_rows: int) -> int:
        # Padding rows write their whole ring back: each needs a scratch slot of its own.
        _check_padding_count(padding_rows)
        return padding_rows

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        self.require_initialized()
        _check_padding_count(count)
        if count > self.scratch_capacity:
            raise ValueError(f"{count} padding rows need {count} scratch slots; this pool has {self.scratch_capacity}")
        return torch.arange(self.state_capacity, self.state_capacity + count, device=self.device)

    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        return self.padding_slot_ids(count).tolist()

    def check_padding(self, padding_ids: list[int]) -> None:
        # Padding rows write their whole ring back: anywhere but a distinct scratch slot they would
        # overwrite a live stream or race with each other.
        for i in padding_ids:
            if not self.state_capacity <= i < self.num_slots:
                raise ValueError(
                    f"padding row slot id {i} is not a scratch slot ({self.state_capacity}..{self.num_slots - 1})"
                )
        dupes = sorted({i for i in padding_ids if padding_ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate scratch slot ids among padding rows: {dupes}")

    def route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        return slot_ids


class CompactDecoderStatePool(DecoderStatePool):
    """One slot per live stream plus a read-only null slot; shared group metadata; masked commits.

    Offsets: ``frames_decoded`` ``(S,)`` int64, code frames decoded per slot since reset; the token offset of
    group ``g`` is ``frames_decoded * tokens_per_frame[g]``.

    Raises:
        ValueError: a v1 codec (whose per-layer offsets the legacy pool keeps).
    """

    kind = "compact"

    def _make_store(self):
        return DenseRings(self.config, self.dtype, self.device)

    def _make_offsets(self):
        return FrameCounters(self.config)

    @property
    def frames_decoded(self) -> torch.Tensor | None:
        return self.offsets.frames_decoded

    @property
    def null_slot(self) -> int:
        """Id of the null slot (``state_capacity``): all zeros, never acquired, never written."""
        self.require_initialized()
        return self.state_capacity

    def _scratch_capacity(self, requested: int) -> int:
        return 1  # the null slot, whatever the caller asks for

    def _resettable_limit(self) -> int:
        return self.state_capacity  # the null slot is never written, not even by reset

    def scratch_slots_for(self, padding_rows: int) -> int:
        _check_padding_count(padding_rows)
        return 0  # every padding row reads the null slot, which always exists

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        _check_padding_count(count)
        return torch.full((count,), self.null_slot, dtype=torch.long, device=self.device)

    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        _check_padding_count(count)
        return []  # padding rows write nothing

    def route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        # Invalid rows read the null slot whatever id they carry (even out of range).
        return torch.where(valid_rows, slot_ids, self.state_capacity)


class PagedDecoderStatePool(CompactDecoderStatePool):
    """The compact pool with each group's rings held in pages of a shared page pool.

    The paging of its spec (:class:`~.spec.PagingSpec`) sizes the page pool: ``page_size`` tokens per page;
    ``page_fraction``, pages per group as a fraction of what ``state_capacity`` full rings need (``1.0``: never
    short of pages; smaller: a scheduler must :meth:`reserve` before each step); or ``state_budget_bytes``, the
    bytes of ring pages (the null pages included) the pool may hold, each group getting the pages its share of
    the budget pays for (the same fraction of full rings for every group, at most 1;
    :meth:`page_fraction_for_budget`), fixed at :meth:`initialize`. With ``expected_stream_frames`` the budget
    is split by the groups' fill instead: after one stream's full rings, each group gets pages in proportion to
    what a live stream of this many frames holds on average (:meth:`average_pages`; fast-filling groups get more
    of the budget). :attr:`page_fraction` then reports the pages' bytes as a fraction of full rings for every
    slot.

    Raises:
        ValueError: as :class:`~.pool.DecoderStatePool`. At :meth:`initialize`: a budget or fraction too small
            for one stream's full rings (the message names the minimum).
    """

    kind = "paged"

    def _configure(self) -> None:
        paging = self.spec.paging
        self.page_size = paging.page_size
        self.page_fraction = 1.0 if paging.page_fraction is None else paging.page_fraction
        self.state_budget_bytes = paging.state_budget_bytes
        self.expected_stream_frames = paging.expected_stream_frames
        self.budget = PageBudget(self.config, self.spec.dtype, self.page_size)

    def _make_store(self):
        # Late binding: page-table uploads go through whatever _ids_to_device is at call time.
        return PagedRings(self.budget, self.device, lambda ids: self._ids_to_device(ids))

    def _allocate(self) -> None:
        counts, self.page_fraction = self.budget.pages_for(self.spec.paging, self.state_capacity)
        self.store.allocate(self.num_slots, counts)

    @property
    def page_tables(self) -> list[torch.Tensor]:
        """Per group, ``(S, pages per ring)`` int64 page tables on the device (pending entries committed)."""
        self.store.commit()
        return self.store.page_tables

    def commit_page_tables(self) -> None:
        """Write the page-table entries that :meth:`reserve` allocated since the last commit to the device (one
        host-to-device copy; :meth:`.PagedRings.commit`)."""
        self.store.commit()

    def page_fraction_for_budget(self, budget_bytes: int, state_capacity: int) -> float:
        """:meth:`~.page_budget.PageBudget.fraction_for_budget` of this pool's geometry and dtype."""
        return self.budget.fraction_for_budget(budget_bytes, state_capacity)

    def average_pages(self, frames: int) -> list[float]:
        """:meth:`~.page_budget.PageBudget.average_pages` of this pool's geometry."""
        return self.budget.average_pages(frames)

    def offset_tensors(self) -> list[torch.Tensor]:
        # The page tables are persistent metadata too (graphs read them by address).
        return super().offset_tensors() + list(self.store.page_tables)

    def free_page_counts(self) -> list[int]:
        """Free pages per group."""
        self.require_initialized()
        return self.store.free_counts()

    def state_in_use_bytes(self) -> int:
        """Bytes of the pages the slots hold, plus the offsets and page tables."""
        return self.pages_in_use_bytes() + sum(t.numel() * t.element_size() for t in self.offset_tensors())

    def pages_in_use_bytes(self) -> int:
        """Bytes of the pages the slots hold (the state a compact pool would need for their contexts)."""
        self.require_initialized()
        return self.store.held_bytes()

    def frames_of(self, slots) -> list[int]:
        """Frames decoded by each of ``slots`` (one small device-to-host copy)."""
        slots = [int(s) for s in slots]
        return self.frames_decoded[torch.tensor(slots, device=self.device)].tolist() if slots else []

    def reserve(self, frames_by_slot: dict[int, int], strict: bool = False) -> bool:
        """Give every slot in use of ``frames_by_slot`` the pages for that many frames of context: True when
        done, False (nothing allocated) when a group lacks free pages. The pages are in the host's page tables
        at once and in the device's after :meth:`commit_page_tables`, which the step runner calls once where it
        stages a step's inputs and ``step.decode_batch`` calls before its step; a caller that runs
        ``step.decode_tensors`` itself must commit before it, or the step writes the null page.

        Raises:
            PagesExhausted: ``strict`` and a group lacks free pages (naming the group, the pages it needs and
                the slots); nothing is allocated then.
            TypeError, ValueError: as :meth:`.SlotAllocator.check_frames`.
        """
        self.require_initialized()
        self.slots.check_frames(frames_by_slot, "reserve")
        if strict:
            self._reserve_or_raise(frames_by_slot)
            return True
        plan = self.store.extra_by_slot(frames_by_slot)
        if self.store.short(plan) is not None:
            return False
        self.store.allocate_pages(plan)
        return True

    def _reserve_or_raise(self, targets: dict[int, int]) -> None:
        plan = self.store.extra_by_slot(targets)
        g = self.store.short(plan)
        if g is not None:
            raise PagesExhausted(
                f"group {g} needs {sum(plan[g].values())} more pages of {self.page_size} tokens for slots "
                f"{sorted(plan[g])}; {len(self.store.free[g])} are free"
            )
        self.store.allocate_pages(plan)

    def _restore(self, slot: int, state) -> None:
        # The slot keeps the pages it holds (a scheduler reserves them before it restores a stream): they are
        # zeroed with the slot's counter, then the state's context gets the pages it still lacks.
        self.store.zero_slot(slot)
        self.offsets.reset(self._ids_to_device(torch.tensor([slot], dtype=torch.long)))
        self.offsets.write_column(slot, state.offsets.to(self.device))
        self._reserve_or_raise({slot: int(state.offsets.reshape(-1)[0])})
        self._write_cells(slot, state)

    def restore_slot(self, slot: int, state) -> None:
        """:meth:`~.pool.DecoderStatePool.restore_slot` into a slot in use, allocating the pages the state's
        context needs.

        Raises:
            ValueError: as the base, or ``slot`` is not in use. Nothing changes then.
            PagesExhausted: a group lacks the pages for the state's context (counting the pages ``slot`` holds
                now, which the restore frees first). Nothing changes then.
        """
        from .snapshot import check_slot_state

        slot = self.slots.in_use_ids([self._live_slot(slot, "restore_slot")], "restore_slot")[0]
        check_slot_state(self, state)
        frames = int(state.offsets.reshape(-1)[0])
        free, held = self.store.free, self.store.host_tables
        short = [
            g
            for g, spec in enumerate(self.config.groups)
            if self.budget.pages_needed(spec, frames) > len(free[g]) + len(held[g][slot])
        ]
        if short:
            g = short[0]
            raise PagesExhausted(
                f"restore_slot: the state's {frames} frames need more pages than group {g} has free "
                f"({len(free[g])} free, {len(held[g][slot])} held by slot {slot})"
            )
        self._restore(slot, state)


#: The pool class of each kind: the one place a kind string is turned into behaviour.
POOL_CLASSES: dict[str, type[DecoderStatePool]] = {
    "compact": CompactDecoderStatePool,
    "legacy": LegacyDecoderStatePool,
    "paged": PagedDecoderStatePool,
}


def build_pool(decoder, spec: StateSpec) -> DecoderStatePool:
    """The pool of ``spec`` for ``decoder`` (not yet initialised): the one way a pool is built.

    Raises:
        TypeError: ``spec`` is not a :class:`~.spec.StateSpec`. ValueError, RuntimeError: as
            :meth:`~.spec.StateSpec.check_for`.
    """
    if not isinstance(spec, StateSpec):
        raise TypeError(f"build_pool needs a StateSpec, got {type(spec).__name__}")
    pool_class = POOL_CLASSES.get(spec.kind)
    if pool_class is None:  # a spec built by hand: check_for names the kind and the known ones
        spec.check_for(decoder)
    return pool_class(decoder, spec)
