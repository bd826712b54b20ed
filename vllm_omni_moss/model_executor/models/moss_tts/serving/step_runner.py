# SPDX-License-Identifier: Apache-2.0
"""The step runner: ready streams' chunks -> pool steps -> each stream's audio rows on the host.

It cuts chunks into pieces of at most :attr:`StepRunner.max_piece_frames` frames and decodes the ``i``-th piece of
every stream in round ``i``: one ragged step for the whole round, its rows holding any number of valid frames,
packed (``token_packing.py``), shaped by the session's :class:`~..graph_ladder.StepLadder` (a round whose frames no
shape holds is cut into several steps). It stages each step's inputs (:class:`~.step_inputs.StepInputs`, through
page-locked buffers on CUDA), dispatches the step (the CUDA-graph replay of its shape when one was captured, else
the eager step of the same shape) and queues each row's audio to the host. Streams and slots are the scheduler's:
the runner executes the frozen ``scheduler.SchedulerOutput`` the scheduler hands it (its
:class:`~.streams.ScheduledChunks`) and returns a frozen :class:`RunnerOutput` (audio, frames decoded, errors), which
the scheduler takes back. Its :class:`StepPlanner` shapes each round's steps from the ladder and the captured graph
shapes, both handed over once. A step that raises fails its own rows' streams and no other
(:meth:`StepRunner.execute`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..graph_ladder import StepLadder, StepShape
from ..step import decode_tensors
from .counters import SessionCounters
from .step_inputs import StepInputs
from .streams import StepBatch
from .tracing import CallTracer

__all__ = ["RunnerOutput", "StepPlanner", "StepRunner", "capture_graphs", "compiled_step"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What :meth:`StepRunner.execute` decoded of one round (``scheduler.SchedulerOutput``), for
    ``Scheduler.update``.

    Attributes:
        audio: request id -> the stream's audio rows, one ``(channels, valid_frames * samples_per_frame)`` float32
            CPU tensor per piece decoded, in order (on CUDA their copies may still run:
            :meth:`StepRunner.await_host_copies`); a failed stream with none is left out.
        decoded_frames: request id -> frames decoded of the stream's scheduled chunks (0 when none).
        errors: request id -> the error of each stream whose step raised (the stream is to end).
    """

    audio: Mapping[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    decoded_frames: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepPlanner:
    """How a round's pieces become steps, decided on the host from what is handed over once: the ladder and the
    shapes whose CUDA graphs were captured.

    Attributes:
        ladder: how steps are shaped (:class:`~..graph_ladder.StepLadder`): its ``frames`` is the longest piece of a
            chunk decoded in one step, its totals the packed lengths steps pad to (none: exact shapes).
        captured: the step shapes a captured CUDA graph replays (empty: every step runs eagerly).
    """

    ladder: StepLadder
    captured: frozenset[StepShape] = frozenset()

    def pieces(self, chunks: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """``chunks`` (``(n_vq, T)`` codes) in order, each longer than ``ladder.frames`` cut into pieces of at most
        that many frames (views, the last one shorter)."""
        limit = self.ladder.frames
        return [c if c.shape[1] <= limit else c[:, a : a + limit] for c in chunks for a in range(0, c.shape[1], limit)]

    def plan_round(self, round_pieces: dict[str, tuple[int, torch.Tensor]]) -> list[StepBatch]:
        """The steps of one round: ``round_pieces`` maps each stream decoding in it to ``(slot, piece)``, a piece
        being ``(n_vq, T)`` integer codes with ``1 <= T <= ladder.frames``.

        Every piece goes in one step, shortest first (so that first chunks come out first), unless no shape of
        the ladder holds the round's frames: then :meth:`~..graph_ladder.StepLadder.cut` cuts it into as few
        steps as hold it. Each step's shape, and whether a graph replays it (its shape is in :attr:`captured`), is
        decided here, once.
        """
        rids = sorted(round_pieces, key=lambda r: round_pieces[r][1].shape[1])
        lengths = [round_pieces[r][1].shape[1] for r in rids]
        steps, first = [], 0
        for size in self.ladder.cut(lengths):
            chosen, first = rids[first : first + size], first + size
            pieces = tuple(round_pieces[r][1] for r in chosen)
            valid_frames = tuple(p.shape[1] for p in pieces)
            shape = self.ladder.shape(valid_frames)
            slots = tuple(round_pieces[r][0] for r in chosen)
            steps.append(StepBatch(tuple(chosen), slots, pieces, valid_frames, shape, shape in self.captured))
        return steps


def compiled_step(pool, compile: bool | Callable) -> Callable | None:
    """The compiled step of ``pool`` that ``compile`` asks for: ``True``, :func:`~..compile.compile_decode`; a
    factory ``pool -> callable``, its callable; ``False``, None."""
    if compile is True:
        from ..compile import compile_decode

        return compile_decode(pool)
    return compile(pool) if callable(compile) else None


def capture_graphs(pool, ladder: StepLadder, n_vq: int, compiled: Callable | None, memory_budget_bytes: int | None):
    """Capture a CUDA graph of every shape of ``ladder``'s totals over ``pool`` (``compiled``, or the plain step,
    inside them). Returns the ``cuda_graph.StreamingGraphRunner``, or None when no capture succeeded.

    Raises:
        GraphMemoryError: the graphs do not fit ``memory_budget_bytes``.
    """
    from ..cuda_graph import StreamingGraphRunner

    shapes = [ladder.shape_of_total(n) for n in ladder.totals]
    runner = StreamingGraphRunner(pool, shapes, n_vq, callable=compiled, memory_budget_bytes=memory_budget_bytes)
    runner.capture()
    return runner if runner.graphs else None


class StepRunner:
    """Steps of one pool.

    Args:
        pool: an initialised pool.
        n_vq: codebooks per frame in every chunk.
        ladder: how steps are shaped (:class:`~..graph_ladder.StepLadder`): its ``frames`` is the longest piece
            of a chunk decoded in one step, its totals the packed lengths steps pad to (none: exact shapes).
        counters: the session's counters; tracer: the session's call tracer.
        graphs: the captured graphs of the ladder's shapes (:func:`capture_graphs`; anything with ``graphs``,
            ``buffers(shape)``, ``replay(shape)`` and ``close()``), or None: every step runs eagerly.
        eager_step: the step of a shape no graph runs, with :func:`~..step.decode_tensors`'s signature less the
            pool; None: :func:`~..step.decode_tensors` itself.

    Attributes:
        planner: the :class:`StepPlanner` of the ladder and the shapes ``graphs`` captured, handed over once here.
        eager_step: as given (a test may wrap it).
    """

    def __init__(
        self,
        pool,
        n_vq: int,
        ladder: StepLadder,
        counters: SessionCounters,
        tracer: CallTracer,
        *,
        graphs=None,
        eager_step: Callable | None = None,
    ):
        cfg = pool.config
        self.pool, self.n_vq, self.device = pool, n_vq, pool.device
        self.codebook_size, self.channels = int(cfg.codebook_size), int(cfg.number_channels)
        self.samples_per_frame = int(cfg.samples_per_frame)
        self.ladder = ladder
        self.counters, self.tracer = counters, tracer
        self.eager_step: Callable = eager_step or self._plain_step
        self.inputs = StepInputs(self.device, n_vq, self.codebook_size, counters)
        # Steps are shaped by the whole ladder on every device; a shape whose capture failed runs eagerly.
        self.graphs = graphs
        self.planner = StepPlanner(ladder, frozenset(graphs.graphs) if graphs is not None else frozenset())
        # Audio rows come page-locked from torch's caching host allocator (_to_host); queued copies not yet
        # awaited: await_host_copies.
        self._copies_pending = False
        if graphs is not None and self.device.type == "cuda":
            self.inputs.prepare(ladder.max_rows, ladder.max_total)
            # Pin one burst of audio rows of every size class a row can take (1 to T frames) and free it: the
            # caching host allocator keeps the blocks, in power-of-two size classes, and serves a row only from
            # its own class (docs/memory.md).
            classes = {}
            for frames in range(1, ladder.frames + 1):
                classes[(frames * self.samples_per_frame * self.channels * 4 - 1).bit_length()] = frames
            for frames in classes.values():
                warm = [self._audio_row(frames) for _ in range(ladder.max_rows)]
                del warm

    def _plain_step(self, codes, valid_frames, slot_ids, valid_rows, frames: int) -> torch.Tensor:
        return decode_tensors(self.pool, codes, valid_frames, slot_ids, valid_rows, frames)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    @property
    def max_piece_frames(self) -> int:
        """Most frames of one chunk decoded in one step: the ladder's ``frames``."""
        return self.ladder.frames

    @property
    def max_step_rows(self) -> int:
        """Most rows in one step: the pool's slot count."""
        return self.ladder.max_rows

    # ------------------------------------------------------------------ cut and dispatch
    def execute(self, output) -> RunnerOutput:
        """Decode the scheduled chunks of ``output`` (a ``scheduler.SchedulerOutput``: slots in use, state
        reserved) in one step per round.

        Each stream's chunks keep their boundaries (a stream that waited is decoded chunk by chunk, as if it
        had never waited); a chunk longer than :attr:`max_piece_frames` is cut into pieces. Round ``i`` decodes
        every stream's ``i``-th piece (:meth:`StepPlanner.plan_round`).

        A step that raises an ``Exception`` (a CUDA out-of-memory error, say) fails its rows' streams alone: a
        failed stream keeps the audio of its pieces decoded before, its later pieces are dropped (its state is
        unknown: the step may have written part of it), and the other streams' steps go on.

        Returns:
            The frozen :class:`RunnerOutput`: each stream's audio rows, frames decoded and error, by request id.
        """
        streams = output.chunks
        if not streams:
            return RunnerOutput()
        pieces = {s.request_id: self.planner.pieces(s.chunks) for s in streams}
        parts: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in streams}
        frames_decoded = dict.fromkeys(parts, 0)
        failed: dict[str, str] = {}
        for i in range(max(len(p) for p in pieces.values())):
            round_pieces = {
                s.request_id: (s.slot, pieces[s.request_id][i])
                for s in streams
                if len(pieces[s.request_id]) > i and s.request_id not in failed
            }
            for batch in self.planner.plan_round(round_pieces):
                try:
                    wavs = self._step(batch)
                except Exception as exc:  # the step's streams fail, the call goes on (docs/serving.md)
                    undecoded = {rid: sum(p.shape[1] for p in pieces[rid][i:]) for rid in batch.request_ids}
                    failed.update(self._step_failed(batch, undecoded, exc))
                    continue
                for rid, n, wav in zip(batch.request_ids, batch.valid_frames, wavs):
                    parts[rid].append(wav)
                    frames_decoded[rid] += n
        return RunnerOutput({rid: tuple(rows) for rid, rows in parts.items() if rows}, frames_decoded, failed)

    def _step_failed(self, batch: StepBatch, undecoded: dict[str, int], exc: Exception) -> dict[str, str]:
        """Log the failure ``exc`` of the step ``batch`` (with its traceback) and return each of its streams'
        error, naming the step, the exception and the frames of the stream left undecoded in this call
        (``undecoded``, by request id)."""
        rows, frames = batch.rows, batch.shape.frames
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

    def _step(self, batch: StepBatch) -> list[torch.Tensor]:
        """Stage and run one step; returns each row's ``(channels, valid_frames * spf)`` float32 CPU audio (on CUDA
        still being copied: :meth:`_to_host`)."""
        self.tracer.lap("plan_ms")
        self.pool.commit_page_tables()  # the pages the scheduler reserved: the one commit, where inputs are staged
        c, shape = self.counters, batch.shape
        if batch.graph:
            self.inputs.stage_into_graph(batch, self.graphs.buffers(shape))
            self.tracer.lap("stage_ms")
            out = self.graphs.replay(shape)
            c.steps_graph += 1
            c.padding_rows += batch.padding_rows  # an eager step runs its rows alone
        else:
            codes, slot_ids, valid_frames, valid = self.inputs.stage_eager(batch)
            self.tracer.lap("stage_ms")
            out = self.eager_step(codes, valid_frames, slot_ids, valid, shape.frames)
            c.steps_eager += 1
        self.tracer.lap("run_ms")
        decoded = sum(batch.valid_frames)
        c.decoded_frames += decoded
        c.padded_frames += shape.total_frames - decoded  # the dummies the step's GEMMs ran
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

    def _to_host(self, out: torch.Tensor, valid_frames: tuple[int, ...]) -> list[torch.Tensor]:
        """Each row's ``(channels, valid_frames * spf)`` float32 audio on the host, a tensor of its own, from the
        step's ``(channels, F * spf)`` packed audio ``out`` (row ``b`` starts after the rows before it).

        On CUDA each row is copied from the device straight into a page-locked tensor of its own from torch's
        caching host allocator; when the caller drops a row its block returns to that cache for a later step.
        The copies are queued behind the step and not awaited here: the call awaits all of them once, after
        its host work (:meth:`await_host_copies`), so that work runs while the device does (one copy into a
        shared buffer followed by a host copy per row costs more: benchmarks/RESULTS.md)."""
        spf, starts, start = self.samples_per_frame, [], 0
        for n in valid_frames:
            starts.append(start)
            start += n * spf
        if not out.is_cuda:
            host = out.float()
            return [host[:, a : a + n * spf].clone() for a, n in zip(starts, valid_frames)]
        rows = [self._audio_row(n) for n in valid_frames]
        for row, a, n in zip(rows, starts, valid_frames):
            row.copy_(out[:, a : a + n * spf], non_blocking=True)
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
