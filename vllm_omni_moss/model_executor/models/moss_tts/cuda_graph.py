# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs of streaming steps, keyed by ``(batch bucket, frame size)``, and packed ones keyed by
``(batch bucket, largest frame size, packed frames)``.

One graph per key replays ``step.decode_tensors`` over the pool (or a compiled callable
with the same signature) on static input tensors. A batch of ``B`` rows of ``T``
frames uses the smallest bucket ``>= B`` and the smallest captured frame size
``>= T``: rows ``B..bucket-1`` are padding rows (invalid, length 0, zero codes, slot
ids from ``pool.padding_slot_ids``) and frames ``T..`` of every row, like the frames
beyond each row's own length, are padding frames, which change no state (the pool's
per-frame validity), so a tail chunk of any length is served by a graph exactly.

With ``packed``, each bucket also gets graphs of ragged steps at the largest frame size whose rows hold at most
``bucket x t`` real frames in all, ``t`` each smaller frame size (``graph_ladder.packed_totals``): every op but
the attention runs on that many packed frames (``decode_tensors(..., total_frames=...)``) instead of the
``bucket x T`` grid. They are captured with the plain step, never a compiled callable: the packed length is a
Python integer, which a compiler that drops its guards would bake into one graph.

Invariants:

* Static slot ids are ``[live ids..., padding ids...]``: every replay writes the first
  ``B`` entries and restores the rest to the padding ids.
* Pool tensors are never reallocated after capture (the graphs hold their addresses):
  :meth:`StreamingGraphRunner.state_data_ptrs` lets tests check it.
* Every graph of one frame size writes its audio into one output buffer of that frame size, sized for the
  largest bucket and allocated outside the graphs' memory pool (so the static outputs of ``k`` buckets cost
  one buffer, not ``k``). :meth:`StreamingGraphRunner.replay` returns a view of that buffer, which a later
  replay of the frame size rewrites in place; :meth:`StreamingGraphRunner.decode` returns a clone.
* Capture stays within ``memory_budget_bytes``: the output buffers are counted before the first capture, the
  device memory the captures reserve after each one; past the budget capture stops with an error naming the
  sizes and the budget.
* Capture leaves live state untouched: warm-up runs with every row invalid, and the
  slots the pool's padding policy names (``slots_dirtied_by_padding``) are reset after.
* Each runner captures on its own stream into its own memory pool, so its graphs
  never share memory with another runner's (or vLLM's) graphs.

This module does not import vLLM.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .graph_ladder import graph_sizes, packed_total_for, packed_totals
from .state import DecoderStatePool
from .step import decode_tensors

__all__ = ["CapturedGraph", "GraphMemoryError", "StreamingGraphRunner"]

logger = logging.getLogger(__name__)

#: Warm-up runs before capture: compiles (if a compiled callable is used), autotunes,
#: and lets the caching allocator settle outside the graph pool.
WARMUP_RUNS = 3


class GraphMemoryError(RuntimeError):
    """The CUDA graphs of a ladder do not fit their memory budget (the message names the sizes and the budget)."""


