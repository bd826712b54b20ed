# SPDX-License-Identifier: Apache-2.0
"""CodecStreamSession: one step per batch, exact padded tails, slots, lifecycle, admission queue,
per-request errors, clamping.

Every request's audio is compared with its solo fixed-width reference decode
``decoder.decode(codes[:, None], chunk_frames=<the chunk sizes it was fed>)``.
"""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch
from moss_codecs import ChunkDriver as _Driver
from moss_codecs import assert_close_to_solo as _close
from moss_codecs import count_steps as _count_steps
from moss_codecs import make_session, random_codes
from moss_codecs import solo_decode as _solo
from moss_codecs import stream_codes as _codes

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepLadder, StepShape, frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import (
    ChunkRequest,
    CodecStreamSession,
    SessionOptions,
)
from vllm_omni_moss.model_executor.models.moss_tts.serving.requests import InvalidRequestId
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import StepPlanner, StepRunner
from vllm_omni_moss.model_executor.models.moss_tts.serving.streams import StepBatch
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


# ----------------------------------------------------------------------------- parity and grouping


@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_mixed_batches_equal_solo_decodes(kind, ring_decoder, monkeypatch):
    """Staggered starts, chunks of different lengths packed into one step per round (no graph sizes: each step
    shaped exactly, its rows, its longest piece and its real frames), a long chunk split into pieces, terminals
    mid-script: each request gets exactly its solo decode."""
    s = make_session(ring_decoder, 4, pool_kind=kind, max_step_frames=3)
    steps = _count_steps(s, monkeypatch)
    d = _Driver(s, ring_decoder)
    for rid, frames, seed in (("a", 14, 1), ("b", 9, 2), ("c", 6, 3), ("d", 4, 4)):
        d.add(rid, frames, seed)
    d.step([("a", 1, False)])
    d.step([("a", 3, False), ("b", 1, False), ("c", 1, False)])
    assert steps[-1:] == [(3, 3, 5)]  # one step: b and c beside a's 3 frames, 5 frames packed
    d.step([("a", 3, False), ("b", 3, False), ("c", 2, False), ("d", 1, False)])
    d.step([("a", 5, False), ("b", 2, False), ("c", 3, True), ("d", 3, True)])  # a: split 3 + 2
    assert steps[-2:] == [(4, 3, 11), (1, 2, 2)]  # the second piece of a runs alone, in the next round
    assert s.free_slots == 2 and set(s.live_requests) == {"a", "b"}
    d.step([("b", 3, True), ("a", 0, False)])
    d.step([("a", 2, True)])
    assert s.free_slots == 4 and not s.live_requests
    for rid in "abcd":
        d.check(rid)
    assert d.schedule["a"] == [1, 3, 3, 3, 2, 2]
    assert steps == [(1, 1, 1), (3, 3, 5), (4, 3, 9), (4, 3, 11), (1, 2, 2), (1, 3, 3), (1, 2, 2)]
    assert s.stats()["steps_by_path"] == {"graph": 0, "eager": 7}
    # Exact shapes: no dummy frame, no padding row.
    assert s.stats()["padded_frames"] == 0 and s.stats()["padding_rows"] == 0 and s.stats()["decoded_frames"] == 33


def test_graph_replays_count_the_padding_rows_and_frames_of_their_shapes(ring_decoder):
    """A step of B rows and F real frames that replays the graph of its shape (R rows, F' >= F packed frames)
    carries R - B padding rows and F' - F dummy frames: the session counts both (stats()["padding_rows"],
    stats()["padded_frames"]) and stages the real rows first, the padding rows after them (valid frames 0, the
    graph's own padding slot ids, not valid). The graph runner is a stand-in here (CPU): it holds the shapes of
    totals 4 and 8 (4 slots, 4 frames a row) and returns zero audio."""
    s = make_session(ring_decoder, 4, graph_frame_totals=(1, 2, 4, 8), graph_frame_sizes=(1, 4))
    spf, channels = ring_decoder.config.samples_per_frame, ring_decoder.config.number_channels
    replays = []

    class Graphs:
        graphs = {StepShape(4, 4, 4): None, StepShape(4, 4, 8): None}

        def buffers(self, shape):
            R, F = shape.rows, shape.total_frames
            self.staged = types.SimpleNamespace(
                codes=torch.zeros(s.n_vq, F, dtype=torch.long), valid_frames=torch.zeros(R, dtype=torch.long),
                slot_ids=torch.zeros(R, dtype=torch.long), valid=torch.zeros(R, dtype=torch.bool),
                padding_host=torch.full((R,), 9, dtype=torch.long),
            )  # fmt: skip
            return self.staged

        def replay(self, shape):
            g = self.staged
            replays.append((shape, g.valid_frames.tolist(), g.slot_ids.tolist(), g.valid.tolist()))
            return torch.zeros(channels, shape.total_frames * spf)

        def close(self):
            pass

    runner = s.step_runner  # the same runner over a stand-in graph runner: its planner holds the captured shapes
    s.step_runner = StepRunner(runner.pool, s.n_vq, runner.ladder, runner.counters, runner.tracer, graphs=Graphs())
    codes = random_codes(ring_decoder, 1, 4, seed=3)[:, 0]
    s.decode([ChunkRequest(r, codes[:, :1]) for r in "abc"])  # 3 rows of 1 frame: total 4, 4 rows
    got = s.decode([ChunkRequest(r, codes[:, :3]) for r in "ab"])  # 2 rows of 3 frames: total 8, 4 rows
    assert replays == [
        (StepShape(4, 4, 4), [1, 1, 1, 0], [0, 1, 2, 9], [True, True, True, False]),
        (StepShape(4, 4, 8), [3, 3, 0, 0], [0, 1, 9, 9], [True, True, False, False]),
    ]
    assert got["a"].audio.shape == (channels, 3 * spf) and not got["a"].audio.any()
    stats = s.stats()
    assert stats["steps_by_path"] == {"graph": 2, "eager": 0}
    assert stats["padding_rows"] == 1 + 2 and stats["padded_frames"] == 1 + 2 and stats["decoded_frames"] == 9


def test_long_chunk_split_matches_split_reference(ring_decoder, monkeypatch):
    s = make_session(ring_decoder, 2, max_step_frames=2)
    steps = _count_steps(s, monkeypatch)
    codes = _codes(ring_decoder, 7, seed=9)
    out = s.decode([ChunkRequest("x", codes, True)])["x"]
    assert steps == [(1, 2, 2), (1, 2, 2), (1, 2, 2), (1, 1, 1)]
    _close(out.audio, _solo(ring_decoder, codes, [2, 2, 2, 1]), "x")
    assert out.frames == 7 and s.free_slots == 2


