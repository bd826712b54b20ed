# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs of streaming steps, keyed by their :class:`~.graph_ladder.StepShape`.

One graph per shape replays ``step.decode_tensors`` over the pool (or a compiled callable with the same
signature) on static input tensors: ``(n_vq, F)`` packed codes and ``(R,)`` valid frames, slot ids and valid
rows. A step of ``B <= R`` rows holding ``F' <= F`` valid frames, none longer than ``T``, replays the graph of
its shape (``graph_ladder.StepLadder.shape``, which the step runner asks with the totals captured here): rows
``B..R-1`` are padding rows (invalid, no frames, slot ids from ``pool.padding_slot_ids``) and packed frames
``F'..F-1`` are dummies, which change no state, so a step of any lengths is served by a graph exactly.

Invariants:

* Static slot ids are ``[live ids..., padding ids...]``: every replay writes the first
  ``B`` entries and restores the rest to the padding ids.
* Pool tensors are never reallocated after capture (the graphs hold their addresses):
  :meth:`StreamingGraphRunner.state_data_ptrs` lets tests check it.
* Every graph writes its packed audio into one output buffer, ``(channels, largest F x spf)`` float32,
  allocated outside the graphs' memory pool. :meth:`StreamingGraphRunner.replay` returns a view of it, which
  the next replay rewrites in place; :meth:`StreamingGraphRunner.decode` returns a copy.
* Capture stays within ``memory_budget_bytes``: the output buffer is counted before the first capture, the
  device memory the captures reserve after each one; past the budget capture stops with an error naming the
  shapes and the budget.
* Capture leaves live state untouched: warm-up runs with every row invalid, and the
  slots the pool's padding policy names (``slots_dirtied_by_padding``) are reset after.
* Each runner captures on its own stream into its own memory pool, so its graphs
  never share memory with another runner's (or vLLM's) graphs.

This module does not import vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .graph_ladder import StepShape
from .state import DecoderStatePool
from .step import decode_tensors
from .token_packing import pack_codes, unpack_audio

__all__ = ["CapturedGraph", "GraphMemoryError", "StreamingGraphRunner"]

logger = logging.getLogger(__name__)

#: Warm-up runs before the first capture: compiles (if a compiled callable is used), autotunes, and lets the
#: caching allocator settle outside the graph pool. Later shapes reuse the kernels: one warm-up each.
WARMUP_RUNS = 3


class GraphMemoryError(RuntimeError):
    """The CUDA graphs of a ladder do not fit their memory budget (the message names the sizes and the budget)."""


@dataclass
class CapturedGraph:
    """One captured shape: the graph and the static tensors it reads and writes (a replay reads whatever they
    hold).

    Attributes:
        graph: the CUDA graph.
        shape: its :class:`~.graph_ladder.StepShape` (``R`` rows, ``T`` frames, ``F`` packed frames).
        codes: ``(n_vq, F)`` int64 packed codes.
        valid_frames: ``(R,)`` int64 valid frames of each row.
        slot_ids: ``(R,)`` int64 slot of each row.
        valid: ``(R,)`` bool valid rows.
        padding_ids: ``(R,)`` int64 on the device, the ids padding rows carry (``padding_host`` on the host).
        audio: ``(channels, F * spf)`` float32 packed audio, a view of the runner's output buffer.
    """

    graph: torch.cuda.CUDAGraph
    shape: StepShape
    codes: torch.Tensor
    valid_frames: torch.Tensor
    slot_ids: torch.Tensor
    valid: torch.Tensor
    padding_ids: torch.Tensor
    padding_host: torch.Tensor
    audio: torch.Tensor


