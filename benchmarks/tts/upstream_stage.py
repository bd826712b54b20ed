# SPDX-License-Identifier: Apache-2.0
"""The upstream arm of the stage benchmark: vLLM-Omni 0.30.0's codec model served with its own stage policy.

vLLM-Omni's Stage 1 cannot run here without vLLM, so this module is a small driver written for the benchmark.
It batches chunks onto upstream's own model object (``MossAudioTokenizerModel`` of the wheel's
``audio_tokenizer_v2.py``, built by :func:`common.build_upstream_codec`) following the serving policy of the
wheel's ``modeling_moss_tts_codec.py`` and ``cuda_graph_streaming_decoder_wrapper.py`` as read from 0.30.0:

* **Slots.** ``initialize_decoder_state_pool(N, S)`` with ``N`` = the stage's ``max_num_seqs`` (here the
  benchmark's concurrency) and, on CUDA, ``S`` = the largest graph batch bucket scratch slots for graph
  padding rows (``S = N`` when a bucket equals ``N``: the "2N slots"); ``S = 0`` on CPU. A request takes a
  slot (LIFO free list, first taken 0, 1, 2, ...) on its first chunk and returns it after its terminal
  chunk, whose slot is reset right after that step.
* **Steps.** A chunk longer than ``max_step_frames`` (upstream: the connector's ``codec_chunk_frames``) is
  decoded at once as consecutive single-row steps of at most that many frames. The other chunks are grouped
  by frame count, and each group is one step, in the order the groups first appear. When graphs exist and the
  largest batch bucket covers ``N``, a terminal chunk (a tail) joins the group of the smallest graph frame
  size that holds it ("tail padding"): its codes are right-padded with code 0 to the group's longest chunk,
  and a group made of tails only may be padded further, to a graph frame size. A group that is not all tails
  must match a graph frame size exactly.
* **Graphs** (CUDA only). One ``torch.cuda.CUDAGraph`` per (batch bucket, frame size), captured largest key
  first into one shared memory pool, each after three warm-up calls on a side stream with all-zero codes and
  lengths, scratch slots and no valid row, then a reset of those scratch slots; after all captures every slot
  is reset. A replay copies the step's codes into the zeroed static codes, gives every real row the step's
  frame count as its length, puts scratch slots ``N + i`` on the padding rows and marks only the real rows
  valid. Upstream first tries vLLM's ``torch.compile`` adapter and captures a plain graph when that fails;
  this driver captures the plain graph (the benchmark compares graph modes without ``torch.compile``).
  A step that fits no graph runs eagerly (``decode_streaming_batch``, every row valid, all lengths = the
  step's frame count).
* **Attention backend.** Upstream's H200 deploy file ``moss_tts_local_h200.yaml`` sets
  ``hf_overrides.codec_attention_backend: triton``: on CUDA every decoder attention module of the model
  gets the wheel's ``streaming_attention.masked_attention`` Triton kernel (used by upstream for bf16 and
  head size 64, i.e. the real v2 geometry; other shapes keep SDPA). See :func:`enable_triton_attention`.

Audio per chunk: float32 ``(channels, frames * samples_per_frame)`` on CPU, cut from the step's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_omni_moss.testing.upstream_files import load_streaming_attention

__all__ = [
    "PlannedStep",
    "StageChunk",
    "UpstreamStage",
    "enable_triton_attention",
    "load_streaming_attention",
    "plan_steps",
]

# ------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class StageChunk:
    """One request's chunk in a stage batch: ``codes`` int ``(n_vq, T)`` (any device), ``finished`` = tail."""

    request_id: str
    codes: torch.Tensor
    finished: bool = False

    @property
    def frames(self) -> int:
        return int(self.codes.shape[1])


@dataclass
class PlannedStep:
    """One pool step: ``rows`` = (index into the batch, first frame, end frame, terminal) per row."""

    rows: list[tuple[int, int, int, bool]] = field(default_factory=list)

    @property
    def frames(self) -> int:
        """The step's frame count before any graph padding: its longest row."""
        return max(end - start for _, start, end, _ in self.rows)

    @property
    def all_terminal(self) -> bool:
        return all(terminal for *_, terminal in self.rows)


