# SPDX-License-Identifier: Apache-2.0
"""The step runner: ready streams' chunks -> pool steps -> each stream's audio rows on the host.

It cuts chunks into pieces of at most :attr:`StepRunner.max_piece_frames` frames, groups the ``i``-th piece
of every stream into steps of at most :attr:`StepRunner.max_step_rows` rows, stages each step's inputs
(through one page-locked buffer on CUDA), dispatches the step (a CUDA-graph replay when one fits, else the
eager step) and queues each row's audio to the host. Streams and slots are the scheduler's: the runner reads
the frozen :class:`~.streams.ScheduledChunks` the scheduler hands it and returns the frames it decoded of each,
which the scheduler counts. A step that raises fails its own rows' streams and no other
(:meth:`StepRunner.decode_streams`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..graph_ladder import bucket_for
from ..step import decode_batch
from .counters import SessionCounters
from .streams import ScheduledChunks, StepBatch
from .tracing import CallTracer

__all__ = ["StepRunner", "padding_slack"]

logger = logging.getLogger(__name__)


def padding_slack(frames: int) -> int:
    """Padding rows a step of ``frames`` frames may carry rather than being split in two: about what one more
    step's fixed cost buys in rows of that length (docs/serving.md, "Steps")."""
    return max(8, 128 // frames)


class StepRunner:
    """Steps of one pool.

    Args:
        pool: an initialised pool.
        n_vq: codebooks per frame in every chunk.
        graph_batch_sizes: sorted CUDA-graph batch buckets (the graph ladder); empty: no graphs, no row bound.
        graph_frame_sizes: sorted CUDA-graph frame sizes; every step pads to the smallest one that holds its
            longest piece, on every device (CPU runs take the steps a GPU does).
        max_step_frames: longest piece when no graph frame sizes are given.
        compile: ``False``, ``True`` (:func:`~..compile.compile_decode`) or a factory ``pool -> callable``
            (as ``CodecStreamSession``).
        counters: the session's counters; tracer: the session's call tracer.
        graph_memory_bytes: device memory the CUDA graphs may take (``cuda_graph.StreamingGraphRunner``), or None.

    Raises:
        GraphMemoryError: the graphs do not fit ``graph_memory_bytes``.
    """

    def __init__(
        self,
        pool,
        n_vq: int,
        graph_batch_sizes: list[int],
        graph_frame_sizes: list[int],
        max_step_frames: int,
        compile: bool | Callable,
        counters: SessionCounters,
        tracer: CallTracer,
        graph_memory_bytes: int | None = None,
    ):
        cfg = pool.config
        self.pool, self.n_vq, self.device = pool, n_vq, pool.device
        self.codebook_size, self.channels = int(cfg.codebook_size), int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.graph_batch_sizes, self.graph_frame_sizes = graph_batch_sizes, graph_frame_sizes
        self.max_step_frames = max_step_frames
        self.counters, self.tracer = counters, tracer
        self._graph_memory_bytes = graph_memory_bytes
        self._compiled = self._compiled_step(compile)
        #: The step of a batch no graph runs, with :func:`~..step.decode_batch`'s signature less the pool.
        self.eager_step: Callable = self._compiled if compile is True else functools.partial(decode_batch, pool)
        use_graphs = self.device.type == "cuda" and bool(graph_batch_sizes) and bool(graph_frame_sizes)
        self.graphs = self._capture_graphs() if use_graphs else None
        # A page-locked host buffer of a step's inputs (int64, and a bool one of a graph step's valid rows), reused
        # by every step, and page-locked audio rows from torch's caching host allocator (_to_host). With graphs
        # all are prepared here for the largest graph step, so no step pays for pinning memory; without graphs
        # the input buffer grows to the largest step taken (docs/memory.md).
        self._pinned_inputs: torch.Tensor | None = None
        self._pinned_valid: torch.Tensor | None = None  # a graph step's valid rows (bool), read with the inputs
        # Recorded after each step's input copies from that buffer (CUDA only): it may be overwritten once the
        # device has read it. Audio copies queued and not yet awaited: await_host_copies.
        self._inputs_read = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copies_pending = False
        if self.graphs is not None:
            rows = graph_batch_sizes[-1]
            self._input_buffer((n_vq * graph_frame_sizes[-1] + 2) * rows)
            self._valid_rows(0, rows)
            # Pin one burst of audio rows of every graph frame size and free it: the caching host allocator keeps
            # the blocks, in power-of-two size classes, and serves a row only from its own class. A burst of the
            # largest size alone left each smaller size's first large step to pin its rows (docs/memory.md).
            for frames in graph_frame_sizes:
                warm = [self._audio_row(frames) for _ in range(rows)]
                del warm

    def _compiled_step(self, compile) -> Callable | None:
        if compile is True:
            from ..compile import compile_decode

            return compile_decode(self.pool)
        return compile(self.pool) if callable(compile) else None

    def _capture_graphs(self):
        from ..cuda_graph import StreamingGraphRunner

        runner = StreamingGraphRunner(
            self.pool, self.graph_batch_sizes, self.graph_frame_sizes, self.n_vq, callable=self._compiled,
            memory_budget_bytes=self._graph_memory_bytes,
        )  # fmt: skip
        runner.capture()
        return runner if runner.graphs else None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._compiled = None

    @property
    def max_piece_frames(self) -> int:
        """Most frames of one chunk decoded in one step: the largest graph frame size, or ``max_step_frames``
        when no graph frame sizes are configured."""
        return self.graph_frame_sizes[-1] if self.graph_frame_sizes else self.max_step_frames

    @property
    def max_step_rows(self) -> int | None:
        """Most rows in one step: the largest graph bucket (None: unbounded, no buckets)."""
        return self.graph_batch_sizes[-1] if self.graph_batch_sizes else None

    # ------------------------------------------------------------------ cut and dispatch
    def decode_streams(
        self, streams: list[ScheduledChunks]
    ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int], dict[str, str]]:
        """Decode the scheduled chunks of ``streams`` (slots in use, pages reserved) in few, well-filled steps.

        Each stream's chunks keep their boundaries (a stream that waited is decoded chunk by chunk, as if it
        had never waited); a chunk longer than :attr:`max_piece_frames` is cut into pieces. Round ``i`` decodes
        every stream's ``i``-th piece: grouped by the frame size each piece pads to (shortest first, so that
        first chunks come out first and a 1-frame chunk never pays for a 15-frame row), each group cut into
        steps by :meth:`split_rows`.

        A step that raises an ``Exception`` (a CUDA out-of-memory error, say) fails its rows' streams alone: a
        failed stream keeps the audio of its pieces decoded before, its later pieces are dropped (its state is
        unknown: the step may have written part of it), and the other streams' steps go on.

        Returns:
            Each stream's audio rows, one per piece decoded (on CUDA their copies may still run:
            :meth:`await_host_copies`; a failed stream with none is left out), the frames decoded of each
            stream (0 when none), and the error of each failed stream, all by request id.
        """
        limit = self.max_piece_frames
        pieces: dict[str, list[torch.Tensor]] = {}
        for s in streams:
            pieces[s.request_id] = [
                c if c.shape[1] <= limit else c[:, a : a + limit] for c in s.chunks for a in range(0, c.shape[1], limit)
            ]
        parts: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in streams}
        frames_decoded = dict.fromkeys(parts, 0)
        failed: dict[str, str] = {}
        for i in range(max(len(p) for p in pieces.values())):
            round_pieces = {
                s.request_id: (s.slot, pieces[s.request_id][i])
                for s in streams
                if len(pieces[s.request_id]) > i and s.request_id not in failed
            }
            for batch in self.plan_round(round_pieces):
                try:
                    wavs = self._step(batch)
                except Exception as exc:  # the step's streams fail, the call goes on (docs/serving.md)
                    undecoded = {rid: sum(p.shape[1] for p in pieces[rid][i:]) for rid in batch.request_ids}
                    failed.update(self._step_failed(batch, undecoded, exc))
                    continue
                for rid, n, wav in zip(batch.request_ids, batch.valid_frames, wavs):
                    parts[rid].append(wav)
                    frames_decoded[rid] += n
        return {rid: rows for rid, rows in parts.items() if rows}, frames_decoded, failed

    def plan_round(self, round_pieces: dict[str, tuple[int, torch.Tensor]]) -> list[StepBatch]:
        """The steps of one round: ``round_pieces`` maps each stream decoding in it to ``(slot, piece)``.

        Pieces are grouped by the frame size each pads to, shortest first (so that first chunks come out first and
        a 1-frame chunk never pays for a 15-frame row), each group cut into steps by :meth:`split_rows`. Each
        step's frame size and CUDA graph are decided here, once.
        """
        by_frames: dict[int, list[str]] = {}
        for rid, (_, piece) in round_pieces.items():
            by_frames.setdefault(self._group_frames(piece.shape[1]), []).append(rid)
        steps = []
        for group in sorted(by_frames):
            rids, first = by_frames[group], 0
            frames = self._step_frames(max(round_pieces[r][1].shape[1] for r in rids))
            for size in self.split_rows(len(rids), frames):
                chosen, first = rids[first : first + size], first + size
                step_pieces = tuple(round_pieces[r][1] for r in chosen)
                steps.append(
                    StepBatch(
                        request_ids=tuple(chosen),
                        slots=tuple(round_pieces[r][0] for r in chosen),
                        pieces=step_pieces,
                        valid_frames=tuple(p.shape[1] for p in step_pieces),
                        frames=frames,
                        graph_key=self._graph_key(len(chosen), frames, step_pieces),
                    )
                )
        return steps

    def _graph_key(self, rows: int, frames: int, pieces: tuple[torch.Tensor, ...]) -> tuple[int, int] | None:
        # The graph that replays a step, or None (eager): none captured for it, or codes of another codebook count.
        if self.graphs is None or any(p.shape[0] != self.graphs.n_vq for p in pieces):
            return None
        return self.graphs.select(rows, frames)

    def _step_failed(self, batch: StepBatch, undecoded: dict[str, int], exc: Exception) -> dict[str, str]:
        """Log the failure ``exc`` of the step ``batch`` (with its traceback) and return each of its streams'
        error, naming the step, the exception and the frames of the stream left undecoded in this call
        (``undecoded``, by request id)."""
        rows, frames = batch.rows, batch.frames
        logger.error(
            "MOSS codec: a decoder step of %d rows x %d frames failed; its streams %s end with an error",
            rows, frames, list(batch.request_ids), exc_info=exc,
        )  # fmt: skip
        if self.tracer.trace is not None:
            self.tracer.trace.failed_steps += 1
        return {
            rid: (
                f"request {rid!r}: its decoder step ({rows} rows x {frames} frames) failed with "
                f"{type(exc).__name__}: {exc}; the stream was ended, frames left undecoded: {undecoded[rid]}"
            )
            for rid in batch.request_ids
        }

    def split_rows(self, rows: int, frames: int) -> list[int]:
        """Step sizes for ``rows`` rows of ``frames`` frames, in order.

        Without batch buckets: one step. With them, a step is one replay, and a bucket's padding rows cost what
        real rows cost, while every step costs a fixed launch and host time besides its rows: rows go in one
        step when the smallest bucket holding them pads at most :func:`padding_slack` rows, otherwise the
        largest bucket that they fill goes first and the rest follows (1,540 rows of 15 frames: 1,504 + 32 + 4
        instead of one 1,880-row replay).
        """
        buckets = self.graph_batch_sizes
        if not buckets:
            return [rows]
        sizes, slack = [], padding_slack(frames)
        while rows > 0:
            up = bucket_for(buckets, rows)
            if up is not None and up - rows <= slack:
                return sizes + [rows]
            down = max(b for b in buckets if b <= rows)
            sizes.append(down)
            rows -= down
        return sizes

    def _group_frames(self, frames: int) -> int:
        # The graph frame size a piece pads to; without graph frame sizes every piece pads to the longest of its
        # round, in one group (as eager steps always did).
        return next((t for t in self.graph_frame_sizes if t >= frames), 0) if self.graph_frame_sizes else 0

    def _step_frames(self, longest: int) -> int:
        # The same padding with or without captured graphs, so CPU runs take the steps a GPU does.
        return next((t for t in self.graph_frame_sizes if t >= longest), longest)

    def _step(self, batch: StepBatch) -> list[torch.Tensor]:
        """Stage and run one step; returns each row's ``(channels, valid_frames * spf)`` float32 CPU audio (on CUDA
        still being copied: :meth:`_to_host`)."""
        self.tracer.lap("plan_ms")
        self.pool.commit_page_tables()  # the pages the scheduler reserved: the one commit, where inputs are staged
        c = self.counters
        if batch.graph_key is not None:
            self._stage_into_graph(batch)
            self.tracer.lap("stage_ms")
            out = self.graphs.replay(batch.graph_key, batch.rows)
            c.steps_graph += 1
            c.padding_rows += batch.padding_rows
        else:
            codes, slot_ids, valid_frames = self._stage_inputs(batch)
            self.tracer.lap("stage_ms")
            valid = torch.ones(batch.rows, dtype=torch.bool, device=self.device)
            out, _ = self.eager_step(codes, valid_frames, slot_ids, valid)
            c.steps_eager += 1
        self.tracer.lap("run_ms")
        served, decoded = out.shape[-1] // self.samples_per_frame, sum(batch.valid_frames)
        c.decoded_frames += decoded
        c.padded_frames += batch.rows * served - decoded
        rows = self._to_host(out, batch.valid_frames)
        self.tracer.lap("to_host_ms")
        if self.tracer.trace is not None:
            self.tracer.trace.steps += 1
        return rows

    # ------------------------------------------------------------------ inputs
    def _input_buffer(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the pinned int64 input buffer (grown when too small), free to
        overwrite: it first waits until the device has read the previous step's inputs from it (that step's
        host-to-device copies, marked by ``_inputs_read``; a step of the same call may not have started yet,
        since the call waits for the device only once, at its end)."""
        if self._inputs_read is not None:
            self._inputs_read.synchronize()
        if self._pinned_inputs is None or self._pinned_inputs.numel() < numel:
            pinned = self.device.type == "cuda"
            self._pinned_inputs = torch.empty(numel, dtype=torch.long, pin_memory=pinned)
        return self._pinned_inputs[:numel]

    def _stage_into_graph(self, batch: StepBatch) -> None:
        """Write ``batch``'s inputs straight into the input buffers of the graph that replays it: the whole
        bucket's codes (``(n_vq, bucket, T)``, zero past each row's valid frames and in padding rows), slot ids
        (padding rows: the ids the graph was captured with), valid frames and valid rows, each in one copy from
        the page-locked input buffer (codes already on the device are gathered there directly)."""
        bucket, T = batch.graph_key
        B, n_vq = batch.rows, self.n_vq
        g = self.graphs.buffers(batch.graph_key)
        host_codes = all(p.device.type == "cpu" for p in batch.pieces)
        codes_numel = n_vq * bucket * T if host_codes else 0
        staged = self._input_buffer(codes_numel + 2 * bucket)
        meta = staged[codes_numel:].view(2, bucket)
        meta[:, :B] = torch.tensor([batch.slots, batch.valid_frames], dtype=torch.long)
        meta[0, B:] = g.padding_host[B:]
        meta[1, B:] = 0
        codes = staged[:codes_numel].view(n_vq, bucket, T) if host_codes else g.codes
        codes[:, B:].zero_()
        self._fill_codes(codes[:, :B], batch)
        pinned = self.device.type == "cuda"
        if host_codes:
            g.codes.copy_(codes, non_blocking=pinned)
        g.slot_ids.copy_(meta[0], non_blocking=pinned)
        g.valid_frames.copy_(meta[1], non_blocking=pinned)
        g.valid.copy_(self._valid_rows(B, bucket), non_blocking=pinned)
        if pinned:
            self._inputs_read.record(torch.cuda.current_stream(self.device))

    def _valid_rows(self, rows: int, bucket: int) -> torch.Tensor:
        # ``(bucket,)`` bool, the first ``rows`` True, in the page-locked buffer beside the input buffer (free once
        # _input_buffer has waited for the previous step's copies).
        if self._pinned_valid is None or self._pinned_valid.numel() < bucket:
            self._pinned_valid = torch.empty(bucket, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        valid = self._pinned_valid[:bucket]
        valid[:rows], valid[rows:] = True, False
        return valid

    def _stage_inputs(self, batch: StepBatch):
        """``(codes (n_vq, B, T), slot_ids (B,), valid_frames (B,))`` of an eager step, int64 tensors of their own on the
        pool's device, codes clamped into ``[0, codebook_size)`` and zero past each row's valid frames. On CUDA,
        codes from the host are gathered in the pinned input buffer and arrive in one host-to-device copy; slot
        ids and valid frames always travel through it."""
        B, T = batch.rows, batch.frames
        pinned = self.device.type == "cuda"
        # Codes from the host (as Stage 0 sends them) to a CUDA pool are gathered in the pinned buffer; anything
        # else is gathered on the pool's device directly.
        stage_codes = pinned and all(p.device.type == "cpu" for p in batch.pieces)
        codes_numel = self.n_vq * B * T if stage_codes else 0
        staged = self._input_buffer(codes_numel + 2 * B) if pinned else torch.empty(2 * B, dtype=torch.long)
        meta = staged[codes_numel:].view(2, B)
        meta.copy_(torch.tensor([batch.slots, batch.valid_frames], dtype=torch.long))
        if stage_codes:
            codes = staged[:codes_numel].view(self.n_vq, B, T)
        else:
            codes = torch.empty(self.n_vq, B, T, dtype=torch.long, device=self.device)
        self._fill_codes(codes, batch)
        # Each result owns its storage (no views of one staging tensor, whose strides torch.compile would guard
        # on): the copies below always make new tensors.
        slot_ids = meta[0].to(self.device, non_blocking=pinned, copy=True)
        valid_frames = meta[1].to(self.device, non_blocking=pinned, copy=True)
        codes = codes.to(self.device, non_blocking=pinned)
        if pinned:
            self._inputs_read.record(torch.cuda.current_stream(self.device))
        return codes, slot_ids, valid_frames

    def _fill_codes(self, codes: torch.Tensor, batch: StepBatch) -> None:
        """Gather ``batch``'s pieces into ``codes`` ``(n_vq, B, T)`` int64 (zero past each row's valid frames),
        count the codes out of ``[0, codebook_size)`` and clamp them."""
        _gather(codes, batch.pieces, batch.valid_frames, codes.shape[-1])
        self._count_clamped(codes)
        codes.clamp_(0, self.codebook_size - 1)

    def _count_clamped(self, codes: torch.Tensor) -> None:
        """Count the codes of a step's gathered ``(n_vq, B, T)`` int64 ``codes`` that its clamp will change
        (padding is 0, in range). Host codes (as Stage 0 sends them) take one min/max pass and a count only
        when one is out of range; device codes are counted on the device without a sync (read lazily by
        :attr:`clamped_codes`). Stage 0 pads with ``codebook_size``; upstream clamps every chunk."""
        hi = self.codebook_size - 1
        c = self.counters
        if codes.is_cuda:
            outside = ((codes < 0) | (codes > hi)).sum()
            c.clamped_on_device = outside if c.clamped_on_device is None else c.clamped_on_device + outside
            return
        low, high = torch.aminmax(codes)
        if int(low) < 0 or int(high) > hi:
            c.clamped_codes += int(((codes < 0) | (codes > hi)).sum())

    @property
    def clamped_codes(self) -> int:
        """Codes clamped so far (reading it waits for the device when counts are still on it)."""
        c = self.counters
        if c.clamped_on_device is not None:
            c.clamped_codes += int(c.clamped_on_device)
            c.clamped_on_device = None
        return c.clamped_codes

    # ------------------------------------------------------------------ audio
    def _audio_row(self, frames: int) -> torch.Tensor:
        """An empty ``(channels, frames * spf)`` float32 tensor in page-locked host memory."""
        return torch.empty((self.channels, frames * self.samples_per_frame), dtype=torch.float32, pin_memory=True)

    def _to_host(self, out: torch.Tensor, valid_frames: list[int]) -> list[torch.Tensor]:
        """Each row's ``(channels, valid_frames * spf)`` float32 audio on the host, a tensor of its own.

        On CUDA each row is copied from the device straight into a page-locked tensor of its own from torch's
        caching host allocator; when the caller drops a row its block returns to that cache for a later step.
        The copies are queued behind the step and not awaited here: the call awaits all of them once, after
        its host work (:meth:`await_host_copies`), so that work runs while the device does (one copy into a
        shared buffer followed by a host copy per row costs more: benchmarks/RESULTS.md)."""
        spf = self.samples_per_frame
        if not out.is_cuda:
            host = out.float()
            return [host[b, :, : n * spf].clone() for b, n in enumerate(valid_frames)]
        rows = [self._audio_row(n) for n in valid_frames]
        for b, (row, n) in enumerate(zip(rows, valid_frames)):
            row.copy_(out[b, :, : n * spf], non_blocking=True)
        self._copies_pending = True
        return rows

    def await_host_copies(self) -> None:
        """Wait once for the device to finish this call's steps and audio copies (no-op when none are
        queued). Traced as ``finish_ms`` up to here and ``wait_ms`` for the wait."""
        if not self._copies_pending:
            return
        self.tracer.lap("finish_ms")
        torch.cuda.current_stream(self.device).synchronize()
        self._copies_pending = False
        self.tracer.lap("wait_ms")


def _gather(codes: torch.Tensor, pieces: list[torch.Tensor], valid_frames: list[int], T: int) -> None:
    """Gather a step's ``pieces`` (``(n_vq, valid_frames[b])`` integer codes) into ``codes`` ``(n_vq, B, T)``."""
    # Pieces of one dtype and device are gathered by one stack (all of length T) or one padded gather, not
    # row by row; zero past each row's length.
    kinds = {(p.dtype, p.device) for p in pieces}
    uniform = len(kinds) == 1
    if uniform and all(n == T for n in valid_frames):
        if kinds == {(codes.dtype, codes.device)}:
            torch.stack(pieces, dim=1, out=codes)  # gathered in place: no temporary
        else:
            codes.copy_(torch.stack(pieces, dim=1))
    elif uniform:
        padded = torch.nn.utils.rnn.pad_sequence([p.t() for p in pieces], batch_first=True)  # (B, max, n_vq)
        codes.zero_()
        codes[:, :, : padded.shape[1]] = padded.permute(2, 0, 1)
    else:
        codes.zero_()
        for b, p in enumerate(pieces):
            codes[:, b, : valid_frames[b]] = p
