# SPDX-License-Identifier: Apache-2.0
"""Packed tokens of a ragged step: the real tokens of every row, one after another, for the GEMMs.

A step of ``B`` rows and ``T`` frames holds ``B x T x tokens_per_frame`` token positions per resolution group,
but row ``b`` has only ``valid_frames[b]`` real frames. Every op of the decoder except the ring attention works
on each token alone (embedding, projections, LayerNorm, FFN, the upsamplers, which turn one token into
``factor`` consecutive ones, and the audio head), so those run on the packed real tokens and pay for no
padding frame; the attention reads its rows in the ``(B, T)`` grid as before (:meth:`TokenPacking.to_rows`)
and its output is packed again (:meth:`TokenPacking.to_tokens`).

Packing order is row-major (row 0's tokens, then row 1's ...), which each upsampler keeps, so one frame-level
layout gives every group's. ``total_frames`` fixes the packed length (a CUDA graph needs it static): the
``total_frames - sum(valid_frames)`` tokens after the real ones are dummies that read grid position 0 and write
a dump row, so their values never reach a real token. Everything is tensor code without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CodecConfig

__all__ = ["TokenPacking"]


@dataclass(frozen=True)
class TokenPacking:
    """Where each packed token of one step sits in the ``(B, T x tokens_per_frame)`` grid of each group.

    Attributes:
        rows: ``B``.
        frames: ``T``, frames per row of the grid.
        tokens_per_frame: each group's tokens per frame (``GroupSpec.tokens_per_frame``), then the audio head's
            (after the last group's upsampler): one level per group and one more.
        grid: per level, ``(total_frames x tokens_per_frame,)`` int64 grid positions of the packed tokens, dummies
            at ``B x T x tokens_per_frame`` (the dump row).
        read: the same with dummies at 0 (a position they may read).
        row_starts: ``(B,)`` int64 packed frame where each row's frames start (its token at level ``g``:
            ``row_starts x tokens_per_frame[g]``); rows lie one after another, dummies after the last.

    The embedding runs at one token per frame, group 0's rate (``tokens_per_frame`` 1 in every codec config).
    """

    rows: int
    frames: int
    tokens_per_frame: tuple[int, ...]
    grid: tuple[torch.Tensor, ...]
    read: tuple[torch.Tensor, ...]
    row_starts: torch.Tensor

    @classmethod
    def of(cls, config: CodecConfig, valid_frames: torch.Tensor, frames: int, total_frames: int) -> TokenPacking:
        """The packing of a step whose rows hold ``valid_frames`` (``(B,)`` int64, each ``0..frames``) real
        frames, packed into ``total_frames >= sum(valid_frames)`` frames (the rest dummies)."""
        B, device = valid_frames.shape[0], valid_frames.device
        dummies = (total_frames - valid_frames.sum()).clamp(min=0).view(1)
        counts = torch.cat([valid_frames, dummies])
        owner = torch.repeat_interleave(torch.arange(B + 1, device=device), counts, output_size=total_frames)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(total_frames, device=device) - starts[owner]
        real = owner < B
        frame_grid = owner * frames + position
        grids, reads = [], []
        rates = [g.tokens_per_frame for g in config.groups]
        rates.append(rates[-1] * config.groups[-1].upsample)  # the audio head's tokens after the last upsampler
        for f in rates:
            tokens = (frame_grid.view(-1, 1) * f + torch.arange(f, device=device)).view(-1)
            keep = real.repeat_interleave(f)
            grids.append(torch.where(keep, tokens, B * frames * f))
            reads.append(torch.where(keep, tokens, 0))
        return cls(B, frames, tuple(rates), tuple(grids), tuple(reads), starts[:B])

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``(n_vq, B, T)`` codes -> ``(n_vq, 1, N_0)``: the codes of the packed frames, for the embedding."""
        n_vq, B, T = codes.shape
        return codes.reshape(n_vq, B * T).index_select(1, self.read[0]).view(n_vq, 1, -1)

    def to_tokens(self, group: int, x: torch.Tensor) -> torch.Tensor:
        """``(B, T_g, C)`` grid values of group ``group`` -> ``(1, N_g, C)`` packed tokens."""
        B, T, C = x.shape
        return x.reshape(B * T, C).index_select(0, self.read[group]).view(1, -1, C)

    def to_rows(self, group: int, x: torch.Tensor) -> torch.Tensor:
        """``(1, N_g, C)`` packed tokens of group ``group`` -> ``(B, T_g, C)``, zero where no real token is."""
        C = x.shape[-1]
        cells = self.rows * self.frames * self.tokens_per_frame[group]
        out = x.new_zeros(cells + 1, C)
        out.index_copy_(0, self.grid[group], x.reshape(-1, C))
        return out[:cells].view(self.rows, -1, C)