def test_v1_codec_legacy_pool_equals_solo(ring_decoder_v1):
    s = make_session(ring_decoder_v1, 3)
    assert type(s.pool).__name__ == "LegacyDecoderStatePool"
    d = _Driver(s, ring_decoder_v1)
    d.add("a", 9, 5)
    d.add("b", 5, 6)
    d.step([("a", 1, False), ("b", 1, False)])
    d.step([("a", 4, False), ("b", 4, True)])
    d.step([("a", 4, True)])
    d.check("a")
    d.check("b")


def test_tiny_presets_equal_solo(tiny_decoder):
    s = make_session(tiny_decoder, 2)
    d = _Driver(s, tiny_decoder)
    d.add("a", 4, 1)
    d.add("b", 3, 2)
    d.step([("a", 1, False), ("b", 1, False)])
    d.step([("a", 3, True), ("b", 2, True)])
    d.check("a")
    d.check("b")


# ----------------------------------------------------------------------------- slots and lifecycle


def test_slots_are_lifo(ring_decoder):
    s = make_session(ring_decoder, 4)
    one = {rid: ChunkRequest(rid, _codes(ring_decoder, 1, i)) for i, rid in enumerate("abc")}
    s.decode(list(one.values()))
    assert s.live_requests == {"a": 0, "b": 1, "c": 2}
    s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 7), True)])
    s.decode([ChunkRequest("d", _codes(ring_decoder, 1, 8))])
    assert s.live_requests["d"] == 1  # the slot released last is acquired first
    s.on_requests_finished(["a"])
    s.on_requests_finished(["c"])
    s.decode([ChunkRequest("e", _codes(ring_decoder, 1, 9)), ChunkRequest("f", _codes(ring_decoder, 1, 10))])
    assert s.live_requests["e"] == 2 and s.live_requests["f"] == 0


def test_plan_round_decides_each_step_once_as_a_frozen_step_batch(ring_decoder):
    """``StepPlanner.plan_round`` turns one round of pieces into frozen ``StepBatch`` records: one step for the
    whole round, shortest rows first, with their slots, the pieces themselves, their valid frames, the ladder's
    shape for their real frames and whether a graph replays it (the shape is among the captured ones the planner
    was handed)."""
    ladder = SessionOptions(8, graph_frame_totals=(1, 2, 4, 8, 16), graph_frame_sizes=(1, 4)).step_ladder
    planner = StepPlanner(ladder, frozenset({StepShape(8, 4, 16), StepShape(2, 4, 2)}))
    pieces = {r: _codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 3), ("b", 1), ("c", 4), ("d", 1)])}
    steps = planner.plan_round({r: (slot, pieces[r]) for slot, r in enumerate(pieces)})
    assert [type(b) for b in steps] == [StepBatch]
    (step,) = steps  # 9 real frames: the total 16, min(8 slots, 16) rows
    assert (step.request_ids, step.slots, step.valid_frames) == (("b", "d", "a", "c"), (1, 3, 0, 2), (1, 1, 3, 4))
    assert (step.shape, step.graph, step.rows, step.padding_rows) == (StepShape(8, 4, 16), True, 4, 4)
    assert step.pieces[2] is pieces["a"] and step.pieces[3] is pieces["c"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.graph = False  # frozen
    (one,) = planner.plan_round({"e": (4, _codes(ring_decoder, 1, 5))})
    assert (one.shape, one.graph, one.padding_rows) == (StepShape(1, 4, 1), False, 0)  # total 1: not captured


def _assert_slot_clear(session, slot):
    state = session.pool.slot_state(slot)
    assert int(state["layer_offsets"].abs().sum()) == 0
    assert all(torch.count_nonzero(r) == 0 for r in state["rings"])


@pytest.mark.parametrize("meta_only", [False, True])
def test_terminal_chunk_resets_and_releases(meta_only, ring_decoder):
    s = make_session(ring_decoder, 2)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 1))])
    slot = s.live_requests["a"]
    last = _codes(ring_decoder, 0 if meta_only else 2, 2)
    out = s.decode([ChunkRequest("a", last, True)])["a"]
    assert out.frames == last.shape[1]
    assert s.free_slots == 2 and "a" not in s.live_requests
    _assert_slot_clear(s, slot)


def test_abort_releases_and_a_later_chunk_starts_fresh(ring_decoder):
    s = make_session(ring_decoder, 2)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 1)), ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    slot = s.live_requests["a"]
    s.on_requests_finished({"a", "never-seen"})
    assert s.free_slots == 1 and s.live_requests == {"b": 1}
    _assert_slot_clear(s, slot)
    # vLLM-Omni never sends a chunk after an abort, so a chunk under that id is a new stream.
    fresh = _codes(ring_decoder, 3, 6)
    out = s.decode([ChunkRequest("a", fresh, True)])["a"]
    _close(out.audio, _solo(ring_decoder, fresh, [3]), "reused after abort")
    s.on_requests_finished(["b", "b"])
    assert s.free_slots == 2


def test_reused_id_after_finish_starts_fresh(ring_decoder):
    s = make_session(ring_decoder, 1)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 3, 1))])
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 2), True)])
    s.on_requests_finished(["a"])  # the runner reports normal completions too: nothing left to release
    # A duplicate meta-only terminal: no slot, nothing decoded.
    assert s.decode([ChunkRequest("a", _codes(ring_decoder, 0, 3), True)])["a"].frames == 0
    assert s.free_slots == 1
    fresh = _codes(ring_decoder, 4, 4)
    d1 = s.decode([ChunkRequest("a", fresh[:, :1])])["a"]
    d2 = s.decode([ChunkRequest("a", fresh[:, 1:], True)])["a"]
    _close(torch.cat([d1.audio, d2.audio], -1), _solo(ring_decoder, fresh, [1, 3]), "reused id")


@pytest.mark.parametrize("max_waiting_frames", [None, 5, 2, 0])
def test_a_terminal_chunk_of_a_waiting_stream_is_decoded_in_its_call(max_waiting_frames, ring_decoder):
    # "b" sends its whole utterance (terminal) while the only slot is taken. The engine finishes a request right
    # after its terminal step, so "b" cannot wait: "a" is preempted (saved to the host), "b" decodes and ends, and
    # "a" is restored into the freed slot in the same call. The id is free again at once; a later reuse of it is
    # served the same way, and "a" decodes exactly as if it had never left its slot.
    bound = {} if max_waiting_frames is None else {"max_waiting_frames": max_waiting_frames}
    s = make_session(ring_decoder, 1, **bound)
    a, b, reuse = (_codes(ring_decoder, n, seed) for n, seed in ((4, 1), (3, 2), (3, 3)))
    first = s.decode([ChunkRequest("a", a[:, :2])])["a"].audio
    got = s.decode([ChunkRequest("b", b, True)])["b"]
    assert got.error is None and not got.queued and got.frames == 3
    _close(got.audio, _solo(ring_decoder, b, [3]), "b, decoded in its terminal call")
    assert s.live_requests == {"a": 0} and not s.waiting_requests and s.stats()["preemptions"] == 1
    again = s.decode([ChunkRequest("b", reuse, True)])["b"]
    _close(again.audio, _solo(ring_decoder, reuse, [3]), "the id reused once its stream's audio came back")
    got = s.decode([ChunkRequest("a", a[:, 2:], True)])
    _close(torch.cat([first, got["a"].audio], -1), _solo(ring_decoder, a, [2, 2]), "a, preempted twice")
    assert s.free_slots == 1 and not s.waiting_requests and s.stats()["preemptions"] == 2


