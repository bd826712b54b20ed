# SPDX-License-Identifier: Apache-2.0
"""A request's stream as the scheduler keeps it, the admission queue of streams waiting for a slot, the frozen
work of one stream that the scheduler hands the step runner (:class:`ScheduledChunks`) and the frozen steps the
runner cuts it into (:class:`StepBatch`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..graph_ladder import StepShape

__all__ = ["AdmissionQueue", "ScheduledChunks", "StepBatch", "Stream"]


@dataclass
class Stream:
    """One request's stream.

    Attributes:
        request_id: the engine's request id.
        slot: the pool slot it holds, None while it waits.
        chunks: ``(n_vq, T)`` integer codes as the caller sent them (any code dtype, on the caller's device),
            clamped when a step stages them; the session's own copies once a decode call returns with them
            still buffered.
        finished: its terminal chunk arrived.
        waiting_since: ``time.monotonic()`` when it started to wait, None while live.
        saved: the state of a preempted stream, restored when it gets a slot back.
        frames_decoded: frames of its own decoded so far (the host's count).
        preemptions: times it was preempted (the scheduler preempts the least preempted stream first).
        error: why it ended when a pool call for it raised outside a step (``Scheduler._failed``), else None.
    """

    request_id: str
    slot: int | None = None
    chunks: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    waiting_since: float | None = None
    saved: object | None = None
    frames_decoded: int = 0
    preemptions: int = 0
    error: str | None = None

    @property
    def buffered_frames(self) -> int:
        return sum(c.shape[1] for c in self.chunks)


@dataclass(frozen=True)
class ScheduledChunks:
    """One live stream's buffered chunks, taken by :meth:`.scheduler.Scheduler.schedule` for the step runner:
    the runner reads this and never the scheduler's :class:`Stream`; what it decoded goes back through
    :meth:`.scheduler.Scheduler.update`.

    Attributes:
        request_id: the engine's request id.
        slot: the pool slot the stream holds (its state reserved for every frame of ``chunks``).
        chunks: ``(n_vq, T)`` integer codes in arrival order, as :attr:`Stream.chunks` held them.
    """

    request_id: str
    slot: int
    chunks: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StepBatch:
    """One step of a decode call, decided once on the host before it is staged: its rows, their slots and codes,
    its shape and whether a CUDA graph runs it.

    Attributes:
        request_ids: the stream of each row.
        slots: the pool slot of each row (distinct, in use).
        pieces: ``(n_vq, valid_frames[b])`` integer codes of each row, as the scheduler handed them.
        valid_frames: the valid frames of each row, ``1..shape.frames``.
        shape: the step's :class:`~..graph_ladder.StepShape` (``graph_ladder.StepLadder.shape``): its rows
            (these, then padding rows), frames and packed frames (these rows' frames, then dummies).
        graph: the captured CUDA graph of ``shape`` replays the step; False: the eager step of the same shape.
    """

    request_ids: tuple[str, ...]
    slots: tuple[int, ...]
    pieces: tuple[torch.Tensor, ...]
    valid_frames: tuple[int, ...]
    shape: StepShape
    graph: bool = False

    @property
    def rows(self) -> int:
        """``B``, the step's real rows."""
        return len(self.slots)

    @property
    def padding_rows(self) -> int:
        """Rows of the step's shape beyond its real rows."""
        return self.shape.rows - self.rows


class AdmissionQueue:
    """Streams waiting for a slot, with their buffered chunks: preempted streams first, in the order they were
    preempted, then new streams, in the order they arrived (each stream behind every one that started to wait
    before it in its class).

    Args:
        max_streams: streams that may wait.
        max_frames: code frames that waiting streams may buffer in total.
    """

    def __init__(self, max_streams: int, max_frames: int):
        self.max_streams = max_streams
        self.max_frames = max_frames
        self._preempted: OrderedDict[str, Stream] = OrderedDict()
        self._new: OrderedDict[str, Stream] = OrderedDict()
        # Frames each waiting stream buffers as the queue counted them, and their sum: a bound check costs O(1),
        # not a pass over every waiting stream's chunks (a call routing one chunk to each of N waiting streams
        # would otherwise take O(N^2)). Chunks reach a waiting stream only through add_chunk.
        self._frames: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._preempted) + len(self._new)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._preempted or request_id in self._new

    @property
    def request_ids(self) -> list[str]:
        """Waiting request ids, the next to be admitted first."""
        return [*self._preempted, *self._new]

    @property
    def buffered_frames(self) -> int:
        """Code frames the waiting streams buffer, in total."""
        return self._total

    def _enter(self, stream: Stream) -> None:
        frames = stream.buffered_frames
        self._frames[stream.request_id] = frames
        self._total += frames

    def _leave(self, request_id: str) -> None:
        self._total -= self._frames.pop(request_id, 0)

    def add_chunk(self, stream: Stream, codes) -> None:
        """Buffer ``codes`` (``(n_vq, T)``) in waiting ``stream``, counted against the queue's frame bound."""
        stream.chunks.append(codes)
        self._frames[stream.request_id] += codes.shape[1]
        self._total += codes.shape[1]

    def get(self, request_id: str) -> Stream | None:
        return self._preempted.get(request_id) or self._new.get(request_id)

    def refusal(self, frames: int, *, new_stream: bool, capacity: int) -> str | None:
        """Why ``frames`` more frames (of a new stream, or of a waiting one) cannot wait, or None."""
        if new_stream and len(self) >= self.max_streams:
            return (
                f"all {capacity} decoder slots are busy and the admission queue is full "
                f"({len(self)} of max_waiting_streams={self.max_streams} streams waiting)"
            )
        buffered = self.buffered_frames + frames
        if buffered > self.max_frames:
            return (
                f"all {capacity} decoder slots are busy and waiting streams would buffer "
                f"{buffered} frames, over max_waiting_frames={self.max_frames}"
            )
        return None

    def push(self, stream: Stream) -> None:
        """Queue a new stream behind every waiting one."""
        stream.waiting_since = time.monotonic()
        self._new[stream.request_id] = stream
        self._enter(stream)

    def _head(self) -> OrderedDict[str, Stream]:
        return self._preempted if self._preempted else self._new

    def pop_oldest(self) -> Stream:
        rid, stream = self._head().popitem(last=False)
        self._leave(rid)
        return stream

    def peek_oldest(self) -> Stream:
        return next(iter(self._head().values()))

    def push_preempted(self, stream: Stream) -> None:
        """Queue a preempted stream behind the streams preempted before it and ahead of every new one (outside
        the queue's bounds: it was live)."""
        stream.waiting_since = time.monotonic()
        self._preempted[stream.request_id] = stream
        self._enter(stream)

    def drop(self, request_id: str) -> None:
        self._preempted.pop(request_id, None)
        self._new.pop(request_id, None)
        self._leave(request_id)

    def clear(self) -> None:
        self._preempted.clear()
        self._new.clear()
        self._frames.clear()
        self._total = 0
