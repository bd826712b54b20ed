# SPDX-License-Identifier: Apache-2.0
"""One streaming step over a pool: ``(n_vq, B, T)`` codes of ``B`` rows -> ``(B, channels, T * spf)`` audio.

The pool is memory (slots, rings, offsets, pages); this module runs the decoder over it.
:func:`decode_tensors` is the tensor-only step (the ``torch.compile`` and CUDA-graph boundary: no validation,
no host syncs, no Python branching on tensor values); :func:`decode_batch` validates its arguments first.
Row ``b`` decodes ``valid_frames[b]`` valid frames of slot ``slot_ids[b]`` when ``valid_rows[b]``; padding rows
(``valid_rows[b]`` False) read the slot the pool routes them to and change nothing it keeps.
"""

from __future__ import annotations

import torch

from .decoder import decode_autocast, run_decoder
from .pool_kinds import pool_kind_record
from .token_packing import TokenPacking

__all__ = ["decode_batch", "decode_tensors", "validate_step"]


def decode_tensors(
    pool, codes, valid_frames, slot_ids, valid_rows, total_frames: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step of ``pool`` on int64 ``codes`` ``(n_vq, B, T)``, int64 ``valid_frames`` ``(B,)``, int64
    ``slot_ids`` ``(B,)`` and bool ``valid_rows`` ``(B,)`` on the pool's device.

    ``total_frames`` (at least the valid rows' frames in all): run every op but the attention on the packed real
    tokens (:mod:`.token_packing`), ``total_frames`` frames of them, instead of the ``B x T`` grid; the same
    audio and state within the GEMMs' rounding.

    Returns:
        ``audio`` ``(B, channels, T * samples_per_frame)`` float32, zero for invalid rows and padding frames,
        and ``audio_lengths`` ``(B,)`` int64 valid samples per channel (``valid_frames * samples_per_frame``, 0
        for invalid rows).
    """
    slots = pool.route(slot_ids, valid_rows)
    valid_frames = torch.where(valid_rows, valid_frames, 0)
    plan = pool.step_plan(slots, valid_frames, codes.shape[-1])
    packing = None
    if total_frames is not None:
        packing = TokenPacking.of(pool.config, valid_frames, codes.shape[-1], total_frames)
        pack = getattr(plan.attention, "pack", None)
        if pack is not None:  # the attention reads the packed tokens itself (the triton backend)
            pack(packing)
    with torch.no_grad(), decode_autocast(pool.decoder):
        audio = run_decoder(pool.decoder, codes, plan, packing)
    audio_lengths = valid_frames * pool.config.samples_per_frame
    sample = torch.arange(audio.shape[-1], device=audio.device)
    audio = torch.where(sample < audio_lengths.view(-1, 1, 1), audio, 0.0)
    return audio, audio_lengths


@torch.no_grad()
def decode_batch(
    pool, codes, valid_frames, slot_ids, valid_rows, total_frames: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_tensors` after :func:`validate_step`, with the pages of a paged pool reserved (and its page
    tables committed) first.

    Args:
        codes: ``(n_vq, B, T)`` integer codes in ``[0, codebook_size)``, on the pool's device.
        valid_frames: ``(B,)`` integer valid frames per row, ``0..T``: frames at or beyond a row's valid frames
            are padding (they change no state); 0 decodes nothing.
        slot_ids: ``(B,)`` int64 slot of each row.
        valid_rows: ``(B,)`` bool; False marks padding rows (their valid frames are ignored).
        total_frames: run every op but the attention on ``total_frames`` packed frames (:func:`decode_tensors`),
            at least the valid rows' frames in all; None: on the ``B x T`` grid.
    Raises:
        ValueError: as :func:`validate_step`, a ``total_frames`` that is not an integer of at least the valid rows'
            frames (and 1), or (paged pools) a valid row's slot that is not in use. Nothing is modified when it raises.
        PagesExhausted: a paged pool lacks the pages of the step (before anything changes).
        RuntimeError: the pool is not initialised.
    """
    pool._require_initialized()
    validate_step(pool, codes, valid_frames, slot_ids, valid_rows)
    if total_frames is not None:
        _check_total_frames(total_frames, valid_frames, valid_rows)
    if pool_kind_record(pool.kind).paged:
        _reserve_pages(pool, slot_ids, valid_frames, valid_rows)
    return decode_tensors(pool, codes.long(), valid_frames.long(), slot_ids.long(), valid_rows, total_frames)


def _check_total_frames(total_frames, valid_frames, valid_rows) -> None:
    least = max(1, int(torch.where(valid_rows, valid_frames, 0).sum()))
    if isinstance(total_frames, bool) or not isinstance(total_frames, int) or total_frames < least:
        raise ValueError(f"total_frames must be an integer >= {least} (the valid rows' frames), got {total_frames!r}")


def _reserve_pages(pool, slot_ids, valid_frames, valid_rows) -> None:
    """Reserve each valid row's context after the step (frames decoded + its valid frames) in the paged ``pool``,
    then commit its page tables (a step of padding rows alone still reads them)."""
    live = [(s, n) for s, n, ok in zip(slot_ids.tolist(), valid_frames.tolist(), valid_rows.tolist()) if ok]
    if live:
        pool.slots.in_use_ids([s for s, _ in live], "decode_batch")
        frames = pool.frames_of([s for s, _ in live])
        pool.reserve({s: f + n for (s, n), f in zip(live, frames)}, strict=True)
    pool.commit_page_tables()


def _check_row_tensors(B: int, valid_frames, slot_ids, valid_rows) -> None:
    for name, t, kind in (
        ("valid_frames", valid_frames, "int"),
        ("state_slot_ids", slot_ids, "int"),
        ("valid_rows", valid_rows, "bool"),
    ):
        if not isinstance(t, torch.Tensor) or t.shape != (B,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape ({B},), got {shape}")
        ok = t.dtype == torch.bool if kind == "bool" else (t.dtype in (torch.int32, torch.int64))
        if not ok:
            raise ValueError(f"{name} must be {'bool' if kind == 'bool' else 'int32/int64'}, got {t.dtype}")


def validate_step(pool, codes, valid_frames, slot_ids, valid_rows) -> None:
    """Check one step's arguments against ``pool`` (one host sync for the row values).

    Raises:
        ValueError: wrong shape, dtype or device; a code out of range; a valid row's length outside ``0..T``
            (naming the row, the length and ``T``); a slot id out of range; duplicate slot ids among valid
            rows; padding rows on slots the pool's padding policy does not allow.
    """
    pool.decoder.validate_codes(codes)
    _, B, T = codes.shape
    if B < 1 or T < 1:
        raise ValueError(f"codes must have B >= 1 rows and T >= 1 frames, got shape {tuple(codes.shape)}")
    _check_row_tensors(B, valid_frames, slot_ids, valid_rows)
    for name, t in (
        ("codes", codes),
        ("valid_frames", valid_frames),
        ("state_slot_ids", slot_ids),
        ("valid_rows", valid_rows),
    ):
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device}, the pool is on {pool.device}")
    ids, valid = slot_ids.tolist(), valid_rows.tolist()
    for b, n in enumerate(valid_frames.tolist()):
        if valid[b] and not 0 <= n <= T:
            raise ValueError(f"valid_frames[{b}] = {n} is outside 0..{T} (T = frames in this step)")
    live = [i for i, v in zip(ids, valid) if v]
    for i in live:
        if not 0 <= i < pool.state_capacity:
            raise ValueError(f"slot id {i} of a valid row is outside the live slots 0..{pool.state_capacity - 1}")
    dupes = sorted({i for i in live if live.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate slot ids among valid rows: {dupes}")
    pool.check_padding([i for i, v in zip(ids, valid) if not v])