def test_a_terminal_chunk_over_the_queue_bounds_still_ends_its_waiting_stream(ring_decoder):
    # "w" waits with 3 frames buffered (of max_waiting_frames=4) when its 2-frame terminal chunk arrives: the
    # bound would refuse it (5 > 4) and drop all 5 frames; a terminal chunk is decoded in its call instead, the
    # live stream "l" preempted for it and restored once "w" ends.
    s = make_session(ring_decoder, 1, max_waiting_streams=1, max_waiting_frames=4)
    live, w = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 5, 2)
    first = s.decode([ChunkRequest("l", live[:, :1])])["l"].audio
    assert s.decode([ChunkRequest("w", w[:, :3])])["w"].queued
    got = s.decode([ChunkRequest("w", w[:, 3:], True)])["w"]
    assert got.error is None and got.frames == 5 and not got.queued
    _close(got.audio, _solo(ring_decoder, w, [3, 2]), "w, its buffered chunk and its terminal one")
    assert s.live_requests == {"l": 0} and not s.waiting_requests and s.stats()["request_errors"] == 0
    rest = s.decode([ChunkRequest("l", live[:, 1:], True)])["l"].audio
    _close(torch.cat([first, rest], -1), _solo(ring_decoder, live, [1, 2]), "l, preempted for w")


# ----------------------------------------------------------------------------- admission queue


def test_new_streams_wait_for_a_slot_while_live_streams_decode(ring_decoder):
    s = make_session(ring_decoder, 2)
    a, b, c = (_codes(ring_decoder, 6, seed) for seed in (1, 2, 3))
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1])])
    got = s.decode([ChunkRequest("a", a[:, 1:3]), ChunkRequest("c", c[:, :1])])
    assert got["a"].frames == 2 and got["a"].error is None
    assert got["c"].frames == 0 and got["c"].queued and got["c"].error is None
    assert s.waiting_requests == ["c"] and s.stats()["waiting_frames"] == 1
    got = s.decode([ChunkRequest("c", c[:, 1:4]), ChunkRequest("b", b[:, 1:], True)])
    # b's terminal chunk frees a slot in this call: c is admitted and its buffered chunks
    # (1 + 3 frames) decode in the same call.
    assert got["b"].frames == 5 and got["c"].frames == 4 and not got["c"].queued
    assert s.live_requests == {"a": 0, "c": 1} and not s.waiting_requests
    last = s.decode([ChunkRequest("c", c[:, 4:], True), ChunkRequest("a", a[:, 3:], True)])
    stats = s.stats()
    assert stats["admitted_from_queue"] == 1 and stats["queue_wait_s_max"] > 0
    assert s.free_slots == 2
    # The waiting stream keeps its chunk boundaries: decoded as 1, 3, then 2 frames.
    _close(torch.cat([got["c"].audio, last["c"].audio], -1), _solo(ring_decoder, c, [1, 3, 2]), "c")


def test_admitted_stream_equals_its_solo_decode(ring_decoder):
    s = make_session(ring_decoder, 1)
    a, c = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 5, 2)
    s.decode([ChunkRequest("a", a[:, :1])])
    assert s.decode([ChunkRequest("c", c[:, :1])])["c"].queued
    assert s.decode([ChunkRequest("c", c[:, 1:3])])["c"].queued
    # a ends; c's two buffered chunks (1 and 2 frames, boundaries kept) decode in this call and
    # come back under "c" although this call does not carry c.
    got = s.decode([ChunkRequest("a", a[:, 1:], True)])
    assert sorted(got) == ["a", "c"] and got["c"].frames == 3
    last = s.decode([ChunkRequest("c", c[:, 3:], True)])["c"]
    _close(torch.cat([got["c"].audio, last.audio], -1), _solo(ring_decoder, c, [1, 2, 2]), "admitted c")
    assert s.free_slots == 1


def test_buffered_chunks_do_not_follow_the_callers_tensors(ring_decoder):
    """Chunks are kept uncopied only within the call that brings them: a waiting stream's chunk is the
    session's own copy once decode() returns, so the caller may reuse (here: overwrite) its tensor. The
    chunk also holds an out-of-range code, clamped when its step runs, after it waited."""
    K = ring_decoder.config.codebook_size
    s = make_session(ring_decoder, 1)
    a, c = _codes(ring_decoder, 2, 1), _codes(ring_decoder, 4, 2)
    s.decode([ChunkRequest("a", a[:, :1])])
    sent = c[:, :3].clone()
    sent[1, 2] = K + 5
    assert s.decode([ChunkRequest("c", sent)])["c"].queued
    sent.fill_(0)  # the caller reuses its buffer
    got = s.decode([ChunkRequest("a", a[:, 1:], True)])
    assert got["c"].frames == 3 and s.clamped_codes == 1
    last = s.decode([ChunkRequest("c", c[:, 3:], True)])["c"]
    expected = c.clone()
    expected[1, 2] = K - 1
    _close(torch.cat([got["c"].audio, last.audio], -1), _solo(ring_decoder, expected, [3, 1]), "c")


def test_admission_queue_bounds_fail_the_request_alone(ring_decoder):
    s = make_session(ring_decoder, 1, max_waiting_streams=1, max_waiting_frames=4)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1))])
    got = s.decode([ChunkRequest("b", _codes(ring_decoder, 2, 2)), ChunkRequest("c", _codes(ring_decoder, 1, 3))])
    assert got["b"].queued and got["c"].error == (
        "all 1 decoder slots are busy and the admission queue is full (1 of max_waiting_streams=1 streams waiting)"
    )
    got = s.decode([ChunkRequest("b", _codes(ring_decoder, 3, 4)), ChunkRequest("a", _codes(ring_decoder, 1, 5))])
    assert got["a"].frames == 1
    assert got["b"].error == (
        "all 1 decoder slots are busy and waiting streams would buffer 5 frames, over max_waiting_frames=4; "
        "the waiting stream's buffered chunks were dropped"
    )
    assert not s.waiting_requests and s.stats()["request_errors"] == 2
    s.on_requests_finished(["a"])
    assert s.free_slots == 1


