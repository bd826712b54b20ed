# SPDX-License-Identifier: Apache-2.0
"""Scheduler, built alone with a pool and counters (as vLLM's tests/v1/core builds its scheduler): the frozen
round it schedules, what it takes back, admission, the queue's bounds, the rounds of one call."""

from __future__ import annotations

import dataclasses

import pytest
from moss_codecs import stream_codes as _codes

from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest, SessionOptions
from vllm_omni_moss.model_executor.models.moss_tts.serving.counters import SessionCounters
from vllm_omni_moss.model_executor.models.moss_tts.serving.scheduler import Scheduler, SchedulerOutput
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import RunnerOutput, StepRunner
from vllm_omni_moss.model_executor.models.moss_tts.serving.tracing import CallTracer
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def _scheduler(decoder, slots: int, max_waiting_streams: int = 64, max_waiting_frames: int = 4096):
    pool = build_pool(decoder, StateSpec.from_options(decoder))
    pool.initialize(slots, 0)
    counters = SessionCounters()
    return Scheduler(pool, slots, max_waiting_streams, max_waiting_frames, counters), pool, counters


def test_the_step_runner_reads_frozen_scheduled_chunks_and_the_scheduler_counts_what_it_decoded(ring_decoder):
    """One way, with a scheduler and a step runner built alone: ``Scheduler.schedule`` takes each ready stream's
    chunks out of its ``Stream`` into a frozen ``SchedulerOutput`` of ``ScheduledChunks`` (the same tensors, in
    order); ``StepRunner.execute`` returns a frozen ``RunnerOutput``; ``Scheduler.update`` adds the frames it
    decoded, a chunk longer than a piece counted whole."""
    options = SessionOptions(4, max_step_frames=4)
    pool = build_pool(ring_decoder, StateSpec.from_options(ring_decoder))
    pool.initialize(4, 0)
    counters, n_vq = SessionCounters(), ring_decoder.config.num_quantizers
    scheduler = Scheduler(pool, 4, 64, 4096, counters)
    runner = StepRunner(pool, n_vq, options.step_ladder, counters, CallTracer())
    chunks = {"a": _codes(ring_decoder, 3, 1), "b": _codes(ring_decoder, 9, 2)}  # b: 9 frames > 4 a piece
    output = scheduler.schedule([ChunkRequest(rid, c) for rid, c in chunks.items()])
    assert [(w.request_id, w.slot, w.chunks) for w in output.chunks] == [
        ("a", 0, (chunks["a"],)),
        ("b", 1, (chunks["b"],)),
    ]
    assert (output.admitted, output.refused, output.failures, output.ending) == (("a", "b"), {}, {}, ())
    assert all(scheduler.live[rid].chunks == [] for rid in chunks)  # taken, not shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        output.chunks = ()  # frozen
    result = runner.execute(output)
    assert result.decoded_frames == {"a": 3, "b": 9} and result.errors == {}
    assert [r.shape[-1] for r in result.audio["b"]] == [4 * 8, 4 * 8, 8]  # 8 samples a frame: pieces of 4, 4, 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.errors = {}  # frozen
    update = scheduler.update(output, result)
    assert (update.step_errors, update.failures, update.schedule_again) == ({}, {}, False)
    assert {rid: st.frames_decoded for rid, st in scheduler.live.items()} == {"a": 3, "b": 9}
    second = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 2, 3), True)])
    assert [(w.request_id, w.slot) for w in second.chunks] == [("a", 0)] and second.ending == ("a",)
    assert scheduler.update(second, runner.execute(second)).schedule_again is False
    assert list(scheduler.live) == ["b"] and pool.free_slot_count == 3 and counters.decoded_frames == 14


