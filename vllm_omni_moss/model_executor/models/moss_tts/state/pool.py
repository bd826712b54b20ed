# SPDX-License-Identifier: Apache-2.0
"""The decoder state pool: slots, rings and offsets of many live streams, composed.

A pool owns every persistent streaming tensor (the rings of :mod:`.rings` or :mod:`.paged_rings`, the
offsets of :mod:`.offsets`) and the slot lifecycle (:mod:`.slots`): :meth:`acquire` hands out a slot,
:meth:`release` resets it and returns it. It also owns its padding policy: the slot ids CUDA-graph padding
rows carry, how many scratch slots a graph's rows need, and which slots a graph must reset after running padding
rows. Callers never branch on the pool they hold: the variant is fixed by a :class:`~.spec.StateSpec`
and each subclass (:mod:`.pools`) holds only its own policy.

Steps are compact: row ``b`` decodes ``valid_frames[b]`` frames for slot ``slot_ids[b]`` when
``valid_rows[b]``; invalid rows are padding rows. Frames at or beyond a row's valid frames are padding
frames: they write no ring cell, advance no offset and no query sees them (``step_metadata.py``), so a
step of ``T`` frames leaves every row exactly as a step of its own length would. The pool is memory only:
the step that runs the decoder over it is ``step.py``, outside this package.

Every pool clears a slot's rings on :meth:`reset` as well as its offsets. Upstream only zeroes offsets,
which hides stale keys behind the mask, but SDPA still multiplies masked values by a zero weight, so a
non-finite value left by an earlier stream would turn into NaN audio for the next one.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..checks import check_count
from .slots import SlotAllocator
from .snapshot import SlotState, cells_in_use, check_slot_state, ring_geometry
from .spec import StateSpec, state_bytes_for

__all__ = ["DecoderStatePool"]


def as_ids(ids, name: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(ids)
    except (TypeError, RuntimeError, OverflowError, ValueError) as exc:
        raise ValueError(f"{name} must be a 1-D integer tensor or list of ints, got {ids!r}") from exc
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(t.shape)} dtype {t.dtype}")
    return t.long()


def ring_capacities(config) -> list[int]:
    """The ring capacity ``C`` of each attention layer, in layer order."""
    return [spec.ring_capacity for spec in config.groups for _ in range(spec.num_layers)]


def ids_to_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host int64 ``ids`` on ``device``: to CUDA through page-locked memory without a wait (a reset or a page
    allocation never waits for steps still running; the copy is ordered before the work that reads the ids), or
    with a wait when page-locked memory cannot be had."""
    if device.type == "cuda" and ids.device.type == "cpu":
        try:
            pinned = ids.pin_memory()
        except RuntimeError:
            return ids.to(device)
        return pinned.to(device, non_blocking=True)
    return ids.to(device)