def test_slots_freed_between_calls_go_to_waiting_streams_first(ring_decoder):
    s = make_session(ring_decoder, 2, max_waiting_streams=1)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1)), ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    assert s.decode([ChunkRequest("c", _codes(ring_decoder, 1, 3))])["c"].queued
    s.on_requests_finished(["a", "b"])
    got = s.decode([ChunkRequest("d", _codes(ring_decoder, 1, 4))])
    assert got["d"].error is None and got["d"].frames == 1 and got["c"].frames == 1
    assert set(s.live_requests) == {"c", "d"} and not s.waiting_requests


def test_abort_of_a_waiting_stream_drops_its_chunks(ring_decoder):
    s = make_session(ring_decoder, 1)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1))])
    s.decode([ChunkRequest("b", _codes(ring_decoder, 2, 2))])
    s.on_requests_finished(["b"])
    assert not s.waiting_requests
    got = s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 3), True)])
    assert sorted(got) == ["a"] and s.free_slots == 1


def test_a_bad_request_fails_alone(ring_decoder):
    s = make_session(ring_decoder, 2)
    good, live = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 2, 2)
    s.decode([ChunkRequest("live", live[:, :1])])
    before = s.pool.slot_state(s.live_requests["live"])
    n_vq = ring_decoder.config.num_quantizers
    bad_codes = torch.zeros(n_vq + 1, 3, dtype=torch.long)
    got = s.decode(
        [
            ChunkRequest("good", good, True),
            ChunkRequest("live", bad_codes),
            ChunkRequest("float", good.float()),
            ChunkRequest("", good),
        ]
    )
    _close(got["good"].audio, _solo(ring_decoder, good, [3]), "good beside bad requests")
    assert got["live"].error == f"request 'live': codes must have shape ({n_vq}, T), got ({n_vq + 1}, 3)"
    assert got["float"].error == "request 'float': codes must be signed integers (or uint8), got torch.float32"
    empty = InvalidRequestId(3, "")
    assert got[empty].error == "request_id must be a non-empty str, got ''"
    assert all(got[k].frames == 0 for k in ("live", "float", empty))
    after = s.pool.slot_state(s.live_requests["live"])
    assert torch.equal(before["layer_offsets"], after["layer_offsets"])
    assert all(torch.equal(x, y) for x, y in zip(before["rings"], after["rings"]))
    assert set(s.live_requests) == {"live"} and s.stats()["request_errors"] == 3
    # The live stream carries on as if the bad chunk never came.
    rest = s.decode([ChunkRequest("live", live[:, 1:], True)])["live"]
    first = _solo(ring_decoder, live, [1, 1])[:, ring_decoder.config.samples_per_frame :]
    _close(rest.audio, first, "live after a refused chunk")


def test_a_refused_chunk_of_an_admitted_stream_keeps_its_error_beside_the_buffered_audio(ring_decoder):
    s = make_session(ring_decoder, 1)
    a, w = _codes(ring_decoder, 1, 1), _codes(ring_decoder, 2, 2)
    s.decode([ChunkRequest("a", a), ChunkRequest("w", w)])  # "w" waits for the only slot
    n_vq = ring_decoder.config.num_quantizers
    bad = torch.zeros(n_vq + 1, 2, dtype=torch.long)
    got = s.decode([ChunkRequest("a", a[:, :0], True), ChunkRequest("w", bad)])  # "a" ends, "w" is admitted
    assert got["w"].error == f"request 'w': codes must have shape ({n_vq}, T), got ({n_vq + 1}, 2)"
    assert got["w"].frames == 2  # its buffered chunk, decoded
    _close(got["w"].audio, _solo(ring_decoder, w, [2]), "buffered chunk of the admitted stream")
    assert s.stats()["request_errors"] == 1


def test_codes_that_are_not_dense_fail_their_request_alone(ring_decoder):
    s = make_session(ring_decoder, 2)
    good = _codes(ring_decoder, 2, 1)
    got = s.decode([ChunkRequest("good", good, True), ChunkRequest("sparse", good.to_sparse())])
    assert (
        got["sparse"].error == "request 'sparse': codes must be a dense (strided) tensor, got a torch.sparse_coo tensor"
    )
    _close(got["good"].audio, _solo(ring_decoder, good, [2]), "good beside sparse codes")
    assert s.free_slots == 2


def test_finishing_takes_a_collection_of_ids_not_one_string(ring_decoder):
    s = make_session(ring_decoder, 3)
    c = _codes(ring_decoder, 1, 1)
    s.decode([ChunkRequest("req-1", c), ChunkRequest("r", c)])
    with pytest.raises(TypeError, match="request_ids must be a collection of request ids, got the single id 'req-1'"):
        s.on_requests_finished("req-1")
    with pytest.raises(TypeError, match=r"^request_ids must be a collection of request ids, got None$"):
        s.on_requests_finished(None)
    assert set(s.live_requests) == {"req-1", "r"}
    s.on_requests_finished(["req-1"])
    assert set(s.live_requests) == {"r"}
    # An id that is not a str ends nothing of its own (str() of it could name another stream): the ids before it
    # are finished all the same, as when an iterable fails part-way.
    s.decode([ChunkRequest("None", c), ChunkRequest("1", c)])
    for bad in (None, 1, b"r"):
        with pytest.raises(TypeError, match=rf"^request ids must be str, got {re.escape(repr(bad))}$"):
            s.on_requests_finished([bad])
    assert set(s.live_requests) == {"r", "None", "1"}
    with pytest.raises(TypeError, match=r"^request ids must be str, got None$"):
        s.on_requests_finished(["r", None, "1"])
    assert set(s.live_requests) == {"None", "1"} and s.free_slots == 1


@pytest.mark.parametrize(
    "bad_id,message",
    [
        (None, "request_id must be a non-empty str, got None"),
        (["x"], "request_id must be a non-empty str, got ['x']"),
        (7, "request_id must be a non-empty str, got 7"),
        ("", "request_id must be a non-empty str, got ''"),
    ],
)
def test_a_bad_request_id_fails_alone(bad_id, message, ring_decoder):
    s = make_session(ring_decoder, 2)
    good = _codes(ring_decoder, 2, 1)
    got = s.decode([ChunkRequest("good", good, True), ChunkRequest(bad_id, good)])
    key = InvalidRequestId(1, bad_id)
    assert got[key].error == message and got[key].frames == 0
    _close(got["good"].audio, _solo(ring_decoder, good, [2]), "good beside a bad id")
    assert s.free_slots == 2


def test_two_empty_request_ids_fail_alone_not_the_batch(ring_decoder):
    s = make_session(ring_decoder, 2)
    good = _codes(ring_decoder, 2, 1)
    got = s.decode([ChunkRequest("good", good, True), ChunkRequest("", good), ChunkRequest("", good)])
    assert [got[InvalidRequestId(i, "")].error for i in (1, 2)] == ["request_id must be a non-empty str, got ''"] * 2
    _close(got["good"].audio, _solo(ring_decoder, good, [2]), "good beside two empty ids")


