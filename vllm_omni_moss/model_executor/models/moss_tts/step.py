# SPDX-License-Identifier: Apache-2.0
"""One streaming step over a pool: the packed codes of ``R`` rows -> their packed audio.

The pool is memory (slots, rings, offsets, pages); this module runs the decoder over it. Every step is packed
(``token_packing.py``): :func:`decode_tensors` is the tensor-only step (the ``torch.compile`` and CUDA-graph
boundary: no validation, no host syncs, no Python branching on tensor values) on ``(n_vq, F)`` packed codes;
:func:`decode_batch` is the validated step of the public API on a ``(n_vq, B, T)`` grid of codes, which it packs
and whose audio it unpacks. Row ``b`` decodes ``valid_frames[b]`` valid frames of slot ``slot_ids[b]`` when
``valid_rows[b]``; padding rows (``valid_rows[b]`` False) read the slot the pool routes them to and change nothing
it keeps.
"""

from __future__ import annotations

import torch

from .attention import step_plan
from .decoder import decode_autocast, run_decoder
from .pool_kinds import pool_kind_record
from .token_packing import TokenPacking, pack_codes, unpack_audio

__all__ = ["decode_batch", "decode_tensors", "validate_step"]


def decode_tensors(pool, codes, valid_frames, slot_ids, valid_rows, frames: int) -> torch.Tensor:
    """The step of ``pool`` on int64 packed ``codes`` ``(n_vq, F)``, int64 ``valid_frames`` ``(R,)``, int64
    ``slot_ids`` ``(R,)`` and bool ``valid_rows`` ``(R,)`` on the pool's device; ``frames`` = ``T``, at least
    every valid row's frames.

    ``codes`` holds the valid rows' frames one after another in row order (an invalid row holds none), then
    dummy frames up to ``F`` (:mod:`.token_packing`).

    Returns:
        ``(channels, F x samples_per_frame)`` float32 packed audio: row ``b``'s samples start at sample
        ``row_start x samples_per_frame`` (its valid frames' exclusive prefix sum); the dummies' samples are
        unspecified.
    """
    slots = pool.route(slot_ids, valid_rows)
    valid_frames = torch.where(valid_rows, valid_frames, 0)
    packing = TokenPacking.of(pool.config, valid_frames, frames, codes.shape[-1])
    plan = step_plan(pool, slots, valid_frames, packing)
    with torch.no_grad(), decode_autocast(pool.decoder):
        return run_decoder(pool.decoder, codes, plan, packing)


@torch.no_grad()
def decode_batch(
    pool, codes, valid_frames, slot_ids, valid_rows, total_frames: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_tensors` on a ``(n_vq, B, T)`` grid of codes, after :func:`validate_step`, with the pages of
    a paged pool reserved (and its page tables committed) first: the grid is packed (:func:`~.token_packing.
    pack_codes`) and the audio unpacked.

    Args:
        codes: ``(n_vq, B, T)`` integer codes in ``[0, codebook_size)``, on the pool's device.
        valid_frames: ``(B,)`` integer valid frames per row, ``0..T``: frames at or beyond a row's valid frames
            are padding (they change no state); 0 decodes nothing.
        slot_ids: ``(B,)`` int64 slot of each row.
        valid_rows: ``(B,)`` bool; False marks padding rows (their valid frames are ignored).
        total_frames: packed frames of the step, at least the valid rows' frames in all (the rest dummies);
            None: exactly those (at least 1).
    Returns:
        ``audio`` ``(B, channels, T * samples_per_frame)`` float32, zero for invalid rows and padding frames,
        and ``audio_lengths`` ``(B,)`` int64 valid samples per channel (``valid_frames * samples_per_frame``, 0
        for invalid rows).
    Raises:
        ValueError: as :func:`validate_step`, a ``total_frames`` that is not an integer of at least the valid rows'
            frames (and 1), or (paged pools) a valid row's slot that is not in use. Nothing is modified when it raises.
        PagesExhausted: a paged pool lacks the pages of the step (before anything changes).
        RuntimeError: the pool is not initialised.
    """
    pool.require_initialized()
    validate_step(pool, codes, valid_frames, slot_ids, valid_rows)
    least = max(1, int(torch.where(valid_rows, valid_frames, 0).sum()))
    if total_frames is None:
        total_frames = least
    _check_total_frames(total_frames, least)
    if pool_kind_record(pool.kind).paged:
        _reserve_pages(pool, slot_ids, valid_frames, valid_rows)
    T = codes.shape[-1]
    valid_frames = torch.where(valid_rows, valid_frames.long(), 0)
    packed = pack_codes(codes.long(), valid_frames, total_frames)
    audio = decode_tensors(pool, packed, valid_frames, slot_ids.long(), valid_rows, T)
    spf = pool.config.samples_per_frame
    return unpack_audio(audio, valid_frames, T, spf), valid_frames * spf


def _check_total_frames(total_frames, least: int) -> None:
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