class StreamingGraphRunner:
    """Capture and replay streaming-step CUDA graphs for one pool.

    Args:
        pool: an initialised pool on a CUDA device.
        shapes: the :class:`~.graph_ladder.StepShape` s to capture.
        n_vq: codebooks per frame of the captured codes.
        callable: step function with the signature of ``step.decode_tensors`` less the pool
            (e.g. :func:`~.compile.compile_decode`); default: the eager tensor step.
            If capturing with it fails, the runner switches to the eager step for that
            and every later shape.
        memory_budget_bytes: device memory the graphs may take (their output buffer and the memory their
            captures reserve), or None for no bound.

    Attributes:
        graphs: captured shapes -> graph entries.
        capture_seconds: wall seconds :meth:`capture` took (warm-up runs included).
        memory_bytes: device memory the graphs took, known after :meth:`capture`: the growth of the memory the
            process reserves over the capture (output buffer, the graphs' pool, and the blocks the warm-up
            runs leave cached for later steps).
        failures: shapes that fell back to eager -> reason (``repr`` of the exception).
        compiled_keys: shapes captured with ``callable``.

    Raises:
        ValueError: pool not on CUDA or not initialised, no shapes, or a pool whose
            padding policy cannot serve the most rows (e.g. too few legacy scratch slots).
        GraphMemoryError: (from :meth:`capture`) the graphs do not fit ``memory_budget_bytes``.
    """

    def __init__(
        self,
        pool: DecoderStatePool,
        shapes: Iterable[StepShape],
        n_vq: int,
        callable: Callable | None = None,
        memory_budget_bytes: int | None = None,
    ):
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA pool; this pool is on {pool.device}")
        if not pool.initialized:
            raise ValueError("initialise the pool before building its graph runner")
        self.pool = pool
        # Largest step first: smaller graphs then reuse the larger ones' memory in the shared pool.
        self.shapes = sorted(set(shapes), key=lambda s: (s.total_frames, s.rows, s.frames), reverse=True)
        if not self.shapes or not all(isinstance(s, StepShape) for s in self.shapes):
            raise ValueError(f"need at least one StepShape to capture, got {self.shapes}")
        pool.padding_slot_ids(max(s.rows for s in self.shapes))  # raises when the pool cannot pad the most rows
        self.n_vq = int(n_vq)
        self._compiled = callable
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self._output: torch.Tensor | None = None
        self.graphs: dict[StepShape, CapturedGraph] = {}
        self.failures: dict[StepShape, str] = {}
        self.compiled_keys: set[StepShape] = set()
        self._mempool = None
        self._stream = None
        self._captured = False

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture every shape, largest step first. Idempotent."""
        if self._captured:
            return
        self._captured = True
        device, start = self.pool.device, time.perf_counter()
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            # Free cached blocks first: otherwise the graphs may reuse blocks that earlier work left cached, and
            # the growth below would miss memory they hold from then on.
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(device)
            self._check_memory(self.output_bytes(), 0)
            cfg = self.pool.config
            frames = max(s.total_frames for s in self.shapes) * cfg.samples_per_frame
            self._output = torch.zeros((cfg.number_channels, frames), dtype=torch.float32, device=device)
            self._mempool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device)
            for i, shape in enumerate(self.shapes):
                self._capture_shape(shape, WARMUP_RUNS if i == 0 else 1)
                self._check_memory(torch.cuda.memory_reserved(device) - reserved, len(self.graphs) + len(self.failures))
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "streaming decoder CUDA graphs: %d/%d captured (%d compiled) in %.2f GiB and %.1f s; eager for %s",
            len(self.graphs),
            len(self.shapes),
            len(self.compiled_keys),
            self.memory_bytes / 2**30,
            self.capture_seconds,
            sorted((s.rows, s.frames, s.total_frames) for s in self.failures) or "none",
        )

    def output_bytes(self) -> int:
        """Bytes of the output buffer: float32 ``(channels, largest F x spf)``."""
        cfg = self.pool.config
        return max(s.total_frames for s in self.shapes) * cfg.number_channels * cfg.samples_per_frame * 4

    def _check_memory(self, used: int, captured: int) -> None:
        self.memory_bytes = used
        budget = self.memory_budget_bytes
        if budget is None or used <= budget:
            return
        largest = self.shapes[0]
        self.close()
        raise GraphMemoryError(
            f"CUDA graphs of {len(self.shapes)} step shapes (up to {largest.rows} rows x {largest.frames} frames, "
            f"{largest.total_frames} packed frames) take {used / 2**30:.2f} GiB after {captured} graphs (output "
            f"buffer {self.output_bytes() / 2**30:.2f} GiB), over their memory budget of {budget / 2**30:.2f} GiB; "
            "raise the budget (codec_graph_memory_gib) or lower max_num_seqs"
        )

    def _capture_shape(self, shape: StepShape, warmups: int) -> None:
        if self._compiled is not None:
            try:
                self.graphs[shape] = self._capture_with(self._compiled, shape, warmups)
                self.compiled_keys.add(shape)
                return
            except Exception as exc:  # compile and capture errors come in many types
                logger.warning("compiled capture failed for %s (%r); plain step from now on", shape, exc)
                self._compiled = None
                self._reset_padding(shape.rows)
                warmups = WARMUP_RUNS  # the plain step's first capture
        try:
            self.graphs[shape] = self._capture_with(self._plain_step, shape, warmups)
        except Exception as exc:
            self.failures[shape] = repr(exc)
            logger.warning("CUDA graph capture failed for %s (%r); eager for this shape", shape, exc)
            self._reset_padding(shape.rows)

    def _plain_step(self, codes, valid_frames, slot_ids, valid, frames: int) -> torch.Tensor:
        return decode_tensors(self.pool, codes, valid_frames, slot_ids, valid, frames)

    def _capture_with(self, step: Callable, shape: StepShape, warmups: int) -> CapturedGraph:
        device, R = self.pool.device, shape.rows
        padding = self.pool.padding_slot_ids(R).to(device=device, dtype=torch.long).clone()
        codes = torch.zeros(self.n_vq, shape.total_frames, dtype=torch.long, device=device)
        valid_frames = torch.zeros(R, dtype=torch.long, device=device)
        slot_ids = padding.clone()
        valid = torch.zeros(R, dtype=torch.bool, device=device)

        # Every row invalid: the warm-up touches no live slot (compact pool: nothing at all).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step(codes, valid_frames, slot_ids, valid, shape.frames)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self._reset_padding(R)

        graph = torch.cuda.CUDAGraph()
        out = self._output[:, : shape.total_frames * self.pool.config.samples_per_frame]
        with torch.cuda.graph(graph, pool=self._mempool, stream=self._stream, capture_error_mode="thread_local"):
            audio = step(codes, valid_frames, slot_ids, valid, shape.frames)
            out.copy_(audio)
        del audio  # its block goes back to the graphs' pool: only the output buffer is read after a replay
        torch.cuda.synchronize(device)
        return CapturedGraph(graph, shape, codes, valid_frames, slot_ids, valid, padding, padding.cpu(), out)

    def _reset_padding(self, rows: int) -> None:
        dirtied = self.pool.slots_dirtied_by_padding(rows)
        if dirtied:
            self.pool.reset(dirtied)

    # ------------------------------------------------------------------ replay
    @property
    def captured_totals(self) -> tuple[int, ...]:
        """The packed frame totals of the captured shapes, ascending (what a step ladder may pad to)."""
        return tuple(sorted({s.total_frames for s in self.graphs}))

    def buffers(self, shape: StepShape) -> CapturedGraph:
        """The captured graph of ``shape``, whose input tensors a caller fills before :meth:`replay` (the step
        runner stages each step's inputs straight into them)."""
        return self.graphs[shape]

    def replay(self, shape: StepShape) -> torch.Tensor:
        """Replay the graph of ``shape`` on what its input tensors hold (a paged pool's page tables committed
        first); returns ``(channels, F * spf)`` float32 packed audio, a view of the output buffer that the next
        replay rewrites (work queued after this replay on the same stream reads it first)."""
        g = self.graphs[shape]
        g.graph.replay()
        return g.audio

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, valid_frames: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor | None:
        """Replay the graph of the smallest captured shape holding a ``(n_vq, B, T)`` grid of valid rows held on
        the device (``B`` rows, ``T`` frames, their valid frames in all), or return None (the caller runs
        eager). A paged pool's page tables must be committed first (``pool.commit_page_tables``).

        Args:
            codes: ``(n_vq, B, T)`` int64 on the pool's CUDA device.
            valid_frames: ``(B,)`` int64 valid frames per row, ``0..T`` (read with one host sync).
            slot_ids: ``(B,)`` int64 distinct slots in use.
        Returns:
            ``(B, channels, T * spf)`` float32 audio, a fresh tensor (samples beyond a row's length are zero),
            or None when no graph fits, the inputs are not on CUDA, or a capture is active.
        """
        if not codes.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        n_vq, B, T = codes.shape
        if n_vq != self.n_vq:
            return None
        real = int(valid_frames.sum())
        fits = [s for s in self.graphs if s.rows >= B and s.frames >= T and s.total_frames >= real]
        if not fits:
            return None
        shape = min(fits, key=lambda s: (s.total_frames, s.rows, s.frames))
        g = self.graphs[shape]
        lengths = torch.zeros(shape.rows, dtype=torch.long, device=codes.device)
        lengths[:B] = valid_frames
        g.codes.copy_(pack_codes(codes, valid_frames, shape.total_frames))
        g.valid_frames.copy_(lengths)
        g.slot_ids.copy_(g.padding_ids)
        g.slot_ids[:B].copy_(slot_ids)
        g.valid.zero_()
        g.valid[:B].fill_(True)
        audio = self.replay(shape)
        return unpack_audio(audio, valid_frames, T, self.pool.config.samples_per_frame)

    # ------------------------------------------------------------------ inspection
    def state_data_ptrs(self) -> list[int]:
        """Addresses of every persistent pool tensor (rings, then offsets), in a fixed order."""
        return [t.data_ptr() for t in self.pool.rings + self.pool.offset_tensors()]

    def close(self) -> None:
        """Drop the graphs, their output buffers and their memory pool."""
        self.graphs.clear()
        self._output = None
        self._mempool = None
        self._stream = None
        self._compiled = None