def test_a_non_bool_finished_flag_fails_its_request_alone(ring_decoder):
    s = make_session(ring_decoder, 2)
    good = _codes(ring_decoder, 2, 1)
    got = s.decode([ChunkRequest("good", good[:, :1]), ChunkRequest("b", good, torch.tensor([True, False]))])
    assert got["b"].error == "request 'b': finished must be a bool, got tensor([ True, False])"
    assert got["good"].frames == 1 and set(s.live_requests) == {"good"}
    assert s.decode([ChunkRequest("good", good[:, 1:], True)])["good"].frames == 1
    assert s.free_slots == 2


def test_bad_batches_raise(ring_decoder):
    s = make_session(ring_decoder, 2)
    c = _codes(ring_decoder, 1, 1)
    with pytest.raises(ValueError, match="request 'a' appears twice in one decode batch"):
        s.decode([ChunkRequest("a", c), ChunkRequest("a", c)])
    with pytest.raises(TypeError, match="requests must hold ChunkRequest objects, got tuple"):
        s.decode([("a", c)])
    assert not s.live_requests
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.decode([ChunkRequest("a", c)])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_step_frames": 0}, "max_step_frames must be an integer >= 1, got 0"),
        ({"max_waiting_streams": -1}, "max_waiting_streams must be an integer >= 0, got -1"),
        ({"max_waiting_frames": 1.5}, "max_waiting_frames must be an integer >= 0, got 1.5"),
        ({"n_vq": 3}, "n_vq must be in 1..2 for this codec, got 3"),
        ({"pool_kind": "v2"}, "unknown state pool kind 'v2'"),
    ],
)
def test_bad_configuration_is_refused(kwargs, message, ring_decoder):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_session(ring_decoder, 2, **kwargs)


