# SPDX-License-Identifier: Apache-2.0
"""streams: a ``Stream``, the ``AdmissionQueue`` (preempted streams first, then new ones; its bounds) and the
frozen ``ScheduledChunks`` / ``StepBatch``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepShape
from vllm_omni_moss.model_executor.models.moss_tts.serving.streams import (
    AdmissionQueue,
    ScheduledChunks,
    StepBatch,
    Stream,
)

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_preempted_streams_wait_ahead_of_new_ones():
    queue = AdmissionQueue(max_streams=2, max_frames=6)
    new = [Stream("n1", chunks=[torch.zeros(1, 2)]), Stream("n2", chunks=[torch.zeros(1, 1), torch.zeros(1, 2)])]
    for s in new:
        queue.push(s)
    queue.push_preempted(Stream("p", chunks=[torch.zeros(1, 1)]))
    assert queue.request_ids == ["p", "n1", "n2"] and len(queue) == 3 and "n2" in queue
    assert queue.buffered_frames == 6 and new[1].buffered_frames == 3 and new[0].waiting_since is not None
    assert queue.peek_oldest().request_id == "p" and queue.pop_oldest().request_id == "p"
    queue.drop("n1")
    assert queue.request_ids == ["n2"] and queue.get("n1") is None and queue.get("n2") is new[1]


def test_the_queue_refuses_past_its_bounds_with_exact_messages():
    queue = AdmissionQueue(max_streams=1, max_frames=4)
    assert queue.refusal(4, new_stream=True, capacity=2) is None
    queue.push(Stream("a", chunks=[torch.zeros(1, 3)]))
    assert queue.refusal(1, new_stream=True, capacity=2) == (
        "all 2 decoder slots are busy and the admission queue is full (1 of max_waiting_streams=1 streams waiting)"
    )
    assert queue.refusal(1, new_stream=False, capacity=2) is None
    assert queue.refusal(2, new_stream=False, capacity=2) == (
        "all 2 decoder slots are busy and waiting streams would buffer 5 frames, over max_waiting_frames=4"
    )
    queue.clear()
    assert len(queue) == 0 and queue.request_ids == []


def test_the_queue_counts_the_frames_it_was_given_whatever_a_stream_does_later():
    # The count is kept as streams enter, gain chunks (add_chunk) and leave; a stream that empties its chunks
    # before it leaves (a failed stream) still takes its counted frames out.
    queue = AdmissionQueue(max_streams=4, max_frames=100)
    a, b = Stream("a", chunks=[torch.zeros(1, 2)]), Stream("b")
    queue.push(a)
    queue.push(b)
    queue.add_chunk(b, torch.zeros(1, 5))
    queue.add_chunk(a, torch.zeros(1, 1))
    assert queue.buffered_frames == 8 == a.buffered_frames + b.buffered_frames and a.buffered_frames == 3
    queue.push_preempted(Stream("p", chunks=[torch.zeros(1, 4)]))
    assert queue.buffered_frames == 12
    assert queue.refusal(89, new_stream=False, capacity=1) == (
        "all 1 decoder slots are busy and waiting streams would buffer 101 frames, over max_waiting_frames=100"
    )
    assert queue.pop_oldest().request_id == "p" and queue.buffered_frames == 8
    b.chunks = []  # as a failing stream's chunks are dropped before it leaves the queue
    queue.drop("b")
    queue.drop("b")  # a second drop changes nothing
    assert queue.buffered_frames == 3 and queue.request_ids == ["a"]
    queue.clear()
    assert queue.buffered_frames == 0


def test_scheduled_chunks_and_step_batches_are_frozen():
    chunk = torch.zeros(2, 3, dtype=torch.long)
    work = ScheduledChunks("a", 1, (chunk,))
    batch = StepBatch(("a", "b"), (1, 0), (chunk, chunk[:, :1]), (3, 1), StepShape(4, 3, 8), graph=True)
    assert (batch.rows, batch.padding_rows) == (2, 2)
    for record, field in ((work, "slot"), (batch, "graph")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, None)
