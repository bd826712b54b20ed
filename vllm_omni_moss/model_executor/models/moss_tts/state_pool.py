# SPDX-License-Identifier: Apache-2.0
"""Slot-addressed decoder state pools for many live streams.

A pool owns every persistent streaming tensor: one K/V ring per attention layer,
``(2, S, H, C, Dh)``, and the offsets. Execution batches are compact: row ``b`` of a
step decodes for slot ``state_slot_ids[b]`` when ``valid_rows[b]``; invalid rows are
CUDA-graph padding. Two pools share one interface and are chosen once, at
construction, by :func:`make_state_pool`:

``LegacyDecoderStatePool`` - vLLM-Omni 0.30.0's behaviour (codec-facts §B.3-§B.8):
    ``state_capacity + scratch_capacity`` slots (one scratch slot per graph padding
    row); per-layer attention offsets and ring end offsets plus per-group offsets in
    one ``(R, S)`` int64 bank (``R = 2 L + G`` for v2, ``L`` for v1); every layer
    gathers its offsets, rebuilds its metadata, gathers the complete ring, scatters
    the chunk and writes the whole ring back for every row. The default for v1 codecs
    (with v1's exact ring); the baseline for v2.

``V2DecoderStatePool`` - the default for v2 codecs, no switch of any kind:
    ``state_capacity + 1`` slots whatever scratch is asked for; slot
    ``state_capacity`` is the *null slot*: never leased, all zeros forever, the
    target of every invalid row. Offsets are one frame counter per slot: every
    group's token offset is ``frames * tokens_per_frame`` (all rows of a step share
    ``T`` frames, so this equals the per-layer offsets of the legacy pool exactly).
    Ring metadata and RoPE tables are built once per group per step and read by all
    its layers. Persistent writes go through the ``commit_cache`` /
    ``commit_offsets`` custom ops: only ring cells the chunk touched, only for valid
    rows - invalid rows never write, not even to the null slot. The frame counters
    advance once, after the last group. The reference scatter, physical key order
    and native SDPA are kept, so audio and live state are bit-identical to the legacy
    pool.

Both pools clear a slot's rings on :meth:`reset` as well as its offsets. Upstream
only zeroes offsets, which hides stale keys behind the mask - but SDPA still
multiplies masked values by a zero weight, so a non-finite value left by an
earlier stream would turn into NaN audio for the next one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from . import step_metadata
from .decoder import CodecDecoder, _autocast, ring_attend, run_decoder
from .kernels import commit_cache, commit_offsets

__all__ = [
    "DecoderStatePool",
    "LegacyDecoderStatePool",
    "V2DecoderStatePool",
    "make_state_pool",
    "state_bytes_for",
]


def state_bytes_for(decoder_config, num_slots: int, kind: str, element_size: int = 2) -> int:
    """Persistent bytes of a pool with ``num_slots`` slots (rings plus offsets), without allocating.

    ``kind`` is ``"legacy"`` or ``"v2"``. v2 rings of one slot are 88,678,400 bytes in bf16.
    """
    rings = num_slots * decoder_config.state_bytes_per_slot(element_size)
    if kind == "v2":
        return rings + num_slots * 8
    return rings + _legacy_bank_rows(decoder_config) * num_slots * 8


def _check_count(count) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"padding row count must be an integer >= 0, got {count!r}")


def _legacy_bank_rows(config) -> int:
    # v2 keeps an attention offset and a ring end offset per layer plus one offset per
    # group; v1 keeps one offset per attention layer (codec-facts §B.3, §B.10).
    if config.version == "v2":
        return 2 * config.num_layers + len(config.groups)
    return config.num_layers


class DecoderStatePool(ABC):
    """Interface shared by the legacy and V2 pools.

    Args:
        decoder: the weights; the pool never modifies them.
        dtype: ring dtype; defaults to ``decoder.state_dtype`` (bf16 on CUDA).
    """

    kind: str = ""

    def __init__(self, decoder: CodecDecoder, dtype: torch.dtype | None = None):
        self.decoder = decoder
        self.config = decoder.config
        self.dtype = dtype or decoder.state_dtype
        if not self.dtype.is_floating_point:
            raise ValueError(f"ring dtype must be a floating-point dtype, got {self.dtype}")
        self.device = decoder.device
        self.rings: list[torch.Tensor] = []
        self.state_capacity = 0
        self.num_slots = 0
        layer_group = []
        for g, spec in enumerate(self.config.groups):
            layer_group += [g] * spec.num_layers
        self._layer_group = layer_group

    # ----------------------------------------------------------------- lifecycle
    @property
    def initialized(self) -> bool:
        return bool(self.rings)

    def initialize(self, state_capacity: int, scratch_capacity: int = 0) -> None:
        """Allocate state for ``state_capacity`` live slots (ids ``0..state_capacity-1``).

        Raises:
            ValueError: ``state_capacity < 1`` or ``scratch_capacity < 0``.
            RuntimeError: already initialised (call :meth:`close` first).
        """
        if self.initialized:
            raise RuntimeError(f"{type(self).__name__} is already initialised; close() it before re-initialising")
        if isinstance(state_capacity, bool) or not isinstance(state_capacity, int) or state_capacity < 1:
            raise ValueError(f"state_capacity must be an integer >= 1, got {state_capacity!r}")
        if isinstance(scratch_capacity, bool) or not isinstance(scratch_capacity, int) or scratch_capacity < 0:
            raise ValueError(f"scratch_capacity must be an integer >= 0, got {scratch_capacity!r}")
        self.state_capacity = state_capacity
        self.num_slots = self._slots_for(state_capacity, scratch_capacity)
        try:
            self.rings = [
                torch.zeros(2, self.num_slots, s.num_heads, s.context, s.head_dim, device=self.device, dtype=self.dtype)
                for s in self.config.groups
                for _ in range(s.num_layers)
            ]
            self._allocate_offsets()
        except (RuntimeError, MemoryError) as exc:  # out of memory: leave the pool as it was
            need = state_bytes_for(
                self.config, self.num_slots, self.kind, torch.empty((), dtype=self.dtype).element_size()
            )
            self.close()
            raise RuntimeError(
                f"cannot allocate decoder state for {state_capacity} live streams ({need} bytes on {self.device}): {exc}"
            ) from exc

    def close(self) -> None:
        """Drop all state. The pool can be initialised again, with another capacity."""
        self.rings = []
        self.state_capacity = 0
        self.num_slots = 0
        self._drop_offsets()

    def state_bytes(self) -> int:
        """Bytes of persistent state actually allocated (rings plus offsets)."""
        return sum(t.numel() * t.element_size() for t in self.rings + self._offset_tensors())

    def reset(self, slot_ids) -> None:
        """Forget the streams in ``slot_ids``: offsets to 0 and rings cleared.

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
        ids = ids.to(self.device)
        for ring in self.rings:
            ring.index_fill_(1, ids, 0)
        self._reset_offsets(ids)

    # ----------------------------------------------------------------- decode
    @torch.no_grad()
    def decode_streaming_batch(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor,
        state_slot_ids: torch.Tensor,
        valid_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated streaming step.

        Args:
            codes: ``(n_vq, B, T)`` integer codes in ``[0, codebook_size)``, on the pool's device.
            lengths: ``(B,)`` integer frames of real audio per row (``0..T``).
            state_slot_ids: ``(B,)`` int64 slot of each row.
            valid_rows: ``(B,)`` bool; False marks padding rows.
        Returns:
            ``audio`` ``(B, channels, T * samples_per_frame)`` float32 (zeros for invalid
            rows) and ``audio_lengths`` ``(B,)`` int64 samples per channel.
        Raises:
            ValueError: wrong shape, dtype or device; code out of range; slot id out of
                range; duplicate slot ids among valid rows; legacy padding rows not on
                distinct scratch slots. Nothing is modified when it raises.
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
        with torch.no_grad(), _autocast(self.device):
            audio = run_decoder(self.decoder, codes, self._plan(slots, valid_rows, codes.shape[-1]))
        audio = torch.where(valid_rows.view(-1, 1, 1), audio, torch.zeros((), dtype=audio.dtype, device=audio.device))
        audio_lengths = torch.where(valid_rows, lengths * self.config.samples_per_frame, 0)
        return audio, audio_lengths

    # ----------------------------------------------------------------- inspection
    def slot_state(self, slot: int) -> dict[str, object]:
        """Copy of one slot's state: ``rings`` (per layer ``(2, H, C, Dh)``) and
        ``layer_offsets`` (``(L,)`` int64 token offset of each attention layer)."""
        self._require_initialized()
        return {
            "rings": [ring[:, slot].clone() for ring in self.rings],
            "layer_offsets": self._layer_offsets(slot),
        }

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        """Slot ids for ``count`` graph padding rows (legacy: distinct scratch slots; V2: the null slot)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- helpers
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
        lens = lengths.tolist()
        for b, n in enumerate(lens):
            if not 0 <= n <= T:
                raise ValueError(f"lengths[{b}] = {n} is outside 0..{T} (T = frames in this step)")
        ids, valid = slot_ids.tolist(), valid_rows.tolist()
        live = [i for i, v in zip(ids, valid) if v]
        for i in live:
            if not 0 <= i < self.state_capacity:
                raise ValueError(f"slot id {i} of a valid row is outside the live slots 0..{self.state_capacity - 1}")
        dupes = sorted({i for i in live if live.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate slot ids among valid rows: {dupes}")
        self._validate_padding([i for i, v in zip(ids, valid) if not v])

    def _validate_padding(self, padding_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Check the slot ids of invalid rows; the V2 pool accepts any (they read the null slot)."""

    @abstractmethod
    def _slots_for(self, state_capacity: int, scratch_capacity: int) -> int: ...

    @abstractmethod
    def _allocate_offsets(self) -> None: ...

    @abstractmethod
    def _drop_offsets(self) -> None: ...

    @abstractmethod
    def _offset_tensors(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def _reset_offsets(self, ids: torch.Tensor) -> None: ...

    @abstractmethod
    def _resettable_limit(self) -> int: ...

    @abstractmethod
    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _plan(self, slots: torch.Tensor, valid_rows: torch.Tensor, frames: int): ...

    @abstractmethod
    def _layer_offsets(self, slot: int) -> torch.Tensor: ...


# =============================================================================== legacy


class LegacyDecoderStatePool(DecoderStatePool):
    """vLLM-Omni 0.30.0's pool: scratch slots for padding rows, per-layer offsets, whole-ring write-back."""

    kind = "legacy"

    def _slots_for(self, state_capacity: int, scratch_capacity: int) -> int:
        self.scratch_capacity = scratch_capacity
        return state_capacity + scratch_capacity

    def _allocate_offsets(self) -> None:
        # Row layout as upstream: v2 lists, per group, (attention offset, ring end
        # offset) for each layer and then the group's own offsets; v1 one row per layer.
        self._layer_rows: list[tuple[int, int]] = []
        self._group_rows: list[int] = []
        row = 0
        for spec in self.config.groups:
            for _ in range(spec.num_layers):
                if self.config.version == "v2":
                    self._layer_rows.append((row, row + 1))
                    row += 2
                else:
                    self._layer_rows.append((row, row))
                    row += 1
            if self.config.version == "v2":
                self._group_rows.append(row)
                row += 1
        assert row == _legacy_bank_rows(self.config)
        self.bank = torch.zeros(row, self.num_slots, dtype=torch.long, device=self.device)

    def _drop_offsets(self) -> None:
        self.bank = None

    def _offset_tensors(self) -> list[torch.Tensor]:
        return [self.bank] if getattr(self, "bank", None) is not None else []

    def _reset_offsets(self, ids: torch.Tensor) -> None:
        self.bank.index_fill_(1, ids, 0)  # every offset of these slots in one kernel

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

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        self._require_initialized()
        _check_count(count)
        if count > self.scratch_capacity:
            raise ValueError(f"{count} padding rows need {count} scratch slots; this pool has {self.scratch_capacity}")
        return torch.arange(self.state_capacity, self.state_capacity + count, device=self.device)

    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        return slot_ids

    def _plan(self, slots, valid_rows, frames):
        return _LegacyPlan(self, slots, valid_rows)

    def _bank_rows(self, layer: int) -> tuple[int, int]:
        """Bank rows of a layer: (attention offset, ring end offset); one shared row for v1."""
        return self._layer_rows[layer]

    def _layer_offsets(self, slot: int) -> torch.Tensor:
        return torch.stack([self.bank[self._bank_rows(i)[0], slot] for i in range(self.config.num_layers)]).cpu()


class _LegacyPlan:
    """One legacy step: every layer gathers its offsets and builds its own metadata."""

    def __init__(self, pool: LegacyDecoderStatePool, slots: torch.Tensor, valid: torch.Tensor):
        self.pool, self.slots, self.valid = pool, slots, valid

    def group(self, g: int, n_tokens: int):
        pool, cfg = self.pool, self.pool.config
        spec = cfg.groups[g]
        first = cfg.group_first_layers[g]

        def attend(i, q, k, v):
            li = first + i
            attn_row, ring_row = pool._bank_rows(li)
            offsets = pool.bank[attn_row].index_select(0, self.slots)
            meta = step_metadata.build_ring_metadata(
                offsets, self.valid, n_tokens, spec.context, spec.context, cfg.version, spec.head_dim, spec.max_period
            )
            ring = pool.rings[li]
            rows = ring.index_select(1, self.slots)
            out = ring_attend(cfg.version, rows, meta, q, k, v)
            ring.index_copy_(1, self.slots, rows)
            pool.bank[attn_row].index_copy_(0, self.slots, meta.next_offsets)
            if ring_row != attn_row:
                pool.bank[ring_row].index_copy_(0, self.slots, meta.next_offsets)
            if i == spec.num_layers - 1 and cfg.version == "v2":
                group_row = pool._group_rows[g]
                group_offsets = pool.bank[group_row].index_select(0, self.slots)
                advanced = torch.where(self.valid, group_offsets + n_tokens, group_offsets)
                pool.bank[group_row].index_copy_(0, self.slots, advanced)
            return out

        return attend

    def finish(self) -> None:
        pass


# =============================================================================== V2


class V2DecoderStatePool(DecoderStatePool):
    """One slot per live stream plus a read-only null slot; shared group metadata; masked commits.

    Offsets: ``frames`` ``(S,)`` int64, code frames decoded per slot since reset. The
    token offset of group ``g`` is ``frames * tokens_per_frame[g]``.
    """

    kind = "v2"

    def __init__(self, decoder: CodecDecoder, dtype: torch.dtype | None = None):
        if decoder.config.version != "v2":
            raise ValueError(
                f"the V2 pool serves v2 codecs; this codec is {decoder.config.version} and keeps the legacy pool"
            )
        super().__init__(decoder, dtype)

    @property
    def null_slot(self) -> int:
        """Id of the null slot (``state_capacity``): all zeros, never leased, never written."""
        self._require_initialized()
        return self.state_capacity

    def _slots_for(self, state_capacity: int, scratch_capacity: int) -> int:
        # Whatever scratch the caller asks for, all padding rows share the one null slot.
        self.scratch_capacity = 1
        return state_capacity + 1

    def _allocate_offsets(self) -> None:
        self.frames = torch.zeros(self.num_slots, dtype=torch.long, device=self.device)

    def _drop_offsets(self) -> None:
        self.frames = None

    def _offset_tensors(self) -> list[torch.Tensor]:
        return [self.frames] if getattr(self, "frames", None) is not None else []

    def _reset_offsets(self, ids: torch.Tensor) -> None:
        self.frames.index_fill_(0, ids, 0)

    def _resettable_limit(self) -> int:
        return self.state_capacity  # the null slot is never written, not even by reset

    def padding_slot_ids(self, count: int) -> torch.Tensor:
        _check_count(count)
        return torch.full((count,), self.null_slot, dtype=torch.long, device=self.device)

    def _route(self, slot_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        # Invalid rows read the null slot whatever id they carry (even out of range).
        return torch.where(valid_rows, slot_ids, self.state_capacity)

    def _plan(self, slots, valid_rows, frames):
        return _V2Plan(self, slots, valid_rows, frames)

    def _layer_offsets(self, slot: int) -> torch.Tensor:
        f = self.frames[slot].cpu()
        return torch.stack([f * self.config.groups[g].tokens_per_frame for g in self._layer_group])


class _V2Plan:
    """One V2 step: metadata once per group, masked touched-cell commits, one offset commit."""

    def __init__(self, pool: V2DecoderStatePool, slots: torch.Tensor, valid: torch.Tensor, frames: int):
        self.pool, self.slots, self.valid, self.frames = pool, slots, valid, frames
        self.start_frames = pool.frames.index_select(0, slots)

    def group(self, g: int, n_tokens: int):
        pool, cfg = self.pool, self.pool.config
        spec = cfg.groups[g]
        first = cfg.group_first_layers[g]
        meta = step_metadata.build_ring_metadata(
            self.start_frames * spec.tokens_per_frame,
            self.valid,
            n_tokens,
            spec.context,
            spec.context,
            cfg.version,
            spec.head_dim,
            spec.max_period,
        )

        def attend(i, q, k, v):
            ring = pool.rings[first + i]
            rows = ring.index_select(1, self.slots)
            out = ring_attend(cfg.version, rows, meta, q, k, v)
            commit_cache(rows, ring, self.slots, self.valid, meta.offsets, n_tokens)
            return out

        return attend

    def finish(self) -> None:
        commit_offsets(self.start_frames + self.frames, self.pool.frames, self.slots, self.valid)


def make_state_pool(
    decoder: CodecDecoder, kind: str | None = None, dtype: torch.dtype | None = None
) -> DecoderStatePool:
    """The pool for ``decoder``: ``"v2"`` for v2 codecs and ``"legacy"`` for v1 unless ``kind`` says otherwise.

    Raises:
        ValueError: unknown ``kind``, or ``"v2"`` for a v1 codec.
    """
    kind = kind or ("v2" if decoder.config.version == "v2" else "legacy")
    if kind == "v2":
        return V2DecoderStatePool(decoder, dtype)
    if kind == "legacy":
        return LegacyDecoderStatePool(decoder, dtype)
    raise ValueError(f"unknown state pool kind {kind!r}; expected 'v2' or 'legacy'")
