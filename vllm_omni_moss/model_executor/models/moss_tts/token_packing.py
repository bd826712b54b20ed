# SPDX-License-Identifier: Apache-2.0
"""Packed tokens, the one layout of a step: the valid frames of every row, one after another.

A step of ``R`` rows, at most ``T`` frames a row, holds ``F`` packed frames (``graph_ladder.StepShape``): row
``b``'s ``valid_frames[b]`` frames start at packed frame ``row_starts[b]`` (rows in order, no gaps), and the
``F - sum(valid_frames)`` frames after the last row are dummies. Every op of the decoder except the ring attention
works on each token alone (embedding, projections, LayerNorm, FFN, the upsamplers, which turn one token into
``factor`` consecutive ones, and the audio head), so they run on the ``F`` packed frames and pay for no padding;
the ring attention reads each row from its start (``ops/ring_attention_packed.py``). Packing order is row-major,
which each upsampler keeps, so one frame-level layout gives every group's: at level ``g`` row ``b`` starts at token
``row_starts[b] x tokens_per_frame[g]``.

Dummies hold code 0, never reach a real token (no op mixes tokens except the attention, which reads only rows'
valid tokens) and their audio is never read. The ``(R, T)`` grid exists only where a reference attention reads it
(:meth:`TokenPacking.to_rows`, :meth:`TokenPacking.to_tokens`) and in :func:`pack_codes` / :func:`unpack_audio`,
which turn a grid step of the validated API (``step.decode_batch``) into a packed one and back. Everything here is
tensor code without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CodecConfig

__all__ = ["TokenPacking", "pack_codes", "unpack_audio"]


def _owners(valid_frames: torch.Tensor, total_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Per packed frame: its row (R for a dummy) and its frame within the row; and each row's first packed frame.
    R, device = valid_frames.shape[0], valid_frames.device
    dummies = (total_frames - valid_frames.sum()).clamp(min=0).view(1)
    counts = torch.cat([valid_frames, dummies])
    owner = torch.repeat_interleave(torch.arange(R + 1, device=device), counts, output_size=total_frames)
    starts = torch.cumsum(counts, 0) - counts
    return owner, torch.arange(total_frames, device=device) - starts[owner], starts[:R]


@dataclass(frozen=True)
class TokenPacking:
    """Where the packed tokens of one step sit.

    Attributes:
        rows: ``R``.
        frames: ``T``, the most frames of a row.
        total_frames: ``F``, packed frames (dummies included).
        tokens_per_frame: each group's tokens per frame (``GroupSpec.tokens_per_frame``), then the audio head's
            (after the last group's upsampler): one level per group and one more.
        row_starts: ``(R,)`` int64 packed frame where each row's frames start.
        grid: per level, ``(F x tokens_per_frame,)`` int64 position of each packed token in the ``(R, T x tpf)``
            grid, dummies at ``R x T x tpf`` (one past the grid: a dump cell).
        read: the same with dummies at 0 (a position they may read).

    The embedding runs at one token per frame, group 0's rate (``tokens_per_frame`` 1 in every codec config).
    """

    rows: int
    frames: int
    total_frames: int
    tokens_per_frame: tuple[int, ...]
    row_starts: torch.Tensor
    grid: tuple[torch.Tensor, ...]
    read: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, config: CodecConfig, valid_frames: torch.Tensor, frames: int, total_frames: int) -> TokenPacking:
        """The packing of a step whose rows hold ``valid_frames`` (``(R,)`` int64, each ``0..frames``) valid
        frames, packed into ``total_frames >= sum(valid_frames)`` frames (the rest dummies)."""
        R = valid_frames.shape[0]
        owner, position, starts = _owners(valid_frames, total_frames)
        real = owner < R
        frame_grid = owner * frames + position
        rates = [g.tokens_per_frame for g in config.groups]
        rates.append(rates[-1] * config.groups[-1].upsample)  # the audio head's tokens after the last upsampler
        grids, reads = [], []
        for f in rates:
            tokens = (frame_grid.view(-1, 1) * f + torch.arange(f, device=valid_frames.device)).view(-1)
            keep = real.repeat_interleave(f)
            grids.append(torch.where(keep, tokens, R * frames * f))
            reads.append(torch.where(keep, tokens, 0))
        return cls(R, frames, total_frames, tuple(rates), starts, tuple(grids), tuple(reads))

    def token_starts(self, level: int) -> torch.Tensor:
        """``(R,)`` int64 first packed token of each row at level ``level``."""
        return self.row_starts * self.tokens_per_frame[level]

    def to_tokens(self, level: int, x: torch.Tensor) -> torch.Tensor:
        """``(R, T_g, C)`` grid values of level ``level`` -> ``(1, N_g, C)`` packed tokens."""
        R, T, C = x.shape
        return x.reshape(R * T, C).index_select(0, self.read[level]).view(1, -1, C)

    def to_rows(self, level: int, x: torch.Tensor) -> torch.Tensor:
        """``(1, N_g, C)`` packed tokens of level ``level`` -> ``(R, T_g, C)``, zero where no real token is."""
        C = x.shape[-1]
        cells = self.rows * self.frames * self.tokens_per_frame[level]
        out = x.new_zeros(cells + 1, C)
        out.index_copy_(0, self.grid[level], x.reshape(-1, C))
        return out[:cells].view(self.rows, -1, C)


def pack_codes(codes: torch.Tensor, valid_frames: torch.Tensor, total_frames: int) -> torch.Tensor:
    """``(n_vq, R, T)`` grid codes -> ``(n_vq, F)`` packed codes: each row's first ``valid_frames[b]`` frames in
    row order, then code 0 up to ``total_frames`` (``>= sum(valid_frames)``)."""
    n_vq, R, T = codes.shape
    owner, position, _ = _owners(valid_frames, total_frames)
    # Dummies read a zero column past the grid (the grid may be empty: a step of padding rows alone).
    grid = torch.cat([codes.reshape(n_vq, R * T), codes.new_zeros(n_vq, 1)], dim=1)
    return grid.index_select(1, torch.where(owner < R, owner * T + position, R * T))


def unpack_audio(audio: torch.Tensor, valid_frames: torch.Tensor, frames: int, samples_per_frame: int) -> torch.Tensor:
    """``(channels, F x spf)`` packed audio -> ``(R, channels, T x spf)``: row ``b``'s ``valid_frames[b]`` frames of
    samples, zero after them."""
    C = audio.shape[0]
    R = valid_frames.shape[0]
    owner, position, _ = _owners(valid_frames, audio.shape[-1] // samples_per_frame)
    frames_of = audio.view(C, -1, samples_per_frame).transpose(0, 1)  # (F, C, spf)
    out = audio.new_zeros(R * frames + 1, C, samples_per_frame)
    out.index_copy_(0, torch.where(owner < R, owner * frames + position, R * frames), frames_of)
    grid = out[: R * frames].view(R, frames, C, samples_per_frame).permute(0, 2, 1, 3)
    return grid.reshape(R, C, frames * samples_per_frame)
