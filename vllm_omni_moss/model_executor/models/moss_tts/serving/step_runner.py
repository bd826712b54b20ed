# SPDX-License-Identifier: Apache-2.0
"""The step runner: ready streams' chunks -> pool steps -> each stream's audio rows on the host.

It cuts chunks into pieces of at most :attr:`StepRunner.max_piece_frames` frames, groups the ``i``-th piece
of every stream into steps of at most :attr:`StepRunner.max_step_rows` rows (one step per frame size present, or
with ``ragged_steps`` one step for all of them), stages each step's inputs (:class:`~.step_inputs.StepInputs`,
through page-locked buffers on CUDA), dispatches the step (a CUDA-graph replay when one fits, else the
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

from ..graph_ladder import bucket_for, packed_total_for
from ..step import decode_batch
from .counters import SessionCounters
from .step_inputs import StepInputs
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
        ragged_steps: one step per round, its rows of any valid frames (:meth:`plan_round`), and packed graphs
            captured for it; False: one step per frame size present.

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
        ragged_steps: bool = False,
    ):
        cfg = pool.config
        self.pool, self.n_vq, self.device = pool, n_vq, pool.device
        self.codebook_size, self.channels = int(cfg.codebook_size), int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.graph_batch_sizes, self.graph_frame_sizes = graph_batch_sizes, graph_frame_sizes
        self.max_step_frames = max_step_frames
        self.counters, self.tracer = counters, tracer
        self._graph_memory_bytes = graph_memory_bytes
        self.ragged_steps = ragged_steps
        self._compiled = self._compiled_step(compile)
        #: The step of a batch no graph runs, with :func:`~..step.decode_batch`'s signature less the pool
        #: (``total_frames`` is passed only to a packed step, which the compiled step never takes).
        self.eager_step: Callable = self._compiled if compile is True else functools.partial(decode_batch, pool)
        self._eager_packs = compile is not True
        self.inputs = StepInputs(self.device, n_vq, self.codebook_size, counters)
        use_graphs = self.device.type == "cuda" and bool(graph_batch_sizes) and bool(graph_frame_sizes)
        self.graphs = self._capture_graphs() if use_graphs else None
        # Audio rows come page-locked from torch's caching host allocator (_to_host); queued copies not yet
        # awaited: await_host_copies.
        self._copies_pending = False
        if self.graphs is not None:
            rows = graph_batch_sizes[-1]
            self.inputs.prepare(rows, graph_frame_sizes[-1])
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
            memory_budget_bytes=self._graph_memory_bytes, packed=self.ragged_steps,
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

        With :attr:`ragged_steps`, every piece goes in one group, shortest first, whose frame size is the one
        its longest piece pads to (docs/serving.md, "Ragged steps"). Otherwise pieces are grouped by the frame
        size each pads to, shortest first (so that first chunks come out first and a 1-frame chunk never pays
        for a 15-frame row). Each group is cut into steps by :meth:`split_rows`; each step's frame size, packed
        length and CUDA graph are decided here, once.
        """
        if self.ragged_steps:
            # A round may hold no piece: every stream with pieces left failed in an earlier round.
            groups = [sorted(round_pieces, key=lambda r: round_pieces[r][1].shape[1])] if round_pieces else []
        else:
            by_frames: dict[int, list[str]] = {}
            for rid, (_, piece) in round_pieces.items():
                by_frames.setdefault(self._group_frames(piece.shape[1]), []).append(rid)
            groups = [by_frames[t] for t in sorted(by_frames)]
        steps = []
        for rids in groups:
            first = 0
            frames = self._step_frames(max(round_pieces[r][1].shape[1] for r in rids))
            for size in self.split_rows(len(rids), frames):
                chosen, first = rids[first : first + size], first + size
                steps.append(self._step_batch(chosen, round_pieces, frames))
        return steps

    def _step_batch(self, chosen: list[str], round_pieces: dict, frames: int) -> StepBatch:
        pieces = tuple(round_pieces[r][1] for r in chosen)
        valid_frames = tuple(p.shape[1] for p in pieces)
        total = sum(valid_frames)
        packed = self._packed_frames(len(chosen), frames, total)
        key = self._graph_key(len(chosen), frames, pieces, total if self.ragged_steps else None)
        if key is not None:
            packed = key[2] if len(key) == 3 else None  # the graph captured for the step decides
        elif not self._eager_packs:
            packed = None
        return StepBatch(
            request_ids=tuple(chosen),
            slots=tuple(round_pieces[r][0] for r in chosen),
            pieces=pieces,
            valid_frames=valid_frames,
            frames=frames,
            graph_key=key,
            packed_frames=packed,
        )

    def _packed_frames(self, rows: int, frames: int, total: int) -> int | None:
        """The packed length of a ragged step of ``rows`` rows of ``frames`` frames holding ``total`` real frames,
        or None (its grid): with graph sizes, the packed total of its bucket that a GPU replays
        (:func:`~..graph_ladder.packed_total_for`, at the largest frame size only), on every device; without,
        ``total`` whenever it is less than the grid."""
        if not self.ragged_steps:
            return None
        if not (self.graph_batch_sizes and self.graph_frame_sizes):
            return total if total < rows * frames else None
        # Not bounded by the rows' own grid: the GPU's grid graph is the bucket's, which a packed graph may beat
        # even when every row is full (5 full rows of 6 frames in bucket 8: 32 frames, not 48).
        if frames != self.graph_frame_sizes[-1]:
            return None
        bucket = bucket_for(self.graph_batch_sizes, rows)
        return None if bucket is None else packed_total_for(bucket, self.graph_frame_sizes, total)

    def _graph_key(self, rows: int, frames: int, pieces: tuple[torch.Tensor, ...], total: int | None) -> tuple | None:
        # The graph that replays a step, or None (eager): none captured for it, or codes of another codebook count.
        # ``total``: the rows' real frames, for a packed graph (ragged steps only).
        if self.graphs is None or any(p.shape[0] != self.graphs.n_vq for p in pieces):
            return None
        return self.graphs.select(rows, frames) if total is None else self.graphs.select(rows, frames, total)

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
            self.inputs.stage_into_graph(batch, self.graphs.buffers(batch.graph_key))
            self.tracer.lap("stage_ms")
            out = self.graphs.replay(batch.graph_key, batch.rows)
            c.steps_graph += 1
            c.padding_rows += batch.padding_rows
        else:
            codes, slot_ids, valid_frames = self.inputs.stage_eager(batch)
            self.tracer.lap("stage_ms")
            valid = torch.ones(batch.rows, dtype=torch.bool, device=self.device)
            packed = {} if batch.packed_frames is None else {"total_frames": batch.packed_frames}
            out, _ = self.eager_step(codes, valid_frames, slot_ids, valid, **packed)
            c.steps_eager += 1
        self.tracer.lap("run_ms")
        decoded = sum(batch.valid_frames)
        c.decoded_frames += decoded
        # The frames the step's GEMMs ran beyond the real ones: its packed dummies, else its grid's padding.
        served = batch.rows * (out.shape[-1] // self.samples_per_frame)
        c.padded_frames += (served if batch.packed_frames is None else batch.packed_frames) - decoded
        rows = self._to_host(out, batch.valid_frames)
        self.tracer.lap("to_host_ms")
        if self.tracer.trace is not None:
            self.tracer.trace.steps += 1
        return rows

    @property
    def clamped_codes(self) -> int:
        """Codes clamped so far (reading it waits for the device when counts are still on it)."""
        return self.inputs.clamped_codes

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