def test_session_options_are_one_frozen_record(ring_decoder):
    """An options record gives the session its options (graph sizes normalised once: distinct, ascending; frame
    totals above the slot count kept, a step's total counts frames, not rows); the record is frozen; its step ladder
    is the session's; the session takes the record, spec and decoder alone (no loose options beside them); an n_vq
    the codec does not have is refused."""
    want = SessionOptions(3, n_vq=1, graph_frame_totals=(1, 2, 8), graph_frame_sizes=(1, 3), max_step_frames=5)
    assert (
        SessionOptions(3, graph_frame_totals=[8, 2, 2, 1], graph_frame_sizes=[3, 1, 3], max_step_frames=5, n_vq=1)
        == want
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        want.max_step_frames = 6
    spec = StateSpec.from_options(ring_decoder)
    recorded = CodecStreamSession(ring_decoder, spec, want)
    assert recorded.options is want and recorded.state_capacity == 3 and recorded.n_vq == 1
    assert recorded.graph_frame_sizes == [1, 3] and recorded.max_step_rows == 3
    assert recorded.step_ladder == want.step_ladder == StepLadder(3, 3, (1, 2, 8))
    assert recorded.max_piece_frames == 3 and recorded.pool.state_capacity == 3
    for loose in ({"max_step_frames": 4}, {"state_capacity": 3}, {"pool_kind": "compact"}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            CodecStreamSession(ring_decoder, spec, want, **loose)
    with pytest.raises(ValueError, match="state_capacity must be an integer >= 1, got None"):
        SessionOptions(None)
    with pytest.raises(ValueError, match="max_waiting_frames must be an integer >= 0, got -2"):
        SessionOptions(2, max_waiting_frames=-2)
    with pytest.raises(ValueError, match="n_vq must be in 1..2 for this codec, got 3"):
        CodecStreamSession(ring_decoder, spec, SessionOptions(2, n_vq=3))


# ----------------------------------------------------------------------------- exact padded tails and clamping


@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_tails_pad_into_the_graph_frame_size_and_stay_exact(kind, ring_decoder, monkeypatch):
    """Graph frame sizes (1, 3), frame totals (1, 2, 4, 8): the 2-frame tail shares a 3-frame step with a steady
    chunk (as it would share a CUDA graph), packed with dummy frames up to the total 8, and still equals its solo
    decode at its own length; the dummies change no slot's state."""
    s = make_session(ring_decoder, 4, pool_kind=kind, graph_frame_totals=(1, 2, 4, 8), graph_frame_sizes=(1, 3))
    assert s.runner is None  # CPU: graphs are never captured, steps are planned as on a GPU
    steps = _count_steps(s, monkeypatch)
    d = _Driver(s, ring_decoder)
    d.add("a", 7, 1)
    d.add("b", 6, 2)
    d.step([("a", 1, False), ("b", 1, False)])
    d.step([("a", 3, False), ("b", 3, False)])
    d.step([("a", 3, True), ("b", 2, True)])
    # Real frames 2, 6, 5 pad to the totals 2, 8, 8; every step is 3 frames a row (the largest frame size).
    assert steps == [(2, 3, 2), (2, 3, 8), (2, 3, 8)]
    d.check("a")
    d.check("b")
    assert s.free_slots == 4 and s.stats()["padded_frames"] == 0 + 2 + 3
    assert s.stats()["padding_rows"] == 0  # eager steps run their rows alone (a graph would carry 0 + 2 + 2)
    _assert_slot_clear(s, 0)
    _assert_slot_clear(s, 1)


def test_steps_never_exceed_the_largest_frame_total(ring_decoder, monkeypatch):
    """Frame totals up to 6: a round of more real frames is cut (shortest rows first) into steps that each fit,
    and every stream still equals its solo decode."""
    s = make_session(ring_decoder, 4, graph_frame_totals=(1, 2, 4, 6), graph_frame_sizes=(1, 3))
    steps = _count_steps(s, monkeypatch)
    d = _Driver(s, ring_decoder)
    for i, (rid, frames) in enumerate((("a", 8), ("b", 3), ("c", 8))):
        d.add(rid, frames, i)
    d.step([("a", 1, False), ("b", 1, False), ("c", 1, False)])
    d.step([("a", 7, True), ("b", 2, True), ("c", 7, True)])  # 7 = 3 + 3 + 1 frames in pieces
    # Call 1: 3 frames, total 4. Call 2, round 0: b 2 + a 3 = 5 (total 6), then c 3 (total 4): 8 > 6 frames;
    # round 1: a 3 + c 3 = 6; round 2: a 1 + c 1 = 2.
    assert steps == [(3, 3, 4), (2, 3, 6), (1, 3, 4), (2, 3, 6), (2, 3, 2)]
    assert s.stats()["padded_frames"] == 1 + 1 + 1 + 0 + 0
    for rid in "abc":
        d.check(rid)


def test_out_of_range_codes_are_clamped_and_counted(ring_decoder):
    s = make_session(ring_decoder, 2)
    K = ring_decoder.config.codebook_size
    codes = _codes(ring_decoder, 3, 1)
    raw = codes.clone()
    raw[0, 0], raw[1, 2], raw[0, 1] = K, -1, K + 7
    out = s.decode([ChunkRequest("a", raw, True)])["a"]
    assert s.clamped_codes == 3
    _close(out.audio, _solo(ring_decoder, raw.clamp(0, K - 1), [3]), "clamped")
    assert torch.equal(raw[0, 0], torch.tensor(K))  # the caller's tensor is not modified


def test_generators_are_consumed_once(ring_decoder):
    s = make_session(ring_decoder, 2)
    codes = random_codes(ring_decoder, 1, 2, seed=1)[:, 0]
    with pytest.raises(TypeError, match="requests must be a sequence of ChunkRequest, got ChunkRequest"):
        s.decode(ChunkRequest("a", codes))
    got = s.decode(r for r in [ChunkRequest("a", codes), ChunkRequest("b", codes, finished=True)])
    assert sorted(got) == ["a", "b"] and got["a"].frames == 2 and got["b"].frames == 2
    assert set(s.live_requests) == {"a"}


def test_clamped_codes_count_only_out_of_range_codes_of_taken_chunks(tiny_decoder):
    # int8 codes: the codebook's last index (K - 1 = 1023 for tiny-v2) does not fit int8, the count must not wrap.
    K = tiny_decoder.config.codebook_size
    assert K - 1 > torch.iinfo(torch.int8).max
    s = make_session(tiny_decoder, 1, max_waiting_streams=0)
    small = torch.full((tiny_decoder.config.num_quantizers, 4), 5, dtype=torch.int8)
    small[0, 0] = -3
    got = s.decode([ChunkRequest("a", small)])
    assert got["a"].frames == 4 and s.clamped_codes == 1
    # A chunk refused by admission (no slot, no queue) counts nothing, even with out-of-range codes.
    refused = torch.full((tiny_decoder.config.num_quantizers, 3), K + 1)
    got = s.decode([ChunkRequest("b", refused)])
    assert got["b"].error is not None and s.clamped_codes == 1


def test_clamped_codes_of_a_chunk_cut_into_pieces_are_counted_once(ring_decoder):
    # A chunk longer than the largest step frame size is decoded in pieces, one step each; every
    # out-of-range code is counted by the step that clamps it, once, and the audio is the clamped codes'.
    K = ring_decoder.config.codebook_size
    s = make_session(ring_decoder, 1, graph_frame_sizes=(2,))
    raw = _codes(ring_decoder, 5, 4)
    raw[0, 0], raw[1, 3], raw[0, 4] = K, -2, K + 1  # in pieces 0, 1 and 2
    out = s.decode([ChunkRequest("a", raw, True)])["a"]
    assert s.clamped_codes == 3 and s.stats()["clamped_codes"] == 3 and s.stats()["steps_by_path"]["eager"] == 3
    _close(out.audio, _solo(ring_decoder, raw.clamp(0, K - 1), [2, 2, 1]), "pieces")


def test_clamped_codes_of_one_batch_in_mixed_dtypes_are_counted_once_each(tiny_decoder):
    # The host chunks of a batch are compared together: int8, uint8 and int64 chunks side by side must
    # neither wrap (uint8 255 is in range; int8 -1 is not) nor count another row's codes.
    K, Q = tiny_decoder.config.codebook_size, tiny_decoder.config.num_quantizers
    s = make_session(tiny_decoder, 3)
    a = torch.full((Q, 2), 7, dtype=torch.int8)
    a[0, 1] = -1
    b = torch.full((Q, 3), 255, dtype=torch.uint8)
    c = torch.full((Q, 1), 9, dtype=torch.int64)
    c[1, 0], c[2, 0] = K, -(2**40)
    got = s.decode([ChunkRequest("a", a), ChunkRequest("b", b), ChunkRequest("c", c)])
    assert [got[r].frames for r in "abc"] == [2, 3, 1]
    assert s.clamped_codes == 3


def test_finishing_frees_the_slots_of_the_ids_seen_before_the_iterable_fails(ring_decoder):
    s = make_session(ring_decoder, 2)
    c = _codes(ring_decoder, 1, 1)
    s.decode([ChunkRequest("a", c), ChunkRequest("b", c)])

    def ids():
        yield "a"
        yield "b"
        raise RuntimeError("the engine's id list broke")

    with pytest.raises(RuntimeError, match="the engine's id list broke"):
        s.on_requests_finished(ids())
    assert s.live_requests == {} and s.free_slots == 2
    assert s.decode([ChunkRequest("c", c)])["c"].frames == 1


def test_step_inputs_are_tensors_of_their_own(ring_decoder, monkeypatch):
    # Slot ids and lengths that were views of one staging tensor would make torch.compile guard on its strides.
    s = make_session(ring_decoder, 3)
    seen = []
    real = s.step_runner.eager_step

    def spy(codes, lengths, slot_ids, valid, frames):
        seen.append((codes, lengths, slot_ids, frames))
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", spy)
    chunks = {r: _codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 2), ("b", 3), ("c", 1)])}
    s.decode([ChunkRequest(r, c) for r, c in chunks.items()])
    ((codes, lengths, slot_ids, frames),) = seen
    # Shortest rows first (c, a, b on slots 2, 0, 1), their codes packed one after another.
    assert lengths.tolist() == [1, 2, 3] and slot_ids.tolist() == [2, 0, 1] and frames == 3
    assert torch.equal(codes, torch.cat([chunks["c"], chunks["a"], chunks["b"]], dim=1))
    for t in (codes, lengths, slot_ids):
        assert t.is_contiguous() and t._base is None and t.dtype == torch.long
    assert len({t.untyped_storage().data_ptr() for t in (codes, lengths, slot_ids)}) == 3


