# SPDX-License-Identifier: Apache-2.0
"""Slot-addressed decoder state pools for many live streams.

A pool owns every persistent streaming tensor (one K/V ring per attention layer,
``(2, S, H, C, Dh)``, a view of its resolution group's ``(L, 2, S, H, C, Dh)`` tensor, and
the offsets) and the slot lifecycle: :meth:`acquire` leases
a slot (LIFO free list, so the slot released last is leased next while its memory is
warm), :meth:`release` resets it and returns it. It also owns its padding policy: the
slot ids graph padding rows carry, how many scratch slots a bucket needs, and which
slots a graph must reset after running padding rows. Callers never branch on the
pool they hold.

Execution batches are compact: row ``b`` of a step decodes ``lengths[b]`` frames for
slot ``state_slot_ids[b]`` when ``valid_rows[b]``; invalid rows are CUDA-graph
padding. Frames at or beyond a row's length are padding frames: they write no ring
cell, advance no offset and no query sees them (``step_metadata.py``), so a step of
``T`` frames leaves every row exactly as a step of its own length would.

Two pools share one interface and are chosen once, at construction, by
:func:`make_state_pool` (memory arithmetic in docs/memory.md):

``LegacyDecoderStatePool`` (kind ``"legacy"``) - vLLM-Omni 0.30.0's behaviour
    (``vllm_omni/model_executor/models/moss_tts/``): ``state_capacity + scratch`` slots
    (one scratch slot per graph padding row); per-layer attention offsets and ring end
    offsets plus per-group offsets in one ``(R, S)`` int64 offset table (``R = 2 L + G``
    for v2 codecs, ``L`` for v1); every layer gathers its offsets, rebuilds its
    metadata, gathers the complete ring and writes the whole ring back for every row.
    The default for v1 codecs; the baseline for v2.

``CompactDecoderStatePool`` (kind ``"compact"``) - the default for v2 codecs:
    ``state_capacity + 1`` slots whatever scratch is asked for; slot
    ``state_capacity`` is the *null slot*: never leased, all zeros forever, the
    target of every invalid row. Offsets are one counter per slot,
    ``frames_decoded``: every group's token offset is ``frames_decoded *
    tokens_per_frame``, equal to the legacy pool's per-layer offsets. Ring metadata
    and RoPE tables are built once per group per step. Persistent writes go through
    custom ops: only ring cells that valid tokens wrote, only for rows that wrote;
    invalid rows never write, not even to the null slot. Two attention backends, chosen
    at construction (``attention_backend``): ``"sdpa"`` gathers rings, runs the same
    reference computation as the legacy pool (audio and live state bit-identical to
    it) and commits touched cells (``ops/commit.py``); ``"triton"`` reads rings in place
    and writes each row's last ``min(tokens, C)`` tokens (``ops/ring_attention.py``): the
    same keys per query and bitwise the same ring contents, its own arithmetic.

Both pools clear a slot's rings on :meth:`reset` as well as its offsets. Upstream
only zeroes offsets, which hides stale keys behind the mask - but SDPA still
multiplies masked values by a zero weight, so a non-finite value left by an
earlier stream would turn into NaN audio for the next one.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import (
    CompactRingAttention,
    CompactTritonRingAttention,
    LegacyRingAttention,
    StepPlan,
    check_attention_backend,
    default_attention_backend,
    group_steps,
)
from .decoder import CodecDecoder, _autocast, run_decoder
from .ops.commit import commit_offsets
from .ops.ring_attention import RING_DTYPES
from .step_metadata import RING_SEMANTICS, default_ring_semantics

__all__ = [
    "POOL_KINDS",
    "CompactDecoderStatePool",
    "DecoderStatePool",
    "LegacyDecoderStatePool",
    "SlotState",
    "make_state_pool",
    "state_bytes_for",
]

#: Pool kinds :func:`make_state_pool` builds.
POOL_KINDS = ("compact", "legacy", "paged")


def state_bytes_for(decoder_config, num_slots: int, kind: str, element_size: int = 2) -> int:
    """Persistent bytes of a pool with ``num_slots`` slots (rings plus offsets), without allocating.

    ``kind`` is ``"compact"``, ``"legacy"`` or ``"paged"`` (as compact). The rings of one slot of the v2 codec are
    88,678,400 bytes in bf16 (docs/memory.md).

    Raises:
        ValueError: unknown ``kind``.
    """
    rings = num_slots * decoder_config.state_bytes_per_slot(element_size)
    # "paged": the compact figure, an upper bound for page_fraction 1.0 (that pool allocates one null page per
    # group instead of a null slot, plus its page tables: docs/memory.md, "Paged rings").
    if kind in ("compact", "paged"):
        return rings + num_slots * 8
    if kind == "legacy":
        return rings + _legacy_table_rows(decoder_config) * num_slots * 8
    raise ValueError(f"unknown state pool kind {kind!r}; expected one of {POOL_KINDS}")


def _check_count(count) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"padding row count must be an integer >= 0, got {count!r}")


def ring_geometry(config) -> tuple[tuple[int, int, int, int, int], ...]:
    """Per resolution group ``(layers, heads, context, head_dim, tokens_per_frame)``: what a slot's state
    depends on besides the ring dtype (two codecs with equal geometry have interchangeable slot states)."""
    return tuple((g.num_layers, g.num_heads, g.ring_capacity, g.head_dim, g.tokens_per_frame) for g in config.groups)


@dataclass(frozen=True)
class SlotState:
    """One stream's decoder state on the host, from :meth:`DecoderStatePool.save_slot`.

    Only the ring cells in use are kept: for an attention layer whose stream has written ``o`` tokens
    into a ring of ``C`` cells, the cells of positions ``max(0, o - C) .. o - 1`` (all ``C`` once the
    ring has wrapped; none for a fresh slot). The other cells of a slot are zero by construction (slots
    start zeroed and are reset on release), so :meth:`DecoderStatePool.restore_slot` rebuilds the slot
    bit for bit.

    Attributes:
        pool_kind: ``"compact"`` or ``"legacy"`` (the offset layout).
        geometry: :func:`ring_geometry` of the codec.
        dtype: the ring dtype.
        ring_semantics: ``"upstream"`` or ``"exact"``.
        offsets: the slot's int64 offsets in the pool's layout: ``(1,)`` frames decoded (compact) or
            the ``(R,)`` column of the legacy offset table.
        cells: per attention layer, ``(2, H, n, Dh)`` keys and values of the ``n = min(o, C)`` latest
            positions, oldest first, on the CPU.
    """

    pool_kind: str
    geometry: tuple[tuple[int, int, int, int, int], ...]
    dtype: torch.dtype
    ring_semantics: str
    offsets: torch.Tensor
    cells: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes held (cells plus offsets)."""
        return sum(t.numel() * t.element_size() for t in (*self.cells, self.offsets))


def _legacy_table_rows(config) -> int:
    # v2 keeps an attention offset and a ring end offset per layer plus one offset per
    # group; v1 keeps one offset per attention layer (docs/memory.md).
    if config.version == "v2":
        return 2 * config.num_layers + len(config.groups)
    return config.num_layers