def test_a_full_queue_refuses_the_chunk_in_the_round_and_a_freed_slot_schedules_another_round(ring_decoder):
    """One slot, one waiting stream at most: "a" is admitted, "b" waits, "c" is refused with the queue's exact error
    (and stays refused); "a"'s terminal chunk frees its slot in the round's update, which asks for another round;
    that round admits "b" and takes its buffered chunk."""
    scheduler, pool, counters = _scheduler(ring_decoder, 1, max_waiting_streams=1)
    a, b, c = (_codes(ring_decoder, 2, seed) for seed in (1, 2, 3))
    first = scheduler.schedule([ChunkRequest("a", a), ChunkRequest("b", b), ChunkRequest("c", c)])
    full = "all 1 decoder slots are busy and the admission queue is full (1 of max_waiting_streams=1 streams waiting)"
    assert first.refused == {"c": full} and first.admitted == ("a",) and scheduler.waiting.request_ids == ["b"]
    assert [w.request_id for w in first.chunks] == ["a"] and first.ending == ()
    done = scheduler.update(first, RunnerOutput(decoded_frames={"a": 2}))
    assert done == type(done)({}, {}, False) and scheduler.refused == {"c": full}
    ending = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 1, 4), True)])
    assert ending.ending == ("a",) and [w.request_id for w in ending.chunks] == ["a"]
    update = scheduler.update(ending, RunnerOutput(decoded_frames={"a": 1}))
    assert update.schedule_again is True and pool.free_slot_count == 1 and list(scheduler.live) == []
    again = scheduler.schedule()
    assert again.admitted == ("b",) and [(w.request_id, w.chunks) for w in again.chunks] == [("b", (b,))]
    assert counters.admitted_from_queue == 1 and counters.streams_by_preemptions == {0: 1}


def test_a_step_error_ends_its_stream_and_keeps_its_id_refused(ring_decoder):
    """A result whose step raised for "a": update ends the stream (slot free), reports the error as the step's, and
    every later chunk under the id gets that error until its terminal chunk."""
    scheduler, pool, _ = _scheduler(ring_decoder, 2)
    output = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 2, 1))])
    update = scheduler.update(output, RunnerOutput(decoded_frames={"a": 0}, errors={"a": "request 'a': boom"}))
    assert update.step_errors == {"a": "request 'a': boom"} and update.failures == {} and not update.schedule_again
    assert scheduler.live == {} and pool.free_slot_count == 2
    later = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 1, 2))])
    assert later.refused == {"a": "request 'a': boom"} and later.chunks == ()
    last = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 1, 3), True)])
    assert last.refused == {"a": "request 'a': boom"} and scheduler.refused == {}


def test_a_round_is_updated_once_and_none_is_scheduled_over_one_holding_chunks(ring_decoder):
    """A round's chunks have left their streams: scheduling again before update() would lose them, and updating a
    round twice would count its frames twice. Both are refused with nothing changed; its mappings are read-only."""
    scheduler, pool, _ = _scheduler(ring_decoder, 2)
    first = scheduler.schedule([ChunkRequest("a", _codes(ring_decoder, 2, 1), True)])
    with pytest.raises(RuntimeError, match=r"^Scheduler.schedule: the round scheduled before holds chunks that "):
        scheduler.schedule([ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    assert list(scheduler.live) == ["a"] and [w.request_id for w in first.chunks] == ["a"]  # b was not routed
    with pytest.raises(TypeError):
        first.refused["a"] = "x"  # read-only
    scheduler.update(first, RunnerOutput(decoded_frames={"a": 2}))
    with pytest.raises(RuntimeError, match=r"^Scheduler.update: this round is not the one last scheduled "):
        scheduler.update(first, RunnerOutput(decoded_frames={"a": 2}))
    assert scheduler.live == {} and pool.free_slot_count == 2
    empty = scheduler.schedule([])  # a round with nothing to decode may be scheduled over
    stale = scheduler.schedule([ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    with pytest.raises(RuntimeError, match=r"^Scheduler.update: this round is not the one last scheduled "):
        scheduler.update(empty, RunnerOutput())
    assert scheduler.update(stale, RunnerOutput(decoded_frames={"b": 1})).schedule_again is False
    assert scheduler.live["b"].frames_decoded == 1


def test_an_empty_output_is_frozen_and_holds_nothing():
    output = SchedulerOutput()
    assert (output.chunks, output.refused, output.admitted, output.resumed, output.preempted) == ((), {}, (), (), ())
    assert (output.failures, output.ending) == ({}, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        output.ending = ("a",)