def test_call_traces_split_each_call_into_phases(ring_decoder, monkeypatch):
    import gc

    from vllm_omni_moss.model_executor.models.moss_tts.serving import tracing as tracing_module

    s = make_session(ring_decoder, 4, graph_frame_sizes=[2], max_step_frames=2)
    assert s.call_traces is None  # off by default: nothing recorded
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 0))])
    traces = s.enable_call_traces(max_calls=3)
    assert s.call_traces is traces and any(t.traces is traces for t in tracing_module._TRACING)
    assert gc.callbacks.count(tracing_module._gc_hook) == 1
    s.enable_call_traces(max_calls=3)  # enabling again: a new, empty history, still one hook
    assert gc.callbacks.count(tracing_module._gc_hook) == 1
    traces = s.call_traces

    # A garbage collection inside the pool step is counted and lands in the run phase; a collection's stop
    # whose start came before the call is not counted.
    real = s.step_runner.eager_step
    collected = []

    def step_with_gc(codes, lengths, slot_ids, valid, frames):
        collected.append(gc.collect())
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", step_with_gc)
    before = sum(s.stats()["steps_by_path"].values())
    tracing_module._gc_hook("start", {})  # outside any call: ignored
    # Chunks of 3 frames are cut into pieces of 2 and 1: two steps in one call.
    s.decode([ChunkRequest("a", _codes(ring_decoder, 3, 1)), ChunkRequest("b", _codes(ring_decoder, 3, 2))])
    (trace,) = traces
    assert trace.chunks == 2 and trace.steps == 2 == sum(s.stats()["steps_by_path"].values()) - before
    assert not trace.failed
    phases = [trace.plan_ms, trace.stage_ms, trace.run_ms, trace.to_host_ms, trace.finish_ms, trace.wait_ms]
    assert min(phases) >= 0 and trace.stage_ms > 0 and trace.run_ms > 0 and trace.to_host_ms > 0
    assert trace.wait_ms == 0.0  # a CPU session never waits for a device
    assert sum(phases) == pytest.approx(trace.total_ms, rel=1e-9, abs=1e-9)
    # One count per collection (the collector calls back at its start and its stop); automatic ones may add.
    assert len(collected) == 2 and trace.gc_collections >= 2
    assert 0 < trace.gc_ms <= trace.run_ms

    def stray_stop(codes, lengths, slot_ids, valid, frames):
        tracing_module._gc_hook("stop", {})  # a stop without a start inside the call: ignored
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", stray_stop)
    gc.disable()
    try:
        s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 5))])
    finally:
        gc.enable()
    assert traces[-1].gc_collections == 0 and traces[-1].gc_ms == 0.0

    # A call that decodes nothing (a zero-frame terminal chunk, a refused chunk) is all planning.
    s.decode([ChunkRequest("b", _codes(ring_decoder, 0, 3), True), ChunkRequest("", _codes(ring_decoder, 1, 4))])
    empty = traces[-1]
    assert empty.steps == 0 and empty.chunks == 2 and empty.plan_ms == pytest.approx(empty.total_ms, rel=1e-9)
    assert empty.stage_ms == empty.run_ms == empty.to_host_ms == empty.finish_ms == empty.wait_ms == 0.0

    # A step that raises fails its streams alone and is counted; the call completes.
    def broken(*args):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(s.step_runner, "eager_step", broken)
    assert "the device fell over" in s.decode([ChunkRequest("c", _codes(ring_decoder, 1, 6))])["c"].error
    assert not traces[-1].failed and traces[-1].failed_steps == 1 and traces[-1].steps == 0
    # A call that raises is recorded as failed; the session goes on decoding and tracing.
    monkeypatch.setattr(s.scheduler, "schedule", broken)
    with pytest.raises(RuntimeError, match="the device fell over"):
        s.decode([ChunkRequest("c", _codes(ring_decoder, 1, 6))])
    assert traces[-1].failed and traces[-1].steps == 0 and all(t.trace is None for t in tracing_module._TRACING)
    monkeypatch.undo()
    monkeypatch.setattr(s.step_runner, "eager_step", real)
    s.decode([ChunkRequest("d", _codes(ring_decoder, 1, 7))])
    assert not traces[-1].failed and traces[-1].steps == 1

    for i in range(3):  # only the last max_calls traces are kept
        s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 10 + i))])
    assert len(traces) == 3 and [t.chunks for t in traces] == [1, 1, 1]

    # A refused batch records nothing.
    with pytest.raises(ValueError, match="appears twice"):
        s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 20)), ChunkRequest("a", _codes(ring_decoder, 1, 21))])
    assert len(traces) == 3

    s.disable_call_traces()
    assert s.call_traces is None
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 30))])  # still decodes, records nothing
    s.enable_call_traces(None)
    s.close()  # close stops tracing too; a closed session cannot trace again
    assert s.call_traces is None
    with pytest.raises(RuntimeError, match="closed"):
        s.enable_call_traces()


def test_tracing_keeps_no_session_alive(ring_decoder):
    import gc
    import weakref

    s = make_session(ring_decoder, 1)
    s.enable_call_traces()
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 0))])
    ref, pool = weakref.ref(s), weakref.ref(s.pool)
    del s
    gc.collect()
    assert ref() is None and pool() is None


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3", 2**63])
def test_call_traces_refuse_a_bad_length(bad, ring_decoder):
    import re
    import sys

    s = make_session(ring_decoder, 1)
    message = f"max_calls must be None or an integer in 1..{sys.maxsize}, got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        s.enable_call_traces(bad)
    assert s.call_traces is None


# ----------------------------------------------------------------------------- refusals and ids


@pytest.mark.parametrize("bound", ["streams", "frames"])
def test_a_refused_request_stays_refused_until_it_ends(ring_decoder, bound):
    """Once an admission bound refuses a request, its later chunks get the same error (before, the next chunk
    started a fresh stream from zero state, and the request's audio silently lacked its beginning); its
    terminal chunk ends the refusal, and the id may then start a new stream."""
    bounds = {"max_waiting_streams": 0} if bound == "streams" else {"max_waiting_frames": 2}
    s = make_session(ring_decoder, 1, **bounds)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1))])  # a holds the only slot
    first = s.decode([ChunkRequest("b", _codes(ring_decoder, 3, 2))])["b"]
    assert first.error is not None and first.error.startswith("all 1 decoder slots are busy")
    s.decode([ChunkRequest("a", _codes(ring_decoder, 0, 3), True)])  # a ends: its slot is free
    later = s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 4))])["b"]
    assert later.error == first.error and later.frames == 0
    assert s.live_requests == {} and s.free_slots == 1  # no fresh stream started under b
    last = s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 5), True)])["b"]
    assert last.error == first.error and s.live_requests == {}
    fresh = _codes(ring_decoder, 2, 6)
    again = s.decode([ChunkRequest("b", fresh, True)])["b"]
    assert again.error is None and again.frames == 2
    _close(again.audio, _solo(ring_decoder, fresh, [2]), "a new stream under the id once the refused one ended")
    assert s.stats()["request_errors"] == 3


def test_on_requests_finished_ends_a_refusal(ring_decoder):
    s = make_session(ring_decoder, 1, max_waiting_streams=0)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1))])
    assert s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 2))])["b"].error is not None
    s.on_requests_finished(["a", "b"])
    assert s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 3))])["b"].error is None
    assert set(s.live_requests) == {"b"}