class DecoderStatePool(ABC):
    """Interface shared by the legacy and compact pools.

    Args:
        decoder: the weights; the pool never modifies them.
        dtype: ring dtype; defaults to ``decoder.state_dtype`` (the weight dtype).
        ring_semantics: ``"upstream"`` or ``"exact"`` (``step_metadata.py``); default: what
            upstream uses for the codec version (``"upstream"`` for v2, ``"exact"`` for v1).
        attention_backend: ``"sdpa"`` or ``"triton"`` (``attention.ATTENTION_BACKENDS``);
            default :func:`~.attention.default_attention_backend` of the decoder's device for
            the compact pool, ``"sdpa"`` for the legacy pool (the only one it runs).

    Raises:
        ValueError: a non-floating ``dtype``, unknown ``ring_semantics`` or ``attention_backend``
            (the message lists the choices), ``"triton"`` for the legacy pool, or ``"triton"``
            with a ring dtype outside ``ops.ring_attention.RING_DTYPES``.
        RuntimeError: ``"triton"`` without the ``triton`` package installed.
    """

    kind: ClassVar[str] = ""

    def __init__(
        self,
        decoder: CodecDecoder,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
    ):
        self.decoder = decoder
        self.config = decoder.config
        self.dtype = dtype or decoder.state_dtype
        if not self.dtype.is_floating_point:
            raise ValueError(f"ring dtype must be a floating-point dtype, got {self.dtype}")
        if ring_semantics is None:
            ring_semantics = default_ring_semantics(self.config.version)
        self.ring_semantics = ring_semantics
        if self.ring_semantics not in RING_SEMANTICS:
            raise ValueError(f"unknown ring semantics {self.ring_semantics!r}; expected one of {RING_SEMANTICS}")
        self.device = decoder.device
        if attention_backend is None:
            attention_backend = self._default_attention_backend()
        self.attention_backend = check_attention_backend(attention_backend)
        if self.attention_backend == "triton" and self.dtype not in RING_DTYPES:
            raise ValueError(f"attention backend 'triton' needs a ring dtype in {RING_DTYPES}, got {self.dtype}")
        self.rings: list[torch.Tensor] = []
        # One tensor per resolution group holding its layers' rings (``rings`` are views of them).
        self._group_rings: list[torch.Tensor] = []
        self.state_capacity = 0
        self.scratch_capacity = 0
        self.num_slots = 0
        self._free: list[int] = []  # LIFO: the top is leased next
        self._leased: set[int] = set()

    # ----------------------------------------------------------------- memory
    @property
    def initialized(self) -> bool:
        return bool(self.rings)

    def initialize(self, state_capacity: int, scratch_capacity: int = 0) -> None:
        """Allocate state for ``state_capacity`` live slots (ids ``0..state_capacity-1``).

        ``scratch_capacity`` is the scratch the caller's graph padding needs (see
        :meth:`scratch_slots_for`); a compact pool ignores it.

        Raises:
            ValueError: ``state_capacity < 1`` or ``scratch_capacity < 0``.
            RuntimeError: already initialised (call :meth:`close` first), or out of memory
                (the message names the bytes; the pool is left closed).
        """
        if self.initialized:
            raise RuntimeError(f"{type(self).__name__} is already initialised; close() it before re-initialising")
        if isinstance(state_capacity, bool) or not isinstance(state_capacity, int) or state_capacity < 1:
            raise ValueError(f"state_capacity must be an integer >= 1, got {state_capacity!r}")
        if isinstance(scratch_capacity, bool) or not isinstance(scratch_capacity, int) or scratch_capacity < 0:
            raise ValueError(f"scratch_capacity must be an integer >= 0, got {scratch_capacity!r}")
        self.state_capacity = state_capacity
        self.scratch_capacity = self._scratch_capacity(scratch_capacity)
        self.num_slots = state_capacity + self.scratch_capacity
        try:
            self.rings = self._allocate_rings()
            self._allocate_offsets()
        except (RuntimeError, MemoryError) as exc:  # out of memory: leave the pool closed
            element = torch.empty((), dtype=self.dtype).element_size()
            need = state_bytes_for(self.config, self.num_slots, self.kind, element)
            self.close()
            raise RuntimeError(
                f"cannot allocate decoder state for {state_capacity} live streams ({need} bytes on {self.device}): {exc}"
            ) from exc
        self._free = list(range(state_capacity - 1, -1, -1))  # a fresh pool leases 0, 1, 2, ...

    def _allocate_rings(self) -> list[torch.Tensor]:
        # One zeroed ring (2, S, H, C, Dh) per attention layer, a view of its group's (L, 2, S, H, C, Dh)
        # tensor: clearing a slot then takes one fill per group instead of one per layer (_clear_rings).
        return self._group_ring_views(
            [(2, self.num_slots, s.num_heads, s.ring_capacity, s.head_dim) for s in self.config.groups]
        )

    def _group_ring_views(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Allocate one zeroed tensor ``(num_layers, *shape)`` per resolution group (``shapes``: one ring's
        shape per group) into ``_group_rings``; returns every layer's ring, in layer order, as a view."""
        self._group_rings = [
            torch.zeros(spec.num_layers, *shape, device=self.device, dtype=self.dtype)
            for spec, shape in zip(self.config.groups, shapes)
        ]
        return [ring for group in self._group_rings for ring in group.unbind(0)]

    def close(self) -> None:
        """Drop all state and leases. The pool can be initialised again, with another capacity."""
        self.rings = []
        self._group_rings = []
        self.state_capacity = 0
        self.scratch_capacity = 0
        self.num_slots = 0
        self._free = []
        self._leased = set()
        self._drop_offsets()

    def state_bytes(self) -> int:
        """Bytes of persistent state actually allocated (rings plus offsets)."""
        return sum(t.numel() * t.element_size() for t in self.rings + self.offset_tensors())

    def state_in_use_bytes(self) -> int:
        """Bytes of state the live streams need now: all of it for unpaged pools (every slot holds full
        rings from its first frame); a paged pool counts the pages leased slots hold."""
        return self.state_bytes()

    # ----------------------------------------------------------------- slot lifecycle
    @property
    def free_slot_count(self) -> int:
        """Live slots that can still be leased."""
        return len(self._free)

    @property
    def leased_slots(self) -> frozenset[int]:
        """Slot ids currently leased."""
        return frozenset(self._leased)

    def acquire(self) -> int:
        """Lease a free slot and return its id. Its state is all zeros: slots are reset on release and
        start at zero, provided no step wrote them while unleased (steps do not check leases; the
        session only steps leased slots).

        Raises:
            RuntimeError: the pool is not initialised, or every live slot is leased.
        """
        self._require_initialized()
        if not self._free:
            raise RuntimeError(f"no free decoder state slot: all {self.state_capacity} live slots are leased")
        slot = self._free.pop()
        self._leased.add(slot)
        return slot

    def release(self, slot_ids) -> None:
        """Reset the leased slots ``slot_ids`` and return them to the free list.

        Raises:
            ValueError: an id that is not a live slot id, a slot that is not leased (a
                double release), or an id given twice. Nothing is released then.
            RuntimeError: the pool is not initialised.
        """
        self._require_initialized()
        ids = self._as_ids(slot_ids, "slot_ids").tolist()
        for i in ids:
            if not 0 <= i < self.state_capacity:
                raise ValueError(f"slot id {i} is not a live slot id (0..{self.state_capacity - 1})")
            if i not in self._leased:
                raise ValueError(f"slot {i} is not leased (released twice?)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"slot ids released twice in one call: {sorted({i for i in ids if ids.count(i) > 1})}")
        if ids:
            self.reset(ids)
        self._leased.difference_update(ids)
        self._free.extend(ids)

    def reset(self, slot_ids) -> None:
        """Forget the streams in ``slot_ids``: offsets to 0 and rings cleared. Leases are unchanged.

        Raises:
            ValueError: an id outside the resettable range (named in the message).
            RuntimeError: the pool is not initialised.
        """
        self._require_initialized()
        ids = self._as_ids(slot_ids, "slot_ids")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            limit = self._resettable_limit()
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise ValueError(f"slot id {bad} cannot be reset; resettable slot ids are 0..{limit - 1}")
        host_ids = ids.tolist()
        ids = self._ids_to_device(ids)
        self._clear_rings(ids, host_ids)
        self._reset_offsets(ids)

    def _clear_rings(self, ids: torch.Tensor, host_ids: list[int]) -> None:
        # ``ids`` on the pool's device, ``host_ids`` the same ids on the host (never read back from the device).
        for group in self._group_rings:  # (L, 2, S, H, C, Dh): slots are dim 2
            group.index_fill_(2, ids, 0)

    def prepare_step(self, slot_ids, lengths, frames=None) -> None:  # noqa: B027 - optional hook
        """Host-side preparation of a step over live ``slot_ids`` decoding ``lengths`` frames each
        (sequences of ints); ``frames``, if the caller tracks them, the frames each slot has decoded
        so far (saves reading them from the device). Nothing to do for unpaged pools; a paged pool
        allocates the pages the step writes. Call it before every step that bypasses
        :meth:`decode_streaming_batch` (graph replays, :meth:`decode_streaming_tensors`)."""

    def pages_short(self, pending: dict[int, int], decoded: dict[int, int] | None = None) -> bool:
        """Whether the live slots of ``pending`` (slot -> frames still to decode) lack state memory for
        that much more context (``decoded``: slot -> frames decoded so far, if the caller tracks them).
        Never for unpaged pools (every slot holds full rings)."""
        return False

    def can_admit(
        self,
        frames: int,
        chunk_frames: int,
        pending: dict[int, int] | None = None,
        decoded: dict[int, int] | None = None,
    ) -> bool:
        """Whether a stream that has decoded ``frames`` frames (0 for a new one) can take a slot and
        decode ``chunk_frames`` more, once the live slots of ``pending`` (slot -> frames still to decode;
        ``decoded``: slot -> frames decoded so far) have the state for their chunks. Unpaged pools:
        whenever a slot is free."""
        return self.free_slot_count > 0

    def room_for_all(self, frames: int, chunk_frames: int) -> bool:
        """Whether the state memory left would hold a stream of ``frames + chunk_frames`` frames even if
        every leased slot's rings filled completely (then :meth:`can_admit` needs no ``pending``).
        Always for unpaged pools."""
        return True

    def _read_cells(self, layer: int, slot: int, cells: torch.Tensor) -> torch.Tensor:
        # (2, H, N, Dh) copy of ring cells `cells` (N,) of one slot.
        return self.rings[layer][:, slot].index_select(2, cells)

    def _write_cells(self, layer: int, slot: int, cells: torch.Tensor, values: torch.Tensor) -> None:
        self.rings[layer][:, slot].index_copy_(2, cells, values)

    # ----------------------------------------------------------------- padding policy
    @abstractmethod
    def scratch_slots_for(self, padding_rows: int) -> int:
        """Scratch slots :meth:`initialize` must provide so ``padding_rows`` padding rows can run."""

    @abstractmethod
    def padding_slot_ids(self, count: int) -> torch.Tensor:
        """``(count,)`` int64 slot ids for ``count`` graph padding rows.

        Raises:
            ValueError: ``count`` is not an integer >= 0, or the pool lacks the scratch it needs.
        """

    @abstractmethod
    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        """Slot ids a graph must :meth:`reset` after running ``count`` padding rows (warm-up, capture)."""

    # ----------------------------------------------------------------- decode
    @torch.no_grad()
    def decode_streaming_batch(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated streaming step of ``T`` frames.

        Args:
            codes: ``(n_vq, B, T)`` integer codes in ``[0, codebook_size)``, on the pool's device.
            lengths: ``(B,)`` integer valid frames per row, ``0..T``: frames at or beyond a
                row's length are padding (they change no state); 0 decodes nothing.
            state_slot_ids: ``(B,)`` int64 slot of each row.
            valid_rows: ``(B,)`` bool; False marks padding rows (their length is ignored).
        Returns:
            ``audio`` ``(B, channels, T * samples_per_frame)`` float32 (zeros for invalid
            rows and padding frames) and ``audio_lengths`` ``(B,)`` int64 valid samples per
            channel (``lengths * samples_per_frame``, 0 for invalid rows).
        Raises:
            ValueError: wrong shape, dtype or device; code out of range; a valid row's length
                outside ``0..T`` (naming the row, the length and ``T``); slot id out of range;
                duplicate slot ids among valid rows; padding rows on slots the pool's padding
                policy does not allow. Nothing is modified when it raises.
            RuntimeError: the pool is not initialised.
        """
        self._require_initialized()
        self._validate(codes, lengths, state_slot_ids, valid_rows)
        return self.decode_streaming_tensors(codes.long(), lengths.long(), state_slot_ids.long(), valid_rows)

    def decode_streaming_tensors(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor-only step (the compile and CUDA-graph boundary): no validation, no host syncs."""
        slots = self._route(state_slot_ids, valid_rows)
        lengths = torch.where(valid_rows, lengths, 0)
        plan = self.step_plan(slots, lengths, codes.shape[-1])
        with torch.no_grad(), _autocast(self.decoder):
            audio = run_decoder(self.decoder, codes, plan)
        audio_lengths = lengths * self.config.samples_per_frame
        sample = torch.arange(audio.shape[-1], device=audio.device)
        audio = torch.where(sample < audio_lengths.view(-1, 1, 1), audio, 0.0)
        return audio, audio_lengths

    @abstractmethod
    def step_plan(self, slots: torch.Tensor, lengths: torch.Tensor, num_frames: int) -> StepPlan:
        """The :class:`~.attention.StepPlan` of one step: ``slots`` ``(B,)`` routed slot ids,
        ``lengths`` ``(B,)`` int64 valid frames (0 for invalid rows), ``num_frames`` = ``T``."""

    # ----------------------------------------------------------------- inspection
    def slot_state(self, slot: int) -> dict[str, object]:
        """Copy of one slot's state: ``rings`` (per layer ``(2, H, C, Dh)``) and
        ``layer_offsets`` (``(L,)`` int64 token offset of each attention layer)."""
        self._require_initialized()
        return {
            "rings": [
                self._read_cells(layer, slot, torch.arange(ring_cells, device=self.device))
                for layer, ring_cells in enumerate(self._ring_cells())
            ],
            "layer_offsets": self._layer_offsets(slot),
        }

    def _ring_cells(self) -> list[int]:
        # Ring capacity C of each attention layer.
        return [spec.ring_capacity for spec in self.config.groups for _ in range(spec.num_layers)]

    @abstractmethod
    def offset_tensors(self) -> list[torch.Tensor]:
        """The persistent offset tensors (for byte accounting and address checks)."""

    # ----------------------------------------------------------------- save / restore
    def save_slot(self, slot: int) -> SlotState:
        """Copy live slot ``slot``'s state to the host: its offsets and only the ring cells in use.

        The slot is unchanged. A round trip through :meth:`restore_slot` (into this pool or another
        pool of the same kind, codec geometry, ring dtype and ring semantics, on any device) gives back
        the slot's rings and offsets bit for bit, so decoding continues exactly as without it.

        Raises:
            ValueError: ``slot`` is not a live slot id.
            RuntimeError: the pool is not initialised.
        """
        slot = self._live_slot(slot, "save_slot")
        column = self._offset_column(slot).cpu()
        cells = []
        for layer, (capacity, offset) in enumerate(zip(self._ring_cells(), self._layer_offsets_in(column).tolist())):
            cells.append(self._read_cells(layer, slot, self._cells_in_use(offset, capacity).to(self.device)).cpu())
        return SlotState(self.kind, ring_geometry(self.config), self.dtype, self.ring_semantics, column, tuple(cells))

    def restore_slot(self, slot: int, state: SlotState) -> None:
        """Make live slot ``slot`` hold ``state`` (from :meth:`save_slot`): reset it, then write the
        saved cells and offsets. Leases are unchanged (acquire the slot first).

        Raises:
            TypeError: ``state`` is not a :class:`SlotState`.
            ValueError: ``slot`` is not a live slot id, or ``state`` comes from another pool kind, codec
                geometry, ring dtype or ring semantics, or its tensors do not match its offsets (the
                message names the mismatch). Nothing changes then.
            RuntimeError: the pool is not initialised.
        """
        slot = self._live_slot(slot, "restore_slot")
        self._check_slot_state(state)
        self.reset([slot])
        self._write_offset_column(slot, state.offsets.to(self.device))
        self._reserve_restored(slot)
        offsets = self._layer_offsets_in(state.offsets).tolist()
        for layer, (capacity, offset, saved) in enumerate(zip(self._ring_cells(), offsets, state.cells)):
            cells = self._cells_in_use(offset, capacity).to(self.device)
            self._write_cells(layer, slot, cells, saved.to(self.device))

    def _reserve_restored(self, slot: int) -> None:  # noqa: B027 - optional hook
        """Hook: a paged pool allocates the pages of a slot whose offsets were just restored."""

    # ----------------------------------------------------------------- helpers
    def _live_slot(self, slot, op: str) -> int:
        self._require_initialized()
        if isinstance(slot, torch.Tensor) and slot.numel() == 1 and not slot.dtype.is_floating_point:
            slot = int(slot)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.state_capacity:
            raise ValueError(f"{op}: slot {slot!r} is not a live slot id (0..{self.state_capacity - 1})")
        return slot

    @staticmethod
    def _cells_in_use(offset: int, capacity: int) -> torch.Tensor:
        # Cells of the latest min(offset, C) positions, oldest first.
        used = min(offset, capacity)
        return torch.remainder(torch.arange(offset - used, offset), capacity)

    def _check_slot_state(self, state) -> None:
        if not isinstance(state, SlotState):
            raise TypeError(f"restore_slot: state must be a SlotState (from save_slot), got {type(state).__name__}")
        expected = {
            "pool kind": (self.kind, state.pool_kind),
            "codec geometry (layers, heads, context, head_dim, tokens per frame per group)": (
                ring_geometry(self.config),
                state.geometry,
            ),
            "ring dtype": (self.dtype, state.dtype),
            "ring semantics": (self.ring_semantics, state.ring_semantics),
        }
        for what, (ours, theirs) in expected.items():
            if ours != theirs:
                raise ValueError(f"restore_slot: the state's {what} is {theirs!r}; this pool's is {ours!r}")
        shape = self._offset_column(0).shape
        offsets = state.offsets
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.shape != shape:
            got = (getattr(offsets, "shape", None), getattr(offsets, "dtype", None))
            raise ValueError(f"restore_slot: state offsets must be int64 of shape {tuple(shape)}, got {got}")
        if bool((offsets < 0).any()):
            raise ValueError(f"restore_slot: state offsets must be >= 0, got {offsets.tolist()}")
        if len(state.cells) != len(self.rings):
            raise ValueError(
                f"restore_slot: the state has {len(state.cells)} layers of cells; the codec has {len(self.rings)}"
            )
        heads = [spec for spec in self.config.groups for _ in range(spec.num_layers)]
        for layer, (spec, offset, saved) in enumerate(
            zip(heads, self._layer_offsets_in(offsets).tolist(), state.cells)
        ):
            shape = (2, spec.num_heads, min(offset, spec.ring_capacity), spec.head_dim)
            if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != shape or saved.dtype != self.dtype:
                got = (tuple(getattr(saved, "shape", ())), getattr(saved, "dtype", None))
                raise ValueError(
                    f"restore_slot: layer {layer} cells must be {shape} {self.dtype} for offset {offset}, got {got}"
                )

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise RuntimeError(f"{type(self).__name__} is not initialised; call initialize(state_capacity) first")

    @staticmethod
    def _as_ids(ids, name: str) -> torch.Tensor:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, RuntimeError, OverflowError, ValueError) as exc:
            raise ValueError(f"{name} must be a 1-D integer tensor or list of ints, got {ids!r}") from exc
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(t.shape)} dtype {t.dtype}")
        return t.long()

    def _ids_to_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Host int64 ``ids`` on the pool's device. To CUDA they travel through page-locked memory
        without a wait, so a reset or a page allocation never waits for steps still running (the
        session awaits a call's steps once, at its end); the copy is ordered before the work that
        reads the ids. If page-locked memory cannot be had, the copy waits instead (a reset then
        still happens: the caller has already forgotten the streams it releases)."""
        if self.device.type == "cuda" and ids.device.type == "cpu":
            try:
                pinned = ids.pin_memory()
            except RuntimeError:
                return ids.to(self.device)
            return pinned.to(self.device, non_blocking=True)
        return ids.to(self.device)

    def _validate(self, codes, lengths, slot_ids, valid_rows) -> None:
        self.decoder.validate_codes(codes)
        _, B, T = codes.shape
        if B < 1 or T < 1:
            raise ValueError(f"codes must have B >= 1 rows and T >= 1 frames, got shape {tuple(codes.shape)}")
        for name, t, kind in (
            ("lengths", lengths, "int"),
            ("state_slot_ids", slot_ids, "int"),
            ("valid_rows", valid_rows, "bool"),
        ):
            if not isinstance(t, torch.Tensor) or t.shape != (B,):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of shape ({B},), got {shape}")
            ok = t.dtype == torch.bool if kind == "bool" else (t.dtype in (torch.int32, torch.int64))
            if not ok:
                raise ValueError(f"{name} must be {'bool' if kind == 'bool' else 'int32/int64'}, got {t.dtype}")
        for name, t in (
            ("codes", codes),
            ("lengths", lengths),
            ("state_slot_ids", slot_ids),
            ("valid_rows", valid_rows),
        ):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the pool is on {self.device}")
        ids, valid = slot_ids.tolist(), valid_rows.tolist()
        for b, n in enumerate(lengths.tolist()):
            if valid[b] and not 0 <= n <= T:
                raise ValueError(f"lengths[{b}] = {n} is outside 0..{T} (T = frames in this step)")
        live = [i for i, v in zip(ids, valid) if v]
        for i in live:
            if not 0 <= i < self.state_capacity:
                raise ValueError(f"slot id {i} of a valid row is outside the live slots 0..{self.state_capacity - 1}")
        dupes = sorted({i for i in live if live.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate slot ids among valid rows: {dupes}")
        self._validate_padding([i for i, v in zip(ids, valid) if not v])

    @staticmethod
    def _check_count(count) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"padding row count must be an integer >= 0, got {count!r}")

    def _validate_padding(self, padding_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Check the slot ids of invalid rows; the compact pool accepts any (they read the null slot)."""

    def _default_attention_backend(self) -> str:
        return default_attention_backend(self.device)

    @abstractmethod
    def _scratch_capacity(self, requested: int) -> int: ...

    @abstractmethod
    def _allocate_offsets(self) -> None: ...

    @abstractmethod
    def _drop_offsets(self) -> None: ...

    @abstractmethod
    def _reset_offsets(self, ids: torch.Tensor) -> None: ...

    @abstractmethod
    def _resettable_limit(self) -> int: ...

    @abstractmethod
    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor: ...

    def _layer_offsets(self, slot: int) -> torch.Tensor:
        return self._layer_offsets_in(self._offset_column(slot).cpu())

    @abstractmethod
    def _offset_column(self, slot: int) -> torch.Tensor:
        """A copy of slot ``slot``'s offsets in the pool's layout (:attr:`SlotState.offsets`)."""

    @abstractmethod
    def _write_offset_column(self, slot: int, column: torch.Tensor) -> None: ...

    @abstractmethod
    def _layer_offsets_in(self, column: torch.Tensor) -> torch.Tensor:
        """``(L,)`` int64 token offset of every attention layer, from a CPU offset column."""


# =============================================================================== legacy


class LegacyDecoderStatePool(DecoderStatePool):
    """vLLM-Omni 0.30.0's pool: scratch slots for padding rows, per-layer offsets, whole-ring write-back.

    Offsets: ``offset_table`` ``(R, S)`` int64 in upstream's row layout (docs/memory.md).
    """

    kind = "legacy"

    def __init__(
        self,
        decoder: CodecDecoder,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
    ):
        super().__init__(decoder, dtype, ring_semantics, attention_backend)
        if self.attention_backend != "sdpa":
            raise ValueError(
                f"the legacy pool runs upstream's per-layer SDPA path only; attention backend "
                f"{self.attention_backend!r} needs the compact pool (v2 codecs)"
            )
        self.offset_table: torch.Tensor | None = None
        # Row layout as upstream: v2 lists, per group, (attention offset, ring end offset)
        # for each layer and then the group's own offset; v1 one row per layer.
        self.layer_rows: list[tuple[int, int]] = []
        self.group_rows: dict[int, int] = {}  # a group's last layer -> the group's own row
        row = 0
        for g, spec in enumerate(self.config.groups):
            for _ in range(spec.num_layers):
                if self.config.version == "v2":
                    self.layer_rows.append((row, row + 1))
                    row += 2
                else:
                    self.layer_rows.append((row, row))
                    row += 1
            if self.config.version == "v2":
                self.group_rows[self.config.group_first_layers[g] + spec.num_layers - 1] = row
                row += 1
        assert row == _legacy_table_rows(self.config)

    def _default_attention_backend(self) -> str:
        return "sdpa"

    def _scratch_capacity(self, requested: int) -> int:
        return requested

    def scratch_slots_for(self, padding_rows: int) -> int:
        # Padding rows write their whole ring back: each needs a scratch slot of its own.
        self._check_count(padding_rows)
        return padding_rows

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        self._require_initialized()
        self._check_count(count)
        if count > self.scratch_capacity:
            raise ValueError(f"{count} padding rows need {count} scratch slots; this pool has {self.scratch_capacity}")
        return torch.arange(self.state_capacity, self.state_capacity + count, device=self.device)

    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        return self.padding_slot_ids(count).tolist()

    def _allocate_offsets(self) -> None:
        rows = _legacy_table_rows(self.config)
        self.offset_table = torch.zeros(rows, self.num_slots, dtype=torch.long, device=self.device)

    def _drop_offsets(self) -> None:
        self.offset_table = None

    def offset_tensors(self) -> list[torch.Tensor]:
        return [] if self.offset_table is None else [self.offset_table]

    def _reset_offsets(self, ids: torch.Tensor) -> None:
        self.offset_table.index_fill_(1, ids, 0)  # every offset of these slots in one kernel

    def _resettable_limit(self) -> int:
        return self.num_slots

    def _validate_padding(self, padding_ids: list[int]) -> None:
        # Padding rows write their whole ring back: anywhere but a distinct scratch
        # slot they would overwrite a live stream or race with each other.
        for i in padding_ids:
            if not self.state_capacity <= i < self.num_slots:
                raise ValueError(
                    f"padding row slot id {i} is not a scratch slot ({self.state_capacity}..{self.num_slots - 1})"
                )
        dupes = sorted({i for i in padding_ids if padding_ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate scratch slot ids among padding rows: {dupes}")

    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        return slot_ids

    def step_plan(self, slots: torch.Tensor, lengths: torch.Tensor, num_frames: int) -> StepPlan:
        attention = LegacyRingAttention(
            self.rings, self.offset_table, self.layer_rows, self.group_rows, self.ring_semantics, slots
        )
        return StepPlan(group_steps(self.config, num_frames, lengths), attention)

    def _offset_column(self, slot: int) -> torch.Tensor:
        return self.offset_table[:, slot].clone()

    def _write_offset_column(self, slot: int, column: torch.Tensor) -> None:
        self.offset_table[:, slot] = column

    def _layer_offsets_in(self, column: torch.Tensor) -> torch.Tensor:
        return column[[attn for attn, _ in self.layer_rows]]


# =============================================================================== compact


class CompactDecoderStatePool(DecoderStatePool):
    """One slot per live stream plus a read-only null slot; shared group metadata; masked commits.

    Offsets: ``frames_decoded`` ``(S,)`` int64, code frames decoded per slot since reset;
    the token offset of group ``g`` is ``frames_decoded * tokens_per_frame[g]``.

    Raises:
        ValueError: a v1 codec (whose per-layer offsets the legacy pool keeps).
    """

    kind = "compact"

    def __init__(
        self,
        decoder: CodecDecoder,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
    ):
        if decoder.config.version != "v2":
            raise ValueError(
                f"the compact pool serves v2 codecs; this codec is {decoder.config.version} and keeps the legacy pool"
            )
        super().__init__(decoder, dtype, ring_semantics, attention_backend)
        self.frames_decoded: torch.Tensor | None = None
        # The attention of every step, chosen once here.
        self._plan_attention = self._triton_attention if self.attention_backend == "triton" else self._sdpa_attention

    @property
    def null_slot(self) -> int:
        """Id of the null slot (``state_capacity``): all zeros, never leased, never written."""
        self._require_initialized()
        return self.state_capacity

    def _scratch_capacity(self, requested: int) -> int:
        return 1  # the null slot, whatever the caller asks for

    def scratch_slots_for(self, padding_rows: int) -> int:
        self._check_count(padding_rows)
        return 0  # every padding row reads the null slot, which always exists

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        self._check_count(count)
        return torch.full((count,), self.null_slot, dtype=torch.long, device=self.device)

    def slots_dirtied_by_padding(self, count: int) -> list[int]:
        self._check_count(count)
        return []  # padding rows write nothing

    def _allocate_offsets(self) -> None:
        self.frames_decoded = torch.zeros(self.num_slots, dtype=torch.long, device=self.device)

    def _drop_offsets(self) -> None:
        self.frames_decoded = None

    def offset_tensors(self) -> list[torch.Tensor]:
        return [] if self.frames_decoded is None else [self.frames_decoded]

    def _reset_offsets(self, ids: torch.Tensor) -> None:
        self.frames_decoded.index_fill_(0, ids, 0)

    def _resettable_limit(self) -> int:
        return self.state_capacity  # the null slot is never written, not even by reset

    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        # Invalid rows read the null slot whatever id they carry (even out of range).
        return torch.where(valid_rows, slot_ids, self.state_capacity)

    def step_plan(self, slots: torch.Tensor, lengths: torch.Tensor, num_frames: int) -> StepPlan:
        start = self.frames_decoded.index_select(0, slots)
        groups, attention = self._plan_attention(slots, lengths, num_frames, start)
        # Rows that decoded nothing keep their counter and never write (the null slot included).
        finish = functools.partial(commit_offsets, start + lengths, self.frames_decoded, slots, lengths > 0)
        return StepPlan(groups, attention, finish)

    def _sdpa_attention(self, slots, lengths, num_frames: int, start):
        # Ring metadata (cells, sources, masks) once per group; gathered rows, masked commits.
        groups = group_steps(self.config, num_frames, lengths, self.ring_semantics, start)
        return groups, CompactRingAttention(self.rings, self.ring_semantics, slots)

    def _triton_attention(self, slots, lengths, num_frames: int, start):
        # No ring metadata: the kernels derive positions from offsets and valid token counts.
        groups = group_steps(self.config, num_frames, lengths)
        attention = CompactTritonRingAttention(self.config, self.rings, self.ring_semantics, slots, start, num_frames)
        return groups, attention

    def _offset_column(self, slot: int) -> torch.Tensor:
        return self.frames_decoded[slot : slot + 1].clone()

    def _write_offset_column(self, slot: int, column: torch.Tensor) -> None:
        self.frames_decoded[slot : slot + 1] = column

    def _layer_offsets_in(self, column: torch.Tensor) -> torch.Tensor:
        frames = int(column[0])
        return torch.tensor(
            [frames * spec.tokens_per_frame for spec in self.config.groups for _ in range(spec.num_layers)],
            dtype=torch.long,
        )


class PagesExhausted(RuntimeError):
    """A paged pool has too few free pages for a step (or a restore); nothing was allocated."""


class PagedDecoderStatePool(CompactDecoderStatePool):
    """The compact pool with each group's rings held in pages of a shared page pool.

    Per resolution group ``g``, every layer keeps ``(2, P_g, H, page_size, Dh)`` pages instead of
    ``(2, S, H, C, Dh)`` rings, and one ``(S, C / page_size)`` int64 page table (shared by the
    group's layers) maps logical page ``i`` of a slot's ring (cells ``i*page_size ..``) to a physical
    page. Page 0 is the null page: all zeros, never written, where unallocated entries point. A slot
    holds pages only for the context it has: after ``f`` frames, ``min(ceil(f x tokens_per_frame /
    page_size), C / page_size)`` pages per group; pages are allocated by :meth:`prepare_step` (and
    :meth:`decode_streaming_batch`) before the step that first writes them, and zeroed and freed on
    :meth:`reset`/:meth:`release`. Audio, ring contents (:meth:`slot_state`) and offsets equal the
    compact pool's bit for bit.

    Args:
        decoder, dtype, ring_semantics: as :class:`DecoderStatePool`.
        attention_backend: ``"triton"`` only (the ring ops address pages through the table).
        page_size: tokens per page; must divide every group's window (``GroupSpec.context``).
            Default: their greatest common divisor (25 for v2: windows 125, 250, 400).
        page_fraction: pages per group as a fraction of what ``state_capacity`` full rings need
            (``1.0``, the default: never short of pages; smaller: admission must watch
            :meth:`free_page_counts`).
        state_budget_bytes: instead of ``page_fraction``, the bytes of ring pages (the null pages
            included) the pool may hold: each group gets the pages its share of the budget pays for
            (the same fraction of full rings for every group, at most 1; :meth:`page_fraction_for_budget`),
            fixed at :meth:`initialize`.
        expected_stream_frames: with a budget, split it by the groups' fill instead: after one stream's
            full rings, each group gets pages in proportion to what a live stream of this many frames
            holds on average (:meth:`average_pages`; fast-filling groups get more of the budget). The
            mean length of the live streams (length-weighted) is the natural value. ``page_fraction``
            then reports the pages' bytes as a fraction of full rings for every slot.

    Raises:
        ValueError: another backend, a page size that does not divide a window, a fraction outside
            ``(0, 1]``, both ``page_fraction`` and ``state_budget_bytes``, a budget that is not an
            integer >= 1, ``expected_stream_frames`` that is not an integer >= 1 or comes without a
            budget, or a v1 codec. At :meth:`initialize`: a budget or fraction too small for one
            stream's full rings (the message names the minimum).
    """

    kind = "paged"

    def __init__(
        self,
        decoder: CodecDecoder,
        dtype: torch.dtype | None = None,
        ring_semantics: str | None = None,
        attention_backend: str | None = None,
        *,
        page_size: int | None = None,
        page_fraction: float | None = None,
        state_budget_bytes: int | None = None,
        expected_stream_frames: int | None = None,
    ):
        super().__init__(decoder, dtype, ring_semantics, attention_backend or "triton")
        if self.attention_backend != "triton":
            raise ValueError(
                f"the paged pool needs attention_backend 'triton' (its ops read pages), got {self.attention_backend!r}"
            )
        windows = [spec.ring_capacity for spec in self.config.groups]
        self.page_size = math.gcd(*windows) if page_size is None else page_size
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        bad = [w for w in windows if w % self.page_size]
        if bad:
            raise ValueError(f"page_size {self.page_size} must divide every group's window; it does not divide {bad}")
        if page_fraction is not None and state_budget_bytes is not None:
            raise ValueError("give the paged pool page_fraction or state_budget_bytes, not both")
        if state_budget_bytes is not None and (
            isinstance(state_budget_bytes, bool) or not isinstance(state_budget_bytes, int) or state_budget_bytes < 1
        ):
            raise ValueError(f"state_budget_bytes must be an integer >= 1, got {state_budget_bytes!r}")
        page_fraction = 1.0 if page_fraction is None else page_fraction
        if isinstance(page_fraction, bool) or not 0.0 < float(page_fraction) <= 1.0:
            raise ValueError(f"page_fraction must be in (0, 1], got {page_fraction!r}")
        self.page_fraction = float(page_fraction)
        self.state_budget_bytes = state_budget_bytes
        if expected_stream_frames is not None:
            if state_budget_bytes is None:
                raise ValueError("expected_stream_frames splits a state budget: give state_budget_bytes too")
            if (
                isinstance(expected_stream_frames, bool)
                or not isinstance(expected_stream_frames, int)
                or expected_stream_frames < 1
            ):
                raise ValueError(f"expected_stream_frames must be an integer >= 1, got {expected_stream_frames!r}")
        self.expected_stream_frames = expected_stream_frames
        self.page_tables: list[torch.Tensor] = []  # per group, (S, n_g) int64 on the device
        self._host_tables: list[list[list[int]]] = []  # per group, per slot: its physical pages in order
        self._free_pages: list[list[int]] = []  # per group, LIFO
        self._group_layers: list[range] = []

    # ----------------------------------------------------------------- memory
    def _pages_per_ring(self, spec) -> int:
        return spec.ring_capacity // self.page_size

    def _page_bytes(self, spec) -> int:
        """Bytes of one page of group ``spec`` over all its layers (keys and values)."""
        return 2 * spec.num_heads * self.page_size * spec.head_dim * self.dtype.itemsize * spec.num_layers

    def _stream_bytes(self) -> int:
        # One stream's full rings, as pages.
        return sum(self._pages_per_ring(spec) * self._page_bytes(spec) for spec in self.config.groups)

    def _null_bytes(self) -> int:
        # The null page of every group.
        return sum(self._page_bytes(spec) for spec in self.config.groups)

    def page_fraction_for_budget(self, budget_bytes: int, state_capacity: int) -> float:
        """The fraction of full rings for ``state_capacity`` slots that ``budget_bytes`` of ring pages
        pay for once the null pages are paid, at most 1.

        Raises:
            ValueError: the budget cannot hold one stream's full rings plus the null pages; the
                message names that minimum in bytes.
        """
        null, full = self._null_bytes(), self._stream_bytes()
        if budget_bytes < full + null:
            raise ValueError(
                f"a state budget of {budget_bytes} bytes holds no stream: one stream's full rings plus the "
                f"null pages need {full + null} bytes ({(full + null) / 2**20:.2f} MiB)"
            )
        return min(1.0, (budget_bytes - null) / (state_capacity * full))

    def _pages_at(self, fraction: float, state_capacity: int) -> list[int]:
        """Physical pages per group, the null page included: with a budget, the pages it pays for
        (rounded down); otherwise ``fraction`` of full rings for every
        slot (rounded up)."""
        share = [fraction * state_capacity * self._pages_per_ring(spec) for spec in self.config.groups]
        if self.state_budget_bytes is not None:
            return [math.floor(x + 1e-9) + 1 for x in share]
        return [math.ceil(x - 1e-9) + 1 for x in share]

    def average_pages(self, frames: int) -> list[float]:
        """Pages per group a stream holds on average over a life of ``frames`` frames (the mean over its
        frame counts 1..frames of ``min(ceil(f x tokens_per_frame / page_size), pages per ring)``): what
        a live stream of that length holds at a random moment."""
        out = []
        for spec in self.config.groups:
            n = self._pages_per_ring(spec)
            filling = min(frames, -(-spec.ring_capacity // spec.tokens_per_frame))  # frames until the ring is full
            held = sum(self._pages_needed(spec, f) for f in range(1, filling + 1))
            out.append((held + (frames - filling) * n) / frames)
        return out

    def _pages_by_fill(self, budget_bytes: int, state_capacity: int, frames: int) -> list[int]:
        """Physical pages per group, the null page included, for a budget split by each group's fill over
        a stream of ``frames`` frames: one stream's full rings and the null pages first, then the rest
        in proportion to :meth:`average_pages` (rounded down), at most full rings for every slot."""
        groups = self.config.groups
        page_bytes = [self._page_bytes(spec) for spec in groups]
        per_ring = [self._pages_per_ring(spec) for spec in groups]
        self.page_fraction_for_budget(budget_bytes, state_capacity)  # the minimum check
        average = self.average_pages(frames)
        rest = budget_bytes - self._stream_bytes() - self._null_bytes()
        streams = rest / sum(a * b for a, b in zip(average, page_bytes))
        return [min(state_capacity * n, n + math.floor(streams * a + 1e-9)) + 1 for a, n in zip(average, per_ring)]

    def _allocate_rings(self) -> list[torch.Tensor]:
        if self.expected_stream_frames is not None:
            counts = self._pages_by_fill(self.state_budget_bytes, self.state_capacity, self.expected_stream_frames)
            used = sum((c - 1) * self._page_bytes(spec) for c, spec in zip(counts, self.config.groups))
            self.page_fraction = used / (self.state_capacity * self._stream_bytes())  # of full rings, in bytes
        else:
            if self.state_budget_bytes is not None:
                self.page_fraction = self.page_fraction_for_budget(self.state_budget_bytes, self.state_capacity)
            counts = self._pages_at(self.page_fraction, self.state_capacity)
        shapes, first = [], 0
        self.page_tables, self._host_tables, self._free_pages, self._group_layers = [], [], [], []
        for spec in self.config.groups:
            n = self._pages_per_ring(spec)
            pages = counts[len(self.page_tables)]
            if pages - 1 < n:
                raise ValueError(
                    f"page_fraction {self.page_fraction} gives group {len(self.page_tables)} {pages - 1} pages; one "
                    f"stream needs {n} (page_fraction >= {n / (self.state_capacity * n):.4g} for {self.state_capacity} slots)"
                )
            shapes.append((2, pages, spec.num_heads, self.page_size, spec.head_dim))
            self.page_tables.append(torch.zeros(self.num_slots, n, dtype=torch.long, device=self.device))
            self._host_tables.append([[] for _ in range(self.num_slots)])
            self._free_pages.append(list(range(pages - 1, 0, -1)))  # page 1 is allocated first
            self._group_layers.append(range(first, first + spec.num_layers))
            first += spec.num_layers
        return self._group_ring_views(shapes)

    def close(self) -> None:
        super().close()
        self.page_tables, self._host_tables, self._free_pages, self._group_layers = [], [], [], []

    def offset_tensors(self) -> list[torch.Tensor]:
        # The page tables are persistent metadata too (graphs read them by address).
        return super().offset_tensors() + list(self.page_tables)

    def free_page_counts(self) -> list[int]:
        """Free pages per group."""
        self._require_initialized()
        return [len(free) for free in self._free_pages]

    def state_in_use_bytes(self) -> int:
        """Bytes of the pages leased slots hold, plus the offsets and page tables."""
        return self.pages_in_use_bytes() + sum(t.numel() * t.element_size() for t in self.offset_tensors())

    def pages_in_use_bytes(self) -> int:
        """Bytes of the pages leased slots hold (the state a compact pool would need for their contexts)."""
        self._require_initialized()
        return sum(self._held_pages(g) * self._page_bytes(spec) for g, spec in enumerate(self.config.groups))

    def _held_pages(self, g: int) -> int:
        # Pages of group g that slots hold: all but the null page and the free ones (only leased slots
        # hold pages; release and reset return them).
        return self.rings[self._group_layers[g][0]].shape[1] - 1 - len(self._free_pages[g])

    # ----------------------------------------------------------------- pages
    def _pages_needed(self, spec, frames: int) -> int:
        tokens = frames * spec.tokens_per_frame
        return min(-(-tokens // self.page_size), self._pages_per_ring(spec))

    def _reserve(self, targets: dict[int, int]) -> None:
        """Give each slot of ``targets`` (slot -> frames it will have decoded) the pages that context needs.

        Raises:
            PagesExhausted: a group lacks free pages; nothing is allocated then.
        """
        plan = self._extra_by_slot(targets)
        for g, extra in enumerate(plan):
            if sum(extra.values()) > len(self._free_pages[g]):
                raise PagesExhausted(
                    f"group {g} needs {sum(extra.values())} more pages of {self.page_size} tokens for slots "
                    f"{sorted(extra)}; {len(self._free_pages[g])} are free"
                )
        for g, extra in enumerate(plan):
            rows, cols, pages = [], [], []
            free = self._free_pages[g]
            for slot, n in extra.items():
                held = self._host_tables[g][slot]
                taken = free[-n:][::-1]  # the pages n pops would give, in that order (LIFO)
                del free[-n:]
                rows += [slot] * n
                cols += range(len(held), len(held) + n)
                held += taken
                pages += taken
            if rows:
                # One host-to-device copy for the group's new table entries.
                entries = self._ids_to_device(torch.tensor([rows, cols, pages], dtype=torch.long))
                self.page_tables[g].index_put_((entries[0], entries[1]), entries[2])

    def _extra_by_slot(self, targets: dict[int, int]) -> list[dict[int, int]]:
        # Per group, slot -> pages it must still allocate to reach its context in `targets` (slot ->
        # frames after); only the slots that need some.
        plan = []
        for g, spec in enumerate(self.config.groups):
            extra = {s: self._pages_needed(spec, f) - len(self._host_tables[g][s]) for s, f in targets.items()}
            plan.append({s: n for s, n in extra.items() if n > 0})
        return plan

    def _extra_pages(self, targets: dict[int, int]) -> list[int]:
        # Pages each group must still allocate for the slots of `targets` (slot -> frames after).
        return [sum(extra.values()) for extra in self._extra_by_slot(targets)]

    def _pending_pages(self, pending: dict[int, int], decoded: dict[int, int] | None, op: str) -> list[int]:
        # Pages each group must still allocate for the leased slots of `pending` (slot -> frames still to
        # decode) to reach that context; `decoded` (slot -> frames so far) or else their device counters.
        slots = self._leased_ids(pending, op)
        done = self.frames_of(slots) if decoded is None else [int(decoded[s]) for s in slots]
        return self._extra_pages({s: f + int(pending[s]) for s, f in zip(slots, done)})

    def pages_short(self, pending: dict[int, int], decoded: dict[int, int] | None = None) -> bool:
        """Whether some group lacks the free pages the slots of ``pending`` (slot -> frames still to
        decode) need for that context. Without ``decoded`` (slot -> frames decoded so far) it reads
        their frame counters (one small device-to-host copy)."""
        self._require_initialized()
        needs = self._pending_pages(pending, decoded, "pages_short")
        return any(need > free for need, free in zip(needs, self.free_page_counts()))

    def can_admit(
        self,
        frames: int,
        chunk_frames: int,
        pending: dict[int, int] | None = None,
        decoded: dict[int, int] | None = None,
    ) -> bool:
        """A free slot, and in every group the pages of ``frames + chunk_frames`` frames of context
        (a restored stream's rings plus its next chunk; a new stream's first chunk) free after the
        pages the live slots of ``pending`` still need for their chunks (as :meth:`pages_short`)."""
        self._require_initialized()
        if not self.free_slot_count:
            return False
        reserved = self._pending_pages(pending or {}, decoded, "can_admit")
        return all(
            self._pages_needed(spec, frames + chunk_frames) + held <= free
            for spec, held, free in zip(self.config.groups, reserved, self.free_page_counts())
        )

    def room_for_all(self, frames: int, chunk_frames: int) -> bool:
        """In every group, the free pages cover a stream of ``frames + chunk_frames`` frames plus the pages
        every leased slot would still take to fill its rings: O(groups), no per-slot work."""
        self._require_initialized()
        live = len(self._leased)
        for g, spec in enumerate(self.config.groups):
            free, held = len(self._free_pages[g]), self._held_pages(g)
            if free < live * self._pages_per_ring(spec) - held + self._pages_needed(spec, frames + chunk_frames):
                return False
        return True

    def _leased_ids(self, ids, op: str) -> list[int]:
        """``ids`` as ints, each a leased slot; ValueError naming the first that is not."""
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i not in self._leased:
                raise ValueError(
                    f"{op}: slot {i!r} is not a leased slot (0..{self.state_capacity - 1}, acquired and not released)"
                )
            out.append(i)
        return out

    def frames_of(self, slots) -> list[int]:
        """Frames decoded by each of ``slots`` (one small device-to-host copy)."""
        slots = [int(s) for s in slots]
        return self.frames_decoded[torch.tensor(slots, device=self.device)].tolist() if slots else []

    def prepare_step(self, slot_ids, lengths, frames=None) -> None:
        """Allocate the pages a step writes: each slot in ``slot_ids`` (live ids) decoding ``lengths``
        frames (ints) gets pages for the context it will have. Without ``frames`` (the frames each slot
        has decoded so far) it reads the slots' frame counters (one small device-to-host copy).
        Idempotent for one step.

        Raises:
            PagesExhausted: too few free pages in a group; nothing changes then.
        """
        self._require_initialized()
        slot_ids = self._leased_ids([int(s) for s in slot_ids], "prepare_step")
        lengths = [int(n) for n in lengths]
        if not slot_ids:
            return
        frames = self.frames_of(slot_ids) if frames is None else [int(f) for f in frames]
        self._reserve({s: f + n for s, f, n in zip(slot_ids, frames, lengths) if n > 0})

    @torch.no_grad()
    def decode_streaming_batch(self, codes, lengths, state_slot_ids, valid_rows):
        """:meth:`DecoderStatePool.decode_streaming_batch`, allocating the step's pages first.

        Raises:
            PagesExhausted: as :meth:`prepare_step` (before anything changes); otherwise as the base.
        """
        self._require_initialized()
        self._validate(codes, lengths, state_slot_ids, valid_rows)
        live = valid_rows.bool().tolist()
        self.prepare_step(
            [s for s, ok in zip(state_slot_ids.tolist(), live) if ok],
            [n for n, ok in zip(lengths.tolist(), live) if ok],
        )
        return self.decode_streaming_tensors(codes.long(), lengths.long(), state_slot_ids.long(), valid_rows)

    def _reserve_restored(self, slot: int) -> None:
        self._reserve({slot: int(self.frames_decoded[slot])})

    def restore_slot(self, slot: int, state: SlotState) -> None:
        """:meth:`DecoderStatePool.restore_slot` into a leased slot, allocating the pages the state's context
        needs.

        Raises:
            ValueError: as the base, or ``slot`` is not leased. Nothing changes then.
            PagesExhausted: a group lacks the pages for the state's context (counting the pages ``slot``
                holds now, which the restore frees first). Nothing changes then.
        """
        slot = self._live_slot(slot, "restore_slot")
        self._leased_ids([slot], "restore_slot")
        self._check_slot_state(state)
        frames = int(state.offsets.reshape(-1)[0])
        short = [
            g
            for g, spec in enumerate(self.config.groups)
            if self._pages_needed(spec, frames) > len(self._free_pages[g]) + len(self._host_tables[g][slot])
        ]
        if short:
            raise PagesExhausted(
                f"restore_slot: the state's {frames} frames need more pages than group {short[0]} has free "
                f"({len(self._free_pages[short[0]])} free, {len(self._host_tables[short[0]][slot])} held by slot {slot})"
            )
        super().restore_slot(slot, state)

    def _clear_rings(self, ids: torch.Tensor, host_ids: list[int]) -> None:
        for g in range(len(self._group_layers)):
            freed = []
            for slot in host_ids:
                freed += self._host_tables[g][slot]
                self._host_tables[g][slot] = []
            if freed:  # the group's rings (L, 2, pages, H, page, Dh): pages are dim 2
                self._group_rings[g].index_fill_(2, self._ids_to_device(torch.tensor(freed, dtype=torch.long)), 0)
                self._free_pages[g].extend(reversed(freed))
            self.page_tables[g].index_fill_(0, ids, 0)

    # ----------------------------------------------------------------- cells
    def _group_of(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self._group_layers) if layer in layers)

    def _cell_pages(self, layer: int, slot: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.page_tables[self._group_of(layer)][slot]
        cells = cells.to(self.device)
        return table[cells // self.page_size], cells % self.page_size

    def _read_cells(self, layer: int, slot: int, cells: torch.Tensor) -> torch.Tensor:
        pages, rows = self._cell_pages(layer, slot, cells)
        return self.rings[layer][:, pages, :, rows].permute(1, 2, 0, 3)  # (N, 2, H, Dh) -> (2, H, N, Dh)

    def _write_cells(self, layer: int, slot: int, cells: torch.Tensor, values: torch.Tensor) -> None:
        pages, rows = self._cell_pages(layer, slot, cells)
        self.rings[layer][:, pages, :, rows] = values.permute(2, 0, 1, 3)

    # ----------------------------------------------------------------- steps
    def _triton_attention(self, slots, lengths, num_frames: int, start):
        groups = group_steps(self.config, num_frames, lengths)
        tables = {layers.start: table for layers, table in zip(self._group_layers, self.page_tables)}
        attention = CompactTritonRingAttention(
            self.config, self.rings, self.ring_semantics, slots, start, num_frames, page_tables=tables
        )
        return groups, attention


def make_state_pool(
    decoder: CodecDecoder,
    kind: str | None = None,
    dtype: torch.dtype | None = None,
    ring_semantics: str | None = None,
    attention_backend: str | None = None,
    page_fraction: float | None = None,
    state_budget_bytes: int | None = None,
    expected_stream_frames: int | None = None,
) -> DecoderStatePool:
    """The pool for ``decoder``: ``"compact"`` for v2 codecs and ``"legacy"`` for v1 unless ``kind`` says otherwise.

    ``ring_semantics`` and ``attention_backend`` as in :class:`DecoderStatePool`; ``page_fraction``,
    ``state_budget_bytes`` and ``expected_stream_frames`` as in :class:`PagedDecoderStatePool` (``kind="paged"`` only; a budget without a
    ``kind`` picks the paged pool).

    Raises:
        ValueError: unknown ``kind``, ``ring_semantics`` or ``attention_backend``, ``"compact"``
            for a v1 codec, or ``"triton"`` for the legacy pool.
        RuntimeError: ``"triton"`` without the ``triton`` package installed.
    """
    if kind is None and state_budget_bytes is not None:
        kind = "paged"
    kind = kind or ("compact" if decoder.config.version == "v2" else "legacy")
    for name, value in (
        ("page_fraction", page_fraction),
        ("state_budget_bytes", state_budget_bytes),
        ("expected_stream_frames", expected_stream_frames),
    ):
        if value is not None and kind != "paged":
            raise ValueError(f"{name} applies to the paged pool, not to a {kind!r} pool")
    if kind == "compact":
        return CompactDecoderStatePool(decoder, dtype, ring_semantics, attention_backend)
    if kind == "legacy":
        return LegacyDecoderStatePool(decoder, dtype, ring_semantics, attention_backend)
    if kind == "paged":
        return PagedDecoderStatePool(
            decoder,
            dtype,
            ring_semantics,
            attention_backend,
            page_fraction=page_fraction,
            state_budget_bytes=state_budget_bytes,
            expected_stream_frames=expected_stream_frames,
        )
    raise ValueError(f"unknown state pool kind {kind!r}; expected one of {POOL_KINDS}")