def _smallest_at_least(sizes: Sequence[int], value: int) -> int | None:
    return next((s for s in sorted(sizes) if s >= value), None)


def plan_steps(
    frames: Sequence[int],
    finished: Sequence[bool],
    *,
    graph_frame_sizes: Sequence[int],
    pad_tails: bool,
    max_step_frames: int,
) -> list[PlannedStep]:
    """Upstream 0.30.0's split of one stage batch into pool steps (pure bookkeeping, no tensors).

    Args:
        frames: frame count of each chunk of the batch (>= 1), in batch order.
        finished: whether each chunk is its stream's terminal chunk.
        graph_frame_sizes: the captured graph frame sizes.
        pad_tails: upstream's tail grouping is on (graphs exist and a batch bucket covers the capacity).
        max_step_frames: longer chunks are cut into single-row steps of at most this many frames.
    Returns:
        The steps in execution order: first the single-row pieces of long chunks (batch order), then one step
        per group, groups in order of first appearance.
    """
    if len(frames) != len(finished):
        raise ValueError(f"{len(frames)} frame counts but {len(finished)} finished flags")
    steps: list[PlannedStep] = []
    groups: dict[int, PlannedStep] = {}
    for index, (count, last) in enumerate(zip(frames, finished)):
        count = int(count)
        if count < 1:
            raise ValueError(f"chunk {index} has {count} frames; every chunk needs at least one")
        if count > max_step_frames:
            for start in range(0, count, max_step_frames):
                end = min(start + max_step_frames, count)
                steps.append(PlannedStep([(index, start, end, bool(last) and end == count)]))
            continue
        key = count
        if pad_tails and last:
            key = _smallest_at_least(graph_frame_sizes, count) or count
        groups.setdefault(key, PlannedStep()).rows.append((index, 0, count, bool(last)))
    return steps + list(groups.values())


# ------------------------------------------------------------------------------------------ attention


def enable_triton_attention(model: torch.nn.Module, attention_class: type, directory: Path | None = None) -> int:
    """Give every decoder attention module of upstream's model the wheel's Triton masked attention
    (:func:`vllm_omni_moss.testing.upstream_files.load_streaming_attention`; ``directory`` defaults to the
    located ``moss_tts`` files).

    This is what upstream's codec stage does for ``codec_attention_backend: triton`` (CUDA only).

    Returns:
        The number of attention modules switched.
    """
    kernel = load_streaming_attention(directory).masked_attention
    switched = 0
    for module in model.decoder.modules():
        if isinstance(module, attention_class):
            module._streaming_attention = kernel
            switched += 1
    return switched


# ------------------------------------------------------------------------------------------ the stage


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    codes: torch.Tensor  # (n_vq, bucket, T) int64
    lengths: torch.Tensor  # (bucket,) int64
    slot_ids: torch.Tensor  # (bucket,) int64
    valid: torch.Tensor  # (bucket,) bool
    audio: torch.Tensor  # (bucket, channels, T * samples_per_frame)