def test_ids_that_are_not_strings_get_keys_no_other_request_shares(ring_decoder):
    """A list id (which cannot key a dict) and the string of its repr are two requests; ids that compare
    equal (1, True, 1.0) get one result each (before, they shared one, and the repr collided with the string)."""

    s = make_session(ring_decoder, 2)
    good = _codes(ring_decoder, 2, 1)
    requests = [ChunkRequest("['x']", good, True), ChunkRequest(["x"], good), ChunkRequest(1, good)]
    requests += [ChunkRequest(True, good), ChunkRequest(1.0, good)]
    got = s.decode(requests)
    assert len(got) == 5 and got["['x']"].error is None and got["['x']"].frames == 2
    for position, rid in (1, ["x"]), (2, 1), (3, True), (4, 1.0):
        result = got[InvalidRequestId(position, rid)]
        assert result.error == f"request_id must be a non-empty str, got {rid!r}" and result.frames == 0
    assert InvalidRequestId(2, 1) != InvalidRequestId(3, True) != InvalidRequestId(4, 1.0)
    assert InvalidRequestId(1, ["x"]) != "['x']" and s.stats()["request_errors"] == 4


# ----------------------------------------------------------------------------- steps


def test_a_round_pads_to_the_next_ladder_total_and_is_cut_only_past_the_slots(ring_decoder):
    """128 slots of 4-frame chunks, the stage's ladder ``frame_totals(128 x 4)`` (every total to 64, then 66, 68,
    ..., 96, 99, 102, ..., 126, 129, ...): a round is one step padded to the smallest total holding its real
    frames (at most 1/32 of them above 64), with ``min(slots, total)`` rows; a round of more rows than slots is
    cut into a full step and the rest."""
    s = make_session(ring_decoder, 128, graph_frame_totals=frame_totals(128 * 4), graph_frame_sizes=[1, 4])
    assert s.step_ladder == StepLadder(128, 4, tuple(frame_totals(512))) and s.max_step_rows == 128

    def shapes(lengths):
        pieces = {f"r{i}": (i, _codes(ring_decoder, n, 0)) for i, n in enumerate(lengths)}
        return [(b.rows, b.shape, sum(b.valid_frames)) for b in s.step_runner.planner.plan_round(pieces)]

    assert shapes([4] * 20) == [(20, StepShape(80, 4, 80), 80)]  # 80 is a total: no dummy frame
    assert shapes([4] * 25) == [(25, StepShape(102, 4, 102), 100)]  # 100 frames: 2 dummies
    assert shapes([1] * 3 + [4] * 16) == [(19, StepShape(68, 4, 68), 67)]  # 67 frames: the total 68
    assert shapes([4] * 128) == [(128, StepShape(128, 4, 512), 512)]  # every slot full: the largest total
    assert shapes([1] * 130) == [(128, StepShape(128, 4, 129), 128), (2, StepShape(2, 4, 2), 2)]
    s.close()


def test_the_session_keeps_graph_sizes_distinct_ascending(ring_decoder):
    """One normalisation (``graph_ladder.graph_sizes``) for the session and the graph runner: duplicates, zeros
    and negatives dropped, ascending; a size that is not an integer is refused, never rounded; frame totals are not
    bounded by the slot count (a total counts packed frames), but their largest must hold a row of the frame size."""
    from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import graph_sizes

    s = make_session(ring_decoder, 8, graph_frame_totals=[16, 4, 0, 4, 8, -2], graph_frame_sizes=[15, 1, 1, 0])
    assert (s.options.graph_frame_totals, s.graph_frame_sizes) == ((4, 8, 16), [1, 15])
    assert s.step_ladder == StepLadder(8, 15, (4, 8, 16))
    assert graph_sizes([3, 3, 2, -1]) == [2, 3] and graph_sizes([]) == []
    for bad in ([2, 2.0], [True]):
        with pytest.raises(ValueError) as err:
            graph_sizes(bad)
        assert str(err.value) == f"graph sizes must be integers, got {bad[-1]!r} in {bad!r}"
    with pytest.raises(ValueError) as err:
        make_session(ring_decoder, 4, graph_frame_totals=(1, 3), graph_frame_sizes=(1, 2, 4, 6))
    assert str(err.value) == "the largest frame total 3 is below the frame size 6: a row of 6 frames would fit no step"


def test_a_call_of_mixed_frame_sizes_is_one_step(ring_decoder, monkeypatch):
    """A 1-frame first chunk beside 4-frame chunks shares their step (one step per round, whatever its pieces'
    lengths), and the audio is each stream's solo decode."""
    s = make_session(ring_decoder, 3, graph_frame_sizes=[1, 4])
    steps = _count_steps(s, monkeypatch)
    a, b, c = (_codes(ring_decoder, 5, seed) for seed in (1, 2, 3))
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1])])
    got = s.decode(
        [ChunkRequest("a", a[:, 1:5], True), ChunkRequest("b", b[:, 1:5], True), ChunkRequest("c", c[:, :1])]
    )
    stats = s.stats()
    assert steps == [(2, 1, 2), (3, 4, 9)]  # [a, b] 1 frame; then [c, a, b]: 1 + 4 + 4 frames packed
    assert stats["steps_by_path"]["eager"] == 2 and stats["padded_frames"] == 0
    _close(got["a"].audio, _solo(ring_decoder, a, [1, 4])[:, ring_decoder.config.samples_per_frame :], "a")
    _close(got["b"].audio, _solo(ring_decoder, b, [1, 4])[:, ring_decoder.config.samples_per_frame :], "b")
    rest = s.decode([ChunkRequest("c", c[:, 1:], True)])["c"]
    _close(torch.cat([got["c"].audio, rest.audio], -1), _solo(ring_decoder, c, [1, 4]), "c")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("n_vq", True, "n_vq must be an integer or None, got True"),
        ("n_vq", 1.5, "n_vq must be an integer or None, got 1.5"),
        ("n_vq", "2", "n_vq must be an integer or None, got '2'"),
        ("graph_memory_bytes", -1, "graph_memory_bytes must be an integer >= 0, got -1"),
        ("graph_memory_bytes", 2.5e9, "graph_memory_bytes must be an integer >= 0, got 2500000000.0"),
        ("graph_memory_bytes", True, "graph_memory_bytes must be an integer >= 0, got True"),
    ],
)
def test_session_options_refuse_what_is_not_an_integer(field, value, message, ring_decoder):
    """A bool, float or string codebook count is refused, not truncated (``int(1.5)`` served 1 codebook while the
    record said 1.5), and so is a graph memory bound that is not a byte count; the session's keyword reaches the
    same check."""
    with pytest.raises(ValueError, match=message):
        SessionOptions(2, **{field: value})
    with pytest.raises(ValueError, match=message):
        make_session(ring_decoder, 2, **{field: value})
    assert SessionOptions(2, n_vq=1, graph_memory_bytes=0) == SessionOptions(2, 1, graph_memory_bytes=0)