class DecoderStatePool:
    """Interface shared by the legacy, compact and paged pools (:mod:`.pools`).

    Args:
        decoder: the weights (``CodecDecoder``); the pool never modifies them.
        spec: the resolved :class:`~.spec.StateSpec` of this class's kind (ring dtype, ring semantics, attention
            backend, paging); :func:`~.pools.build_pool` picks the class of a spec's kind.

    Raises:
        ValueError: a ``spec`` of another kind.
    """

    kind: ClassVar[str] = ""

    def __init__(self, decoder, spec: StateSpec):
        if not isinstance(spec, StateSpec):
            raise TypeError(f"{type(self).__name__} needs a StateSpec, got {type(spec).__name__}")
        if spec.kind != self.kind:
            raise ValueError(f"{type(self).__name__} holds {self.kind!r} pools, the spec is for {spec.kind!r}")
        spec.check_for(decoder)
        self.decoder, self.config, self.device, self.spec = decoder, decoder.config, decoder.device, spec
        self.slots = SlotAllocator()
        self.state_capacity = self.scratch_capacity = self.num_slots = 0
        self._configure()
        self.store = self._make_store()
        self.offsets = self._make_offsets()

    # ----------------------------------------------------------------- the spec
    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def ring_semantics(self) -> str:
        return self.spec.ring_semantics

    @property
    def attention_backend(self) -> str:
        return self.spec.attention_backend

    @property
    def rings(self) -> list[torch.Tensor]:
        """Every attention layer's ring, in layer order (views of one tensor per group)."""
        return self.store.layers

    # ----------------------------------------------------------------- memory
    @property
    def initialized(self) -> bool:
        return bool(self.store.layers)

    def initialize(self, state_capacity: int, scratch_capacity: int = 0) -> None:
        """Allocate state for ``state_capacity`` live slots (ids ``0..state_capacity-1``).

        ``scratch_capacity``: the scratch the caller's graph padding needs (:meth:`scratch_slots_for`).

        Raises:
            ValueError: ``state_capacity < 1`` or ``scratch_capacity < 0``; a paged pool's budget or fraction
                too small for one stream.
            RuntimeError: already initialised (call :meth:`close` first), or out of memory (the message names
                the bytes; the pool is left closed).
        """
        if self.initialized:
            raise RuntimeError(f"{type(self).__name__} is already initialised; close() it before re-initialising")
        check_count(state_capacity, "state_capacity", 1)
        check_count(scratch_capacity, "scratch_capacity", 0)
        self.state_capacity = state_capacity
        self.scratch_capacity = self._scratch_capacity(scratch_capacity)
        self.num_slots = state_capacity + self.scratch_capacity
        try:
            self._allocate()
            self.offsets.allocate(self.num_slots, self.device)
        except (RuntimeError, MemoryError) as exc:  # out of memory: leave the pool closed
            element = torch.empty((), dtype=self.dtype).element_size()
            need = state_bytes_for(self.config, self.num_slots, self.kind, element)
            self.close()
            raise RuntimeError(
                f"cannot allocate decoder state for {state_capacity} live streams ({need} bytes on {self.device}): {exc}"
            ) from exc
        self.slots = SlotAllocator(state_capacity)

    def close(self) -> None:
        """Drop all state and slots in use. The pool can be initialised again, with another capacity."""
        self.store.drop()
        self.state_capacity = self.scratch_capacity = self.num_slots = 0
        self.slots = SlotAllocator()
        self.offsets.drop()

    def offset_tensors(self) -> list[torch.Tensor]:
        """The persistent offset tensors (for byte accounting and address checks)."""
        return self.offsets.tensors()

    def state_bytes(self) -> int:
        """Bytes of persistent state actually allocated (rings plus offsets)."""
        return sum(t.numel() * t.element_size() for t in self.rings + self.offset_tensors())

    def state_in_use_bytes(self) -> int:
        """Bytes of state the live streams need now: all of it for unpaged pools (every slot holds full
        rings from its first frame); a paged pool counts the pages its slots hold."""
        return self.state_bytes()

    # ----------------------------------------------------------------- slot lifecycle
    @property
    def free_slot_count(self) -> int:
        """Live slots that can still be acquired."""
        return self.slots.free_count

    @property
    def slots_in_use(self) -> frozenset[int]:
        """Slot ids acquired and not released."""
        return self.slots.in_use

    def acquire(self) -> int:
        """Acquire a free slot and return its id. Its state is all zeros (slots start zeroed and are reset on
        release; steps do not check slots, and a session steps only slots in use).

        Raises:
            RuntimeError: the pool is not initialised, or every live slot is in use.
        """
        self.require_initialized()
        return self.slots.acquire()

    def release(self, slot_ids) -> None:
        """Reset the slots in use ``slot_ids`` and return them to the free list.

        Raises:
            ValueError: an id that is not a live slot id, a slot that is not in use (a double release), or an
                id given twice. Nothing is released then.
            RuntimeError: the pool is not initialised.
        """
        self.require_initialized()
        ids = as_ids(slot_ids, "slot_ids").tolist()
        self.slots.check_release(ids)
        if ids:
            self.reset(ids)
        self.slots.release(ids)

    def reset(self, slot_ids) -> None:
        """Forget the streams in ``slot_ids``: offsets to 0 and rings cleared. Slots in use stay in use.

        Raises:
            ValueError: an id outside the resettable range (named in the message).
            RuntimeError: the pool is not initialised.
        """
        self.require_initialized()
        ids = as_ids(slot_ids, "slot_ids")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            limit = self._resettable_limit()
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise ValueError(f"slot id {bad} cannot be reset; resettable slot ids are 0..{limit - 1}")
        host_ids = ids.tolist()
        ids = self._ids_to_device(ids)
        self.store.clear(ids, host_ids)
        self.offsets.reset(ids)

    def reserve(self, frames_by_slot: dict[int, int], strict: bool = False) -> bool:
        """The one question a scheduler asks: can every slot of ``frames_by_slot`` (slot in use -> the frames
        it will have decoded) hold that much context? Unpaged pools hold full rings: always. A paged pool
        allocates the pages it lacks and answers True, or allocates nothing and answers False (``strict``:
        raises ``PagesExhausted`` naming the group instead). Raises as :meth:`.SlotAllocator.check_frames`."""
        self.require_initialized()
        return self.slots.check_frames(frames_by_slot, "reserve") is not None

    def commit_page_tables(self) -> None:  # noqa: B027 - optional hook
        """Before a step: the device's page tables get what :meth:`reserve` allocated (paged pools only)."""

    # ----------------------------------------------------------------- inspection
    def slot_state(self, slot: int) -> dict[str, object]:
        """Copy of one slot's state: ``rings`` (per layer ``(2, H, C, Dh)``) and ``layer_offsets`` (``(L,)``
        int64 token offset of each attention layer)."""
        self.require_initialized()
        rings = [
            self.store.read_cells(layer, slot, torch.arange(capacity, device=self.device))
            for layer, capacity in enumerate(ring_capacities(self.config))
        ]
        return {"rings": rings, "layer_offsets": self.offsets.layer_offsets(self.offsets.column(slot).cpu())}

    # ----------------------------------------------------------------- save / restore
    def save_slot(self, slot: int) -> SlotState:
        """Copy live slot ``slot``'s state to the host: its offsets and only the ring cells in use.

        The slot is unchanged. A round trip through :meth:`restore_slot` (into this pool or another pool of
        the same kind, codec geometry, ring dtype and ring semantics, on any device) gives back the slot's
        rings and offsets bit for bit, so decoding continues exactly as without it.

        Raises:
            ValueError: ``slot`` is not a live slot id.
            RuntimeError: the pool is not initialised.
        """
        slot = self._live_slot(slot, "save_slot")
        column = self.offsets.column(slot).cpu()
        cells = []
        for layer, (capacity, offset) in enumerate(
            zip(ring_capacities(self.config), self.offsets.layer_offsets(column).tolist())
        ):
            cells.append(self.store.read_cells(layer, slot, cells_in_use(offset, capacity).to(self.device)).cpu())
        return SlotState(self.kind, ring_geometry(self.config), self.dtype, self.ring_semantics, column, tuple(cells))

    def restore_slot(self, slot: int, state: SlotState) -> None:
        """Make slot ``slot``, in use (acquire it first), hold ``state`` (from :meth:`save_slot`): reset it,
        then write the saved cells and offsets. Other slots are unchanged.

        Raises:
            TypeError: ``state`` is not a :class:`SlotState`.
            ValueError: ``slot`` is not a slot in use, or ``state`` comes from another pool kind, codec
                geometry, ring dtype or ring semantics, or its tensors do not match its offsets (the message
                names the mismatch). Nothing changes then.
            RuntimeError: the pool is not initialised.
        """
        slot = self.slots.in_use_ids([self._live_slot(slot, "restore_slot")], "restore_slot")[0]
        check_slot_state(self, state)
        self._restore(slot, state)

    def _restore(self, slot: int, state: SlotState) -> None:
        self.reset([slot])
        self.offsets.write_column(slot, state.offsets.to(self.device))
        self._write_cells(slot, state)

    def _write_cells(self, slot: int, state: SlotState) -> None:
        offsets = self.offsets.layer_offsets(state.offsets).tolist()
        for layer, (capacity, offset, saved) in enumerate(zip(ring_capacities(self.config), offsets, state.cells)):
            cells = cells_in_use(offset, capacity).to(self.device)
            self.store.write_cells(layer, slot, cells, saved.to(self.device))

    # ----------------------------------------------------------------- helpers
    def _live_slot(self, slot, op: str) -> int:
        self.require_initialized()
        if isinstance(slot, torch.Tensor) and slot.numel() == 1 and not slot.dtype.is_floating_point:
            slot = int(slot)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.state_capacity:
            raise ValueError(f"{op}: slot {slot!r} is not a live slot id (0..{self.state_capacity - 1})")
        return slot

    def require_initialized(self) -> None:
        """Raises RuntimeError (naming the pool class) unless :meth:`initialize` has allocated the state."""
        if not self.initialized:
            raise RuntimeError(f"{type(self).__name__} is not initialised; call initialize(state_capacity) first")

    def _ids_to_device(self, ids: torch.Tensor) -> torch.Tensor:
        return ids_to_device(ids, self.device)

    # ----------------------------------------------------------------- each kind's policy (.pools)
    def _configure(self) -> None:  # noqa: B027 - optional hook
        """What the kind reads from its spec before its store is made (a paged pool: its page arithmetic)."""

    def _make_store(self):
        raise NotImplementedError

    def _make_offsets(self):
        raise NotImplementedError

    def _allocate(self) -> None:
        self.store.allocate(self.num_slots)

    def _scratch_capacity(self, requested: int) -> int:
        raise NotImplementedError

    def _resettable_limit(self) -> int:
        raise NotImplementedError

    def route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        """The slot each row reads and writes: its own id for valid rows; padding rows as the kind says."""
        raise NotImplementedError

    def check_padding(self, padding_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Check the slot ids of invalid rows; the compact pool accepts any (they read the null slot)."""

    def scratch_slots_for(self, padding_rows: int) -> int:
        """Scratch slots :meth:`initialize` must provide so ``padding_rows`` padding rows can run."""
        raise NotImplementedError

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        """``(count,)`` int64 slot ids for ``count`` graph padding rows.

        Raises:
            ValueError: ``count`` is not an integer >= 0, or the pool lacks the scratch it needs.
        """
        raise NotImplementedError

    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        """Slot ids a graph must :meth:`reset` after running ``count`` padding rows (warm-up, capture)."""
        raise NotImplementedError
