# SPDX-License-Identifier: Apache-2.0
"""A step's inputs on their way to the device: codes packed and clamped, slot ids, valid frames and valid rows,
staged through page-locked host buffers that every step reuses (:class:`StepInputs`).

A graph step's inputs go from those buffers straight into the input tensors of the graph that replays it, one
copy each; an eager step's become tensors of their own on the pool's device. The buffers are overwritten only once
the device has read the previous step's copies from them (a CUDA event), since a call waits for the device once,
at its end.

Codes from the host (as Stage 0 sends them) are packed, checked and clamped with NumPy, on the caller's thread:
an ATen CPU op on a step's codes (36,864 of them at 512 rows of 6 frames, past ATen's 32,768-element grain)
would run on the intra-op thread pool, whose wake-up, on a host shared with other work, cost tens of milliseconds
before a step could launch (34-36 ms p50 on two busy cores against 0.5-0.8 ms with NumPy; on the GPU machine the
two measured the same: ``benchmarks/history/03f269d.md``).
"""

from __future__ import annotations

import numpy as np
import torch

from .counters import SessionCounters
from .streams import StepBatch

__all__ = ["StepInputs"]


class StepInputs:
    """The staging of one step runner's inputs.

    Args:
        device: the pool's device.
        n_vq: codebooks per frame of every step.
        codebook_size: codes are clamped into ``[0, codebook_size)``.
        counters: the session's counters (``clamped_codes``, ``clamped_on_device``).
    """

    def __init__(self, device: torch.device, n_vq: int, codebook_size: int, counters: SessionCounters):
        self.device, self.n_vq, self.codebook_size, self.counters = device, n_vq, codebook_size, counters
        self._pinned = device.type == "cuda"
        # A page-locked int64 buffer of a step's inputs and a bool one of a graph step's valid rows, reused by
        # every step (pageable on CPU). prepare() sizes them for the largest graph step at startup; without
        # graphs they grow to the largest step taken (docs/memory.md).
        self._inputs: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        # Recorded after each step's copies from those buffers (CUDA only): they may be overwritten once it is.
        self._inputs_read = torch.cuda.Event() if self._pinned else None

    def prepare(self, rows: int, total_frames: int) -> None:
        """Allocate the buffers for a step of ``rows`` rows and ``total_frames`` packed frames (the largest graph
        step), so that no step pays for pinning memory."""
        self._buffer(self.n_vq * total_frames + 2 * rows)
        self._valid_rows(0, rows)

    def _buffer(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the int64 input buffer (grown when too small), free to overwrite: it
        first waits until the device has read the previous step's inputs from it."""
        if self._inputs_read is not None:
            self._inputs_read.synchronize()
        if self._inputs is None or self._inputs.numel() < numel:
            self._inputs = torch.empty(numel, dtype=torch.long, pin_memory=self._pinned)
        return self._inputs[:numel]

    def _valid_rows(self, rows: int, total: int) -> torch.Tensor:
        # ``(total,)`` bool, the first ``rows`` True, in the buffer beside the input buffer (free once _buffer has
        # waited for the previous step's copies).
        if self._valid is None or self._valid.numel() < total:
            self._valid = torch.empty(total, dtype=torch.bool, pin_memory=self._pinned)
        valid = self._valid[:total]
        valid[:rows], valid[rows:] = True, False
        return valid

    def _read(self) -> None:
        # Mark the end of this step's copies from the buffers (queued on the current stream).
        if self._inputs_read is not None:
            self._inputs_read.record(torch.cuda.current_stream(self.device))

    def _staged(self, batch: StepBatch, host_codes: bool, rows: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(codes, meta)`` in the input buffer: ``(n_vq, F)`` packed codes when ``host_codes`` (else None), and
        ``(2, rows)`` slot ids and valid frames, padding rows after the batch's rows (valid frames 0)."""
        B, F = batch.rows, batch.shape.total_frames
        codes_numel = self.n_vq * F if host_codes else 0
        if self._pinned:
            staged = self._buffer(codes_numel + 2 * rows)
        else:
            staged = torch.empty(codes_numel + 2 * rows, dtype=torch.long)
        meta = staged[codes_numel:].view(2, rows)
        meta[:, :B] = torch.tensor([batch.slots, batch.valid_frames], dtype=torch.long)
        meta[1, B:] = 0
        codes = staged[:codes_numel].view(self.n_vq, F) if host_codes else None
        return codes, meta

    def stage_into_graph(self, batch: StepBatch, g) -> None:
        """Write ``batch``'s inputs straight into ``g``, the input tensors of the graph that replays it
        (``cuda_graph.CapturedGraph``): the packed codes (``(n_vq, F)``, code 0 for the dummies), slot ids
        (padding rows: the ids the graph was captured with), valid frames and valid rows, each in one copy from
        the input buffer (codes already on the device are packed there directly)."""
        host_codes = all(p.device.type == "cpu" for p in batch.pieces)
        codes, meta = self._staged(batch, host_codes, batch.shape.rows)
        meta[0, batch.rows :] = g.padding_host[batch.rows :]
        self.fill_codes(codes if host_codes else g.codes, batch)
        if host_codes:
            g.codes.copy_(codes, non_blocking=self._pinned)
        g.slot_ids.copy_(meta[0], non_blocking=self._pinned)
        g.valid_frames.copy_(meta[1], non_blocking=self._pinned)
        g.valid.copy_(self._valid_rows(batch.rows, batch.shape.rows), non_blocking=self._pinned)
        self._read()

    def stage_eager(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes (n_vq, F), slot_ids (B,), valid_frames (B,), valid_rows (B,))`` of an eager step of
        ``batch.shape``'s packed length, tensors of their own on the pool's device: codes packed and clamped into
        ``[0, codebook_size)``, the batch's rows alone (an eager step needs no padding rows: they would change
        nothing). On CUDA, codes from the host (as Stage 0 sends them) are packed in the input buffer and arrive
        in one host-to-device copy (others are packed on the device directly); slot ids and valid frames always
        travel through it."""
        host_codes = self._pinned and all(p.device.type == "cpu" for p in batch.pieces)
        codes, meta = self._staged(batch, host_codes, batch.rows)
        if codes is None:
            codes = torch.empty(self.n_vq, batch.shape.total_frames, dtype=torch.long, device=self.device)
        self.fill_codes(codes, batch)
        # Each result owns its storage (no views of one staging tensor, whose strides torch.compile would guard
        # on): the copies below always make new tensors.
        slot_ids = meta[0].to(self.device, non_blocking=self._pinned, copy=True)
        valid_frames = meta[1].to(self.device, non_blocking=self._pinned, copy=True)
        codes = codes.to(self.device, non_blocking=self._pinned)
        self._read()
        return codes, slot_ids, valid_frames, torch.ones(batch.rows, dtype=torch.bool, device=self.device)

    def fill_codes(self, codes: torch.Tensor, batch: StepBatch) -> None:
        """Pack ``batch``'s pieces into ``codes`` ``(n_vq, F)`` int64 (code 0 after the last row's frames), count the
        codes out of ``[0, codebook_size)`` and clamp them. Host ``codes`` and pieces: NumPy on this thread
        (module docstring), one min/max pass and a count only when a code is out of range. Otherwise on the
        device, counted without a sync (read lazily by :attr:`clamped_codes`). Stage 0 pads with
        ``codebook_size``; upstream clamps every chunk."""
        real, hi = sum(batch.valid_frames), self.codebook_size - 1
        if codes.device.type == "cpu" and all(p.device.type == "cpu" for p in batch.pieces):
            self._fill_host(codes.numpy(), batch.pieces, real)
            return
        _pack(codes, batch.pieces, real)
        c = self.counters
        outside = ((codes < 0) | (codes > hi)).sum()
        c.clamped_on_device = outside if c.clamped_on_device is None else c.clamped_on_device + outside
        codes.clamp_(0, hi)

    def _fill_host(self, codes: np.ndarray, pieces: tuple[torch.Tensor, ...], real: int) -> None:
        # The pieces one after another (cast as copy_ casts), code 0 after them; then count and clamp.
        hi = self.codebook_size - 1
        np.concatenate([p.numpy() for p in pieces], axis=1, out=codes[:, :real], casting="unsafe")
        codes[:, real:] = 0
        if codes.min() < 0 or codes.max() > hi:
            self.counters.clamped_codes += int(np.count_nonzero((codes < 0) | (codes > hi)))
            np.clip(codes, 0, hi, out=codes)

    @property
    def clamped_codes(self) -> int:
        """Codes clamped so far (reading it waits for the device when counts are still on it)."""
        c = self.counters
        if c.clamped_on_device is not None:
            c.clamped_codes += int(c.clamped_on_device)
            c.clamped_on_device = None
        return c.clamped_codes


def _pack(codes: torch.Tensor, pieces: tuple[torch.Tensor, ...], real: int) -> None:
    """Pack a step's ``pieces`` (``(n_vq, valid_frames[b])`` integer codes) one after another into ``codes``
    ``(n_vq, F)`` on the device, zero after the ``real`` frames they hold."""
    # Pieces of the buffer's dtype and device are packed by one concatenation, others piece by piece.
    if {(p.dtype, p.device) for p in pieces} == {(codes.dtype, codes.device)}:
        codes[:, :real].copy_(torch.cat(pieces, dim=1))
    else:
        start = 0
        for p in pieces:
            codes[:, start : start + p.shape[1]] = p
            start += p.shape[1]
    codes[:, real:].zero_()