@dataclass
class CapturedGraph:
    """One captured key: the graph and the static tensors it reads and writes (a replay reads whatever they hold).

    Attributes:
        graph: the CUDA graph.
        codes: ``(n_vq, bucket, T)`` int64 input codes.
        valid_frames: ``(bucket,)`` int64 valid frames of each row.
        slot_ids: ``(bucket,)`` int64 slot of each row.
        valid: ``(bucket,)`` bool valid rows.
        padding_ids: ``(bucket,)`` int64 on the device, the ids padding rows carry (``padding_host`` on the host).
        audio: ``(bucket, channels, T * spf)`` float32, the frame size's output buffer, rewritten by replays.
    """

    graph: torch.cuda.CUDAGraph
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
        batch_sizes: batch buckets (positive).
        frame_sizes: frame sizes ``T`` to capture (a step of fewer frames pads up to one).
        n_vq: codebooks per frame of the captured codes.
        callable: step function with the signature of ``step.decode_tensors`` less the pool
            (e.g. :func:`~.compile.compile_decode`); default: the eager tensor step.
            If capturing with it fails, the runner switches to the eager step for that
            and every later key.
        memory_budget_bytes: device memory the graphs may take (their output buffers and the memory their
            captures reserve), or None for no bound.
        packed: capture the packed graphs of ragged steps too (module docstring).

    Attributes:
        graphs: captured keys -> graph entries (:meth:`keys`).
        capture_seconds: wall seconds :meth:`capture` took (warm-up runs included).
        memory_bytes: device memory the graphs took, known after :meth:`capture`: the growth of the memory the
            process reserves over the capture (output buffers, the graphs' pool, and the blocks the warm-up
            runs leave cached for later steps).
        failures: keys that fell back to eager -> reason (``repr`` of the exception).
        compiled_keys: keys captured with ``callable``.

    Raises:
        ValueError: pool not on CUDA or not initialised, empty sizes, or a pool whose
            padding policy cannot serve the largest bucket (e.g. too few legacy scratch slots).
        GraphMemoryError: (from :meth:`capture`) the graphs do not fit ``memory_budget_bytes``.
    """

    def __init__(
        self,
        pool: DecoderStatePool,
        batch_sizes: Iterable[int],
        frame_sizes: Iterable[int],
        n_vq: int,
        callable: Callable | None = None,
        memory_budget_bytes: int | None = None,
        packed: bool = False,
    ):
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA pool; this pool is on {pool.device}")
        if not pool.initialized:
            raise ValueError("initialise the pool before building its graph runner")
        self.pool = pool
        self.batch_sizes, self.frame_sizes = graph_sizes(batch_sizes), graph_sizes(frame_sizes)
        if not self.batch_sizes or not self.frame_sizes:
            raise ValueError(
                f"need at least one batch size and one frame size, got {self.batch_sizes} / {self.frame_sizes}"
            )
        pool.padding_slot_ids(self.batch_sizes[-1])  # raises when the pool cannot pad the largest bucket
        self.n_vq = int(n_vq)
        self._compiled = callable
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self.packed = bool(packed)
        self._outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[tuple[int, ...], CapturedGraph] = {}
        self.failures: dict[tuple[int, ...], str] = {}
        self.compiled_keys: set[tuple[int, ...]] = set()
        self._mempool = None
        self._stream = None
        self._captured = False

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture every key of :meth:`keys`, largest step first (smaller graphs
        then reuse the larger ones' memory in the shared pool). Idempotent."""
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
            self._allocate_outputs()
            self._mempool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device)
            for key in self.keys():
                self._capture_key(key)
                self._check_memory(torch.cuda.memory_reserved(device) - reserved, len(self.graphs) + len(self.failures))
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "streaming decoder CUDA graphs: %d/%d captured (%d compiled, %d packed) in %.2f GiB and %.1f s; eager for %s",
            len(self.graphs),
            len(self.keys()),
            len(self.compiled_keys),
            sum(len(k) == 3 for k in self.graphs),
            self.memory_bytes / 2**30,
            self.capture_seconds,
            sorted(self.failures) or "none",
        )

    def keys(self) -> list[tuple[int, ...]]:
        """Every key the runner captures, largest step first: ``(bucket, T)`` for every bucket and frame size, and
        with ``packed`` ``(bucket, largest T, F)`` for every ``F`` of ``graph_ladder.packed_totals`` of the bucket
        (those its steps can replay).
        A step's size is its frames: ``F``, or ``bucket x T`` for the grid."""
        keys = [(b, t) for b in self.batch_sizes for t in self.frame_sizes]
        if self.packed:
            below = [0, *self.batch_sizes[:-1]]  # a step of bucket b has more rows than the bucket below
            for b, lower in zip(self.batch_sizes, below):
                keys += [(b, self.frame_sizes[-1], n) for n in packed_totals(b, self.frame_sizes, lower + 1)]
        return sorted(keys, key=lambda k: (k[0], k[1], k[2] if len(k) == 3 else k[0] * k[1]), reverse=True)

    def output_bytes(self) -> int:
        """Bytes of the output buffers: one float32 ``(largest bucket, channels, T * spf)`` per frame size."""
        cfg = self.pool.config
        row = cfg.number_channels * cfg.samples_per_frame * 4
        return sum(self.batch_sizes[-1] * t * row for t in self.frame_sizes)

    def _allocate_outputs(self) -> None:
        self._check_memory(self.output_bytes(), 0)
        cfg, device = self.pool.config, self.pool.device
        for t in self.frame_sizes:
            shape = (self.batch_sizes[-1], cfg.number_channels, t * cfg.samples_per_frame)
            self._outputs[t] = torch.zeros(shape, dtype=torch.float32, device=device)

    def _check_memory(self, used: int, captured: int) -> None:
        self.memory_bytes = used
        budget = self.memory_budget_bytes
        if budget is None or used <= budget:
            return
        keys = len(self.keys())
        self.close()
        raise GraphMemoryError(
            f"CUDA graphs of batch buckets {self.batch_sizes} x frame sizes {self.frame_sizes}"
            f"{' (packed graphs too)' if self.packed else ''} take "
            f"{used / 2**30:.2f} GiB after {captured} of {keys} graphs (output buffers "
            f"{self.output_bytes() / 2**30:.2f} GiB), over their memory budget of {budget / 2**30:.2f} GiB; "
            "raise the budget (codec_graph_memory_gib) or lower max_num_seqs"
        )

    def _capture_key(self, key: tuple[int, ...]) -> None:
        bucket, frames = key[0], key[1]
        if len(key) == 3:  # packed: the plain step, always (module docstring)
            self._capture_plain(key, functools.partial(decode_tensors, self.pool, total_frames=key[2]))
            return
        if self._compiled is not None:
            try:
                self.graphs[key] = self._capture_with(self._compiled, bucket, frames)
                self.compiled_keys.add(key)
                return
            except Exception as exc:  # compile and capture errors come in many types
                logger.warning("compiled capture failed for %s (%r); plain step from now on", key, exc)
                self._compiled = None
                self._reset_padding(bucket)
        self._capture_plain(key, functools.partial(decode_tensors, self.pool))

    def _capture_plain(self, key: tuple[int, ...], step: Callable) -> None:
        try:
            self.graphs[key] = self._capture_with(step, key[0], key[1])
        except Exception as exc:
            self.failures[key] = repr(exc)
            logger.warning("CUDA graph capture failed for %s (%r); eager for this key", key, exc)
            self._reset_padding(key[0])

    def _capture_with(self, step: Callable, bucket: int, frames: int) -> CapturedGraph:
        device = self.pool.device
        padding = self.pool.padding_slot_ids(bucket).to(device=device, dtype=torch.long).clone()
        codes = torch.zeros(self.n_vq, bucket, frames, dtype=torch.long, device=device)
        valid_frames = torch.zeros(bucket, dtype=torch.long, device=device)
        slot_ids = padding.clone()
        valid = torch.zeros(bucket, dtype=torch.bool, device=device)

        # Every row invalid: the warm-up touches no live slot (compact pool: nothing at all).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step(codes, valid_frames, slot_ids, valid)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self._reset_padding(bucket)

        graph = torch.cuda.CUDAGraph()
        out = self._outputs[frames][:bucket]
        with torch.cuda.graph(graph, pool=self._mempool, stream=self._stream, capture_error_mode="thread_local"):
            audio, _ = step(codes, valid_frames, slot_ids, valid)
            out.copy_(audio)
        del audio  # its block goes back to the graphs' pool: only the output buffer is read after a replay
        torch.cuda.synchronize(device)
        return CapturedGraph(graph, codes, valid_frames, slot_ids, valid, padding, padding.cpu(), out)

    def _reset_padding(self, bucket: int) -> None:
        dirtied = self.pool.slots_dirtied_by_padding(bucket)
        if dirtied:
            self.pool.reset(dirtied)

    # ------------------------------------------------------------------ replay
    def select(self, batch: int, num_frames: int, total_frames: int | None = None) -> tuple[int, ...] | None:
        """The captured key serving ``batch`` rows of ``num_frames`` frames, or None: the smallest
        bucket ``>= batch`` with the smallest captured frame size ``>= num_frames``. Given the rows' real frames
        in all (``total_frames``), a step at the largest frame size takes the packed graph of the smallest
        packed total holding them (``graph_ladder.packed_total_for``) when one is captured."""
        bucket = next((b for b in self.batch_sizes if b >= batch), None)
        if bucket is None:
            return None
        # A packed graph is asked for first: it serves its steps even when its bucket's grid graph failed to capture.
        largest = self.frame_sizes[-1]
        below = self.frame_sizes[-2] if len(self.frame_sizes) > 1 else 0
        if total_frames is not None and below < num_frames <= largest:
            packed = (bucket, largest, packed_total_for(bucket, self.frame_sizes, total_frames))
            if packed in self.graphs:
                return packed
        return next(((bucket, t) for t in self.frame_sizes if t >= num_frames and (bucket, t) in self.graphs), None)

    def buffers(self, key: tuple[int, ...]) -> CapturedGraph:
        """The captured graph of ``key`` (from :meth:`select`), whose input tensors a caller fills before
        :meth:`replay` (the step runner stages each step's inputs straight into them)."""
        return self.graphs[key]

    def replay(self, key: tuple[int, ...], rows: int) -> torch.Tensor:
        """Replay the graph of ``key`` on what its input tensors hold (a paged pool's page tables committed
        first); returns ``(rows, channels, T * spf)`` float32, a view of the frame size's output buffer that the
        next replay of that frame size rewrites (work queued after this replay on the same stream reads it
        first)."""
        g = self.graphs[key]
        g.graph.replay()
        return g.audio[:rows]

    @torch.no_grad()
    def decode(
        self, codes: torch.Tensor, valid_frames: torch.Tensor, slot_ids: torch.Tensor, total_frames: int | None = None
    ) -> torch.Tensor | None:
        """Replay the graph for a batch of valid rows held on the device, or return None (the caller runs eager).
        A paged pool's page tables must be committed first (``pool.commit_page_tables``).

        Args:
            codes: ``(n_vq, B, T)`` int64 on the pool's CUDA device.
            valid_frames: ``(B,)`` int64 valid frames per row, ``0..T``.
            slot_ids: ``(B,)`` int64 distinct slots in use.
            total_frames: the sum of ``valid_frames``, to replay a packed graph (:meth:`select`); None: a grid
                graph.
        Returns:
            ``(B, channels, T_graph * spf)`` float32 audio, a fresh tensor (``T_graph >= T``;
            samples beyond a row's length are zero), or None when no graph fits, the inputs
            are not on CUDA, or a capture is active.
        Raises:
            ValueError: ``total_frames`` is not the sum of ``valid_frames`` (read with one host sync).
        """
        if not codes.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        n_vq, B, T = codes.shape
        if n_vq != self.n_vq:
            return None
        if total_frames is not None and total_frames != int(valid_frames.sum()):  # a packed graph holds no more
            raise ValueError(f"total_frames {total_frames} is not the sum of valid_frames ({int(valid_frames.sum())})")
        key = self.select(B, T, total_frames)
        if key is None:
            return None
        g = self.graphs[key]
        g.codes.zero_()
        g.codes[:, :B, :T].copy_(codes)
        g.valid_frames.zero_()
        g.valid_frames[:B].copy_(valid_frames)
        g.slot_ids.copy_(g.padding_ids)
        g.slot_ids[:B].copy_(slot_ids)
        g.valid.zero_()
        g.valid[:B].fill_(True)
        return self.replay(key, B).clone()

    # ------------------------------------------------------------------ inspection
    def state_data_ptrs(self) -> list[int]:
        """Addresses of every persistent pool tensor (rings, then offsets), in a fixed order."""
        return [t.data_ptr() for t in self.pool.rings + self.pool.offset_tensors()]

    def close(self) -> None:
        """Drop the graphs, their output buffers and their memory pool."""
        self.graphs.clear()
        self._outputs.clear()
        self._mempool = None
        self._stream = None
        self._compiled = None