class UpstreamStage:
    """Upstream's Stage-1 streaming policy driving upstream's model, one call per stage batch.

    Args:
        model: upstream's ``MossAudioTokenizerModel`` (v2), on CPU or CUDA, weights and decode table ready.
        state_capacity: ``N``, live streams at most.
        graph_batch_sizes: graph batch buckets; sizes outside ``1..N`` are ignored (as upstream does).
        graph_frame_sizes: graph frame sizes (the distinct chunk sizes of the schedule).
        n_vq: codebooks per frame of every chunk.
        max_step_frames: chunks longer than this are cut into single-row steps.
        samples_per_frame: audio samples per channel per code frame (``downsample_rate``).

    Graphs are captured at construction on CUDA when both size lists are non-empty; ``graph_failures`` maps a
    (bucket, T) key whose capture failed to the error (that key then runs eagerly).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        state_capacity: int,
        *,
        graph_batch_sizes: Sequence[int],
        graph_frame_sizes: Sequence[int],
        n_vq: int,
        max_step_frames: int,
        samples_per_frame: int,
    ):
        if state_capacity < 1 or max_step_frames < 1:
            raise ValueError(
                f"state_capacity and max_step_frames must be >= 1, got {state_capacity}, {max_step_frames}"
            )
        self.model = model
        self.state_capacity = int(state_capacity)
        self.n_vq = int(n_vq)
        self.max_step_frames = int(max_step_frames)
        self.samples_per_frame = int(samples_per_frame)
        self.device = next(model.parameters()).device
        on_gpu = self.device.type == "cuda"
        self.graph_batch_sizes = sorted({int(b) for b in graph_batch_sizes if 0 < int(b) <= state_capacity})
        self.graph_frame_sizes = sorted({int(t) for t in graph_frame_sizes if int(t) > 0})
        self.scratch_capacity = max(self.graph_batch_sizes, default=0) if on_gpu else 0
        self.num_slots = self.state_capacity + self.scratch_capacity
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.graph_failures: dict[tuple[int, int], str] = {}
        self.steps_by_path = {"graph": 0, "eager": 0}
        self.decoded_frames = 0
        self.padded_frames = 0
        self._free = list(range(self.state_capacity - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self._closed = False
        with torch.no_grad():
            try:
                model.initialize_decoder_state_pool(self.state_capacity, self.scratch_capacity)
            except BaseException:
                # Out of memory part-way: upstream's modules are left streaming; close the pool so that the next
                # stage on this model can start (the error still reaches the caller).
                model.close_decoder_state_pool()
                raise
        if on_gpu and self.graph_batch_sizes and self.graph_frame_sizes:
            self._capture_all()
            self._reset(list(range(self.num_slots)))
        # Upstream pads tails only when some bucket holds every live stream (a merged group always fits).
        self.pad_tails = bool(self.graphs) and max(self.graph_batch_sizes, default=0) >= self.state_capacity

    # ------------------------------------------------------------------ slots
    def _reset(self, slots: Sequence[int]) -> None:
        if slots:
            ids = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
            self.model.reset_decoder_state_slots(ids)

    def release(self, request_ids: Sequence[str]) -> None:
        """Abort: reset and free the slots of these live requests (unknown ids are ignored)."""
        slots = [self._slots.pop(rid) for rid in request_ids if rid in self._slots]
        self._reset(slots)
        self._free.extend(slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ graphs
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        keys = sorted(((b, t) for b in self.graph_batch_sizes for t in self.graph_frame_sizes), reverse=True)
        for key in keys:
            try:
                self.graphs[key] = self._capture(*key, pool)
            except Exception as exc:  # noqa: BLE001 - a failed key runs eagerly, as upstream does
                self.graph_failures[key] = f"{type(exc).__name__}: {exc}"[:500]
                torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _capture(self, bucket: int, frames: int, pool) -> _Graph:
        dev = self.device
        codes = torch.zeros(self.n_vq, bucket, frames, dtype=torch.long, device=dev)
        lengths = torch.zeros(bucket, dtype=torch.long, device=dev)
        slot_ids = self.state_capacity + torch.arange(bucket, dtype=torch.long, device=dev)
        valid = torch.zeros(bucket, dtype=torch.bool, device=dev)
        step = self.model.decode_streaming_tensors
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(3):
                step(codes, lengths, slot_ids, valid)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.model.reset_decoder_state_slots(slot_ids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            audio, _ = step(codes, lengths, slot_ids, valid)
        return _Graph(graph, codes, lengths, slot_ids, valid, audio)

    def _graph_for(self, rows: int, frames: int, pad_frames: bool) -> _Graph | None:
        bucket = _smallest_at_least(self.graph_batch_sizes, rows)
        if frames in self.graph_frame_sizes:
            size = frames
        else:
            size = _smallest_at_least(self.graph_frame_sizes, frames) if pad_frames else None
        if bucket is None or size is None:
            return None
        return self.graphs.get((bucket, size))

    def _replay(self, g: _Graph, codes: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        rows, frames = codes.shape[1], codes.shape[2]
        g.codes.zero_()
        g.codes[:, :rows, :frames].copy_(codes)
        g.lengths.zero_()
        g.lengths[:rows] = frames
        g.slot_ids.copy_(self.state_capacity + torch.arange(g.slot_ids.shape[0], device=self.device))
        g.slot_ids[:rows].copy_(slot_ids)
        g.valid.zero_()
        g.valid[:rows] = True
        g.graph.replay()
        return g.audio[:rows]

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, chunks: Sequence[StageChunk]) -> dict[str, torch.Tensor]:
        """Decode one stage batch (at most one chunk per request); returns audio per request id.

        Raises:
            RuntimeError: closed, or more new streams than free slots (upstream refuses too).
            ValueError: a request twice in the batch, or an empty chunk.
        """
        if self._closed:
            raise RuntimeError("this UpstreamStage is closed")
        ids = [c.request_id for c in chunks]
        if len(set(ids)) != len(ids):
            raise ValueError("a request appears twice in one stage batch")
        new = [rid for rid in ids if rid not in self._slots]
        if len(new) > len(self._free):
            raise RuntimeError(f"{len(new)} new streams but {len(self._free)} free of {self.state_capacity} slots")
        for rid in new:
            self._slots[rid] = self._free.pop()
        plan = plan_steps(
            [c.frames for c in chunks],
            [c.finished for c in chunks],
            graph_frame_sizes=self.graph_frame_sizes,
            pad_tails=self.pad_tails,
            max_step_frames=self.max_step_frames,
        )
        parts: dict[int, list[torch.Tensor]] = {}
        for step in plan:
            for (index, *_), wav in zip(step.rows, self._run_step(step, chunks)):
                parts.setdefault(index, []).append(wav)
        for chunk in chunks:
            if chunk.finished:
                self._free.append(self._slots.pop(chunk.request_id))
        return {c.request_id: torch.cat(parts[i], dim=-1) for i, c in enumerate(chunks)}

    def _run_step(self, step: PlannedStep, chunks: Sequence[StageChunk]) -> list[torch.Tensor]:
        frames = step.frames
        codes = torch.zeros(self.n_vq, len(step.rows), frames, dtype=torch.long, device=self.device)
        own = []
        for b, (index, start, end, _) in enumerate(step.rows):
            codes[:, b, : end - start] = chunks[index].codes[:, start:end].to(self.device, torch.long)
            own.append(end - start)
        slots = [self._slots[chunks[index].request_id] for index, *_ in step.rows]
        slot_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        graph = self._graph_for(len(slots), frames, pad_frames=step.all_terminal) if self.graphs else None
        if graph is not None:
            audio = self._replay(graph, codes, slot_ids)
            step_frames = graph.codes.shape[2]
            self.steps_by_path["graph"] += 1
        else:
            lengths = torch.full((len(slots),), frames, dtype=torch.long, device=self.device)
            valid = torch.ones(len(slots), dtype=torch.bool, device=self.device)
            audio = self.model.decode_streaming_batch(codes, lengths, slot_ids, valid).audio
            step_frames = frames
            self.steps_by_path["eager"] += 1
        self.decoded_frames += sum(own)
        self.padded_frames += sum(step_frames - t for t in own)
        terminal = [slot for slot, (*_, last) in zip(slots, step.rows) if last]
        self._reset(terminal)
        audio = audio.float().cpu()
        return [audio[b, :, : t * self.samples_per_frame].clone() for b, t in enumerate(own)]

    def stats(self) -> dict[str, object]:
        """``steps_by_path`` {graph, eager}, ``decoded_frames`` (real frames) and ``padded_frames`` (frames
        of real rows beyond their own length in their step, graph frame padding included)."""
        return {
            "steps_by_path": dict(self.steps_by_path),
            "decoded_frames": self.decoded_frames,
            "padded_frames": self.padded_frames,
        }

    def close(self) -> None:
        """Drop the graphs and upstream's state pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.graphs.clear()
        self.model.close_decoder_state_pool()
        self._slots.clear()
        self._free.clear()
