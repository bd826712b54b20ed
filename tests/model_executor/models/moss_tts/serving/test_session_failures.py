# SPDX-License-Identifier: Apache-2.0
"""CodecStreamSession when things go wrong around it: a pool step that raises fails its own rows' streams alone
(the audio decoded before it is returned, the other streams decode on and stay exact); so does a pool call that
raises while a stream is admitted, preempted (its state saved) or resumed (its state restored); a session refuses
a second caller (another thread, or a call from inside a running one).

Audio is compared with the solo decode ``decoder.decode(codes[:, None], chunk_frames=<the pieces it was fed>)``.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from moss_codecs import make_session, random_codes
from moss_codecs import stream_codes as _codes

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import StepPlanner

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

#: Frames per stream in the second call. With graph frame sizes 1 and 4 (chunks cut at 4 frames) and the frame
#: totals 1 to 7, round 0 (every stream's first piece, shortest first: a 1, b 1, f 2, c 3, d 4, e 4) holds 15
#: frames and is cut where a step would exceed 7: 1: (a, b, f, c), 7 frames; 2: (d), 4; 3: (e), 4 (e's first
#: 4-frame piece). Round 1: 4: (e), 2 (e's last 2 frames).
SECOND = {"a": 1, "b": 1, "c": 3, "d": 4, "e": 6, "f": 2}
STEPS = [["a", "b", "f", "c"], ["d"], ["e"], ["e"]]
#: (rows, T, packed frames) of each step.
STEP_SHAPES = [(4, 4, 7), (1, 4, 4), (1, 4, 4), (1, 4, 2)]
THIRD = 2  # frames per surviving stream in the third call


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"{what}: max error {err}"


def _pieces(frames: int) -> list[int]:
    return [min(4, frames - a) for a in range(0, frames, 4)]


def _inject(session, monkeypatch, fail_at: int, when: str) -> list[tuple[int, int]]:
    """Make the ``fail_at``-th pool step from now raise (``before`` it runs, or ``after`` it wrote its state);
    returns the ``(rows, T, packed frames)`` of every step tried."""
    real, tried = session.step_runner.eager_step, []

    def step(codes, lengths, slot_ids, valid, frames):
        tried.append((lengths.shape[0], frames, codes.shape[1]))
        if len(tried) == fail_at and when == "before":
            raise RuntimeError(f"injected failure in step {fail_at}")
        out = real(codes, lengths, slot_ids, valid, frames)
        if len(tried) == fail_at:
            raise RuntimeError(f"injected failure in step {fail_at}")
        return out

    monkeypatch.setattr(session.step_runner, "eager_step", step)
    return tried


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_a_failing_step_fails_its_rows_alone_and_keeps_every_decoded_frame(fail_at, when, ring_decoder, monkeypatch):
    """Step ``fail_at`` of a call holding chunks of 1 to 6 frames (four steps: round 0 cut in three by the
    ladder's largest total, then e's last piece) raises:
    exactly its streams get an error (the exception and the frames left undecoded), with the audio of their
    pieces decoded before it; their slots are released; the steps after it run; later chunks of a failed
    stream get its error until it ends, then the id starts afresh; every other stream stays exact."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 6, graph_frame_sizes=[1, 4], graph_frame_totals=frame_totals(7))
    total = {rid: 1 + frames + THIRD for rid, frames in SECOND.items()}
    codes = {rid: _codes(ring_decoder, n, seed) for seed, (rid, n) in enumerate(total.items())}
    first = s.decode([ChunkRequest(rid, c[:, :1]) for rid, c in codes.items()])  # every stream holds a slot
    assert not any(r.error for r in first.values())

    tried = _inject(s, monkeypatch, fail_at, when)
    second = [ChunkRequest(rid, codes[rid][:, 1 : 1 + n], rid == "b") for rid, n in SECOND.items()]
    got = s.decode(second)
    assert tried == STEP_SHAPES if fail_at != 3 else tried == STEP_SHAPES[:3]  # e's last piece is dropped
    failed = set(STEPS[fail_at - 1])
    rows, frames, _ = STEP_SHAPES[fail_at - 1]
    for rid, n in SECOND.items():
        res = got[rid]
        if rid not in failed:
            assert res.error is None and res.frames == n, rid
            _close(res.audio, ring_decoder.decode(codes[rid][:, None, : 1 + n], [1, *_pieces(n)])[0][:, spf:], rid)
            continue
        kept = 4 if (rid, fail_at) == ("e", 4) else 0  # e's first piece was decoded in step 3
        assert res.error == (
            f"request {rid!r}: its decoder step ({rows} rows x {frames} frames) failed with RuntimeError: "
            f"injected failure in step {fail_at}; the stream was ended, frames left undecoded: {n - kept}"
        )
        assert res.frames == kept and res.audio.shape == (ring_decoder.config.number_channels, kept * spf)
        if kept:
            _close(res.audio, ring_decoder.decode(codes[rid][:, None, :5], [1, 4])[0][:, spf:], f"{rid} kept")
    survivors = [rid for rid in SECOND if rid not in failed and rid != "b"]
    assert sorted(s.live_requests) == sorted(survivors) and s.free_slots == 6 - len(survivors)
    assert s.stats()["request_errors"] == len(failed)

    # Later calls: the survivors decode exactly; a failed stream that has not ended keeps its error until it
    # ends; the ended id "b" (and every failed id after its terminal chunk) starts a fresh stream.
    monkeypatch.undo()
    third = s.decode([ChunkRequest(rid, codes[rid][:, -THIRD:], True) for rid in SECOND])
    for rid in SECOND:
        if rid in failed and rid != "b":
            assert third[rid].error == got[rid].error and third[rid].frames == 0, rid
        elif rid == "b":
            assert third[rid].error is None
            _close(third[rid].audio, ring_decoder.decode(codes[rid][:, None, -THIRD:], [THIRD])[0], "b afresh")
        else:
            schedule = [1, *_pieces(SECOND[rid]), THIRD]
            _close(third[rid].audio, ring_decoder.decode(codes[rid][:, None], schedule)[0][:, -THIRD * spf :], rid)
    assert not s.live_requests and s.free_slots == 6
    fresh = s.decode([ChunkRequest(rid, codes[rid][:, :2], True) for rid in SECOND])
    for rid in SECOND:
        assert fresh[rid].error is None
        _close(fresh[rid].audio, ring_decoder.decode(codes[rid][:, None, :2], [2])[0], f"{rid} afresh")


def test_a_failing_step_fails_a_stream_admitted_from_the_queue_alone(ring_decoder, monkeypatch):
    """A waiting stream admitted in a call whose step for it raises: its result (not in the batch) carries the
    error; the stream that ended to free its slot keeps its audio."""
    s = make_session(ring_decoder, 1)
    a, w = _codes(ring_decoder, 2, 1), _codes(ring_decoder, 2, 2)
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("w", w)])  # "w" waits for the only slot
    _inject(s, monkeypatch, 2, "before")  # step 1: a's terminal chunk; step 2: w's buffered chunk
    got = s.decode([ChunkRequest("a", a[:, 1:], True)])
    _close(got["a"].audio, ring_decoder.decode(a[:, None], [1, 1])[0][:, ring_decoder.config.samples_per_frame :], "a")
    assert got["w"].error == (
        "request 'w': its decoder step (1 rows x 2 frames) failed with RuntimeError: injected failure in step 2; "
        "the stream was ended, frames left undecoded: 2"
    )
    assert got["w"].frames == 0 and not got["w"].queued
    assert s.live_requests == {} and s.waiting_requests == [] and s.free_slots == 1


def test_an_exception_that_is_not_an_error_still_propagates(ring_decoder, monkeypatch):
    """Only ``Exception`` fails a step's rows; a ``KeyboardInterrupt`` inside a step leaves the call at once."""
    s = make_session(ring_decoder, 2)

    def interrupted(codes, lengths, slot_ids, valid, frames):
        raise KeyboardInterrupt

    monkeypatch.setattr(s.step_runner, "eager_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1))])


# ----------------------------------------------------------------------------- admission, preemption, resumption


def _failing(session, monkeypatch, method: str) -> None:
    """Make every later call of the pool's ``method`` raise (before it changes anything)."""

    def broken(*args):
        raise RuntimeError(f"injected {method} failure")

    monkeypatch.setattr(session.pool, method, broken)


_WHAT = {
    "save_slot": "saving its decoder state to preempt it",
    "restore_slot": "restoring its preempted decoder state",
    "acquire": "admitting it to a decoder slot",
}


def _error(rid: str, method: str, undecoded: int) -> str:
    return (
        f"request {rid!r}: {_WHAT[method]} failed with RuntimeError: injected {method} failure; "
        f"the stream was ended, frames left undecoded: {undecoded}"
    )


def _logged(caplog, error: str) -> int:
    return sum(r.getMessage() == f"MOSS codec: {error}" and r.exc_info is not None for r in caplog.records)


@pytest.mark.parametrize("method", ["save_slot", "restore_slot"])
def test_a_failing_preemption_for_a_terminal_chunk_fails_the_preempted_stream_alone(
    method, ring_decoder, monkeypatch, caplog
):
    """Two slots, both live ("l1", "l2"); "w" waits and sends its terminal chunk: "l2" (the youngest) is preempted
    for it. When saving l2's state raises, l2 fails (its state never reached the host) and its slot goes to "w";
    when restoring it raises once "w" has ended, l2 fails then and its slot is freed. Either way l2 gets the error
    once (logged once), "w" and "l1" decode exactly in that call and after, and no slot leaks."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 2)
    l1, l2, w = (_codes(ring_decoder, n, seed) for n, seed in ((3, 1), (4, 2), (3, 3)))
    s.decode([ChunkRequest("l1", l1[:, :1]), ChunkRequest("l2", l2[:, :1])])
    assert s.decode([ChunkRequest("w", w[:, :1])])["w"].queued

    _failing(s, monkeypatch, method)
    batch = [ChunkRequest("l1", l1[:, 1:2]), ChunkRequest("l2", l2[:, 1:3]), ChunkRequest("w", w[:, 1:], True)]
    with caplog.at_level(logging.ERROR):
        got = s.decode(batch)
    monkeypatch.undo()
    error = _error("l2", method, 2)
    assert (got["l2"].error, got["l2"].frames, got["l2"].queued) == (error, 0, False)
    assert _logged(caplog, error) == 1
    assert got["l1"].error is None and got["w"].error is None and got["w"].frames == 3
    _close(got["l1"].audio, ring_decoder.decode(l1[:, None, :2], [1, 1])[0][:, spf:], "l1")
    _close(got["w"].audio, ring_decoder.decode(w[:, None], [1, 2])[0], "w")
    assert s.live_requests == {"l1": 0} and s.waiting_requests == [] and s.free_slots == 1
    assert s.stats()["request_errors"] == 1 and s.stats()["preemptions"] == (method == "restore_slot")

    # l2 stays refused until its request ends; l1 ends exactly; the id "l2" then starts afresh.
    last = s.decode([ChunkRequest("l1", l1[:, 2:], True), ChunkRequest("l2", l2[:, 3:], True)])
    assert (last["l2"].error, last["l2"].frames) == (error, 0)
    _close(last["l1"].audio, ring_decoder.decode(l1[:, None], [1, 1, 1])[0][:, 2 * spf :], "l1 after")
    assert s.live_requests == {} and s.free_slots == 2
    fresh = s.decode([ChunkRequest("l2", l2, True)])["l2"]
    assert fresh.error is None
    _close(fresh.audio, ring_decoder.decode(l2[:, None], [4])[0], "l2 afresh")


@pytest.mark.parametrize("method", ["save_slot", "restore_slot"])
def test_a_failing_preemption_for_pages_fails_the_preempted_stream_alone(method, ring_decoder, monkeypatch, caplog):
    """A paged pool with pages for less than both streams' chunks: "a" is preempted so that "b" (terminal) can
    decode. Saving a's state, or restoring it once "b" ended, raises: "a" fails with the error (logged once), "b"
    decodes exactly, and every slot and page is free again."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 2, pool_kind="paged", page_fraction=0.75)
    full = s.pool.free_page_counts()
    codes = random_codes(ring_decoder, 2, 6, seed=1)
    a, b = codes[:, 0], codes[:, 1]
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1])])

    _failing(s, monkeypatch, method)
    with caplog.at_level(logging.ERROR):
        got = s.decode([ChunkRequest("a", a[:, 1:5]), ChunkRequest("b", b[:, 1:5], True)])
    monkeypatch.undo()
    error = _error("a", method, 4)
    assert (got["a"].error, got["a"].frames, got["a"].queued) == (error, 0, False)
    assert _logged(caplog, error) == 1
    assert got["b"].error is None
    _close(got["b"].audio, ring_decoder.decode(b[:, None, :5], [1, 4])[0][:, spf:], "b")
    assert s.live_requests == {} and s.waiting_requests == [] and s.free_slots == 2
    assert s.pool.free_page_counts() == full
    assert s.stats()["request_errors"] == 1 and s.stats()["preemptions"] == (method == "restore_slot")

    last = s.decode([ChunkRequest("a", a[:, 5:], True)])["a"]
    assert (last.error, last.frames) == (error, 0)
    fresh = s.decode([ChunkRequest("a", a[:, :2], True)])["a"]
    assert fresh.error is None
    _close(fresh.audio, ring_decoder.decode(a[:, None, :2], [2])[0], "a afresh")
    assert s.free_slots == 2 and s.pool.free_page_counts() == full


def test_a_failing_admission_fails_the_admitted_stream_alone(ring_decoder, monkeypatch, caplog):
    """A slot frees between calls (on_requests_finished) for the waiting "w"; taking it raises as the next call
    admits "w" (before its chunk of that call is routed), and again for the new stream "n": both fail, each with
    its error once (this call's chunk included in the frames left undecoded), and "k" decodes exactly."""
    s = make_session(ring_decoder, 2)
    k, w, n = (_codes(ring_decoder, t, seed) for t, seed in ((3, 1), (3, 2), (2, 3)))
    s.decode([ChunkRequest("k", k[:, :1]), ChunkRequest("a", w[:, :1])])
    assert s.decode([ChunkRequest("w", w[:, :1])])["w"].queued
    s.on_requests_finished(["a"])

    _failing(s, monkeypatch, "acquire")
    with caplog.at_level(logging.ERROR):
        got = s.decode([ChunkRequest("w", w[:, 1:]), ChunkRequest("k", k[:, 1:2]), ChunkRequest("n", n)])
    monkeypatch.undo()
    errors = {"w": _error("w", "acquire", 3), "n": _error("n", "acquire", 2)}
    for rid, error in errors.items():
        assert (got[rid].error, got[rid].frames, got[rid].queued) == (error, 0, False)
        assert _logged(caplog, error) == 1
    _close(
        got["k"].audio, ring_decoder.decode(k[:, None, :2], [1, 1])[0][:, ring_decoder.config.samples_per_frame :], "k"
    )
    assert s.live_requests == {"k": 0} and s.waiting_requests == [] and s.free_slots == 1
    assert s.stats()["request_errors"] == 2

    last = s.decode([ChunkRequest(rid, c[:, -1:], True) for rid, c in (("w", w), ("n", n), ("k", k))])
    assert {rid: last[rid].error for rid in errors} == errors
    _close(
        last["k"].audio, ring_decoder.decode(k[:, None], [1, 1, 1])[0][:, -ring_decoder.config.samples_per_frame :], "k"
    )
    assert s.live_requests == {} and s.free_slots == 2


# ----------------------------------------------------------------------------- reservations and releases


def _failing_for(session, monkeypatch, method: str, slot: int, times: int | None = None) -> None:
    """Make the later calls of the pool's ``method`` that name ``slot`` raise (before they change anything): the
    first ``times`` of them, or every one."""
    real, raised = getattr(session.pool, method), []

    def broken(slots, *args, **kwargs):
        if slot in list(slots) and (times is None or len(raised) < times):
            raised.append(slot)
            raise RuntimeError(f"injected {method} failure")
        return real(slots, *args, **kwargs)

    monkeypatch.setattr(session.pool, method, broken)


def _call_error(rid: str, what: str, method: str, undecoded: int) -> str:
    return (
        f"request {rid!r}: {what} failed with RuntimeError: injected {method} failure; the stream was ended, "
        f"frames left undecoded: {undecoded}"
    )


def _pages(session) -> list[int] | None:
    return session.pool.free_page_counts() if hasattr(session.pool, "free_page_counts") else None


@pytest.mark.parametrize("pool_kind", ["compact", "paged"])
def test_a_failing_reservation_before_a_step_fails_the_ready_streams_not_the_call(
    pool_kind, ring_decoder, monkeypatch, caplog
):
    """The joint reservation of every ready stream's pages before a step raises: no one stream is to blame, so
    each ready stream ("a", and "b" with its terminal chunk) fails with an error naming the reservation (logged
    once each); decode() returns instead of raising; their slots and pages are free. "k", live without a chunk
    in that call, decodes exactly afterwards; "a" stays refused until it ends, the ended "b" starts afresh."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 3, pool_kind=pool_kind)
    full = _pages(s)
    a, b, k = (_codes(ring_decoder, 6, seed) for seed in (1, 2, 3))
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1]), ChunkRequest("k", k[:, :1])])

    _failing(s, monkeypatch, "reserve")
    with caplog.at_level(logging.ERROR):
        got = s.decode([ChunkRequest("a", a[:, 1:5]), ChunkRequest("b", b[:, 1:3], True)])
    monkeypatch.undo()
    what = "reserving decoder state pages for the step of the 2 ready streams"
    errors = {"a": _call_error("a", what, "reserve", 4), "b": _call_error("b", what, "reserve", 2)}
    for rid, error in errors.items():
        assert (got[rid].error, got[rid].frames, got[rid].queued) == (error, 0, False)
        assert _logged(caplog, error) == 1
    assert set(got) == {"a", "b"} and set(s.live_requests) == {"k"} and s.free_slots == 2
    assert s.stats()["request_errors"] == 2

    last = s.decode([ChunkRequest("a", a[:, 5:], True), ChunkRequest("k", k[:, 1:], True)])
    assert (last["a"].error, last["a"].frames) == (errors["a"], 0)
    assert last["k"].error is None
    _close(last["k"].audio, ring_decoder.decode(k[:, None], [1, 5])[0][:, spf:], "k")
    fresh = s.decode([ChunkRequest("b", b[:, :2], True)])["b"]
    assert fresh.error is None
    _close(fresh.audio, ring_decoder.decode(b[:, None, :2], [2])[0], "b afresh")
    assert s.live_requests == {} and s.free_slots == 3 and _pages(s) == full


def test_a_failing_reservation_of_the_live_streams_before_an_admission_fails_them_not_the_newcomer(
    ring_decoder, monkeypatch, caplog
):
    """Admitting the new stream "n" first reserves the live streams' pages for their chunks of the call; that
    reservation raises: the live stream with a chunk ("a") fails, naming it, and "n" is admitted and decodes
    exactly in the same call; every slot and page is free once "n" ends."""
    s = make_session(ring_decoder, 2, pool_kind="paged")
    full = _pages(s)
    a, n = _codes(ring_decoder, 4, 1), _codes(ring_decoder, 3, 2)
    s.decode([ChunkRequest("a", a[:, :1])])
    _failing_for(s, monkeypatch, "reserve", s.live_requests["a"], times=1)  # "n" gets a's slot once it fails
    with caplog.at_level(logging.ERROR):
        got = s.decode([ChunkRequest("a", a[:, 1:4]), ChunkRequest("n", n, True)])
    monkeypatch.undo()
    error = _call_error("a", "reserving decoder state pages for the live streams' chunks (1 streams)", "reserve", 3)
    assert (got["a"].error, got["a"].frames) == (error, 0)
    assert _logged(caplog, error) == 1
    assert got["n"].error is None
    _close(got["n"].audio, ring_decoder.decode(n[:, None], [3])[0], "n")
    assert s.live_requests == {} and s.free_slots == 2 and _pages(s) == full


def test_a_failing_release_of_an_ended_stream_fails_it_alone_and_its_slot_frees_next_call(
    ring_decoder, monkeypatch, caplog
):
    """Two streams end in one call; releasing their slots raises, and so does releasing a's alone: "a" keeps its
    exact audio with the error beside it, "b" ends normally (its slot released alone). a's slot (and its pages)
    is released as the next call begins."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 2, pool_kind="paged")
    full = _pages(s)
    a, b = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 3, 2)
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1])])
    _failing_for(s, monkeypatch, "release", s.live_requests["a"])
    with caplog.at_level(logging.ERROR):
        got = s.decode([ChunkRequest("a", a[:, 1:], True), ChunkRequest("b", b[:, 1:], True)])
    monkeypatch.undo()
    error = _call_error("a", "releasing its decoder slot as it ended", "release", 0)
    assert (got["a"].error, got["a"].frames) == (error, 2)
    assert _logged(caplog, error) == 1
    _close(got["a"].audio, ring_decoder.decode(a[:, None], [1, 2])[0][:, spf:], "a")
    assert got["b"].error is None
    _close(got["b"].audio, ring_decoder.decode(b[:, None], [1, 2])[0][:, spf:], "b")
    assert s.live_requests == {} and s.free_slots == 1 and _pages(s) != full
    assert s.decode([]) == {}
    assert s.free_slots == 2 and _pages(s) == full
    fresh = s.decode([ChunkRequest("a", a, True)])["a"]  # it ended: the id starts afresh
    assert fresh.error is None
    _close(fresh.audio, ring_decoder.decode(a[:, None], [3])[0], "a afresh")


def test_a_failing_release_after_a_step_failure_adds_to_the_streams_error(ring_decoder, monkeypatch):
    """A step raises and releasing its stream's slot raises too: the stream's error names both; the slot is
    released as the next call begins."""
    s = make_session(ring_decoder, 1)
    a = _codes(ring_decoder, 3, 1)
    s.decode([ChunkRequest("a", a[:, :1])])
    _inject(s, monkeypatch, 1, "before")
    _failing_for(s, monkeypatch, "release", s.live_requests["a"])
    got = s.decode([ChunkRequest("a", a[:, 1:2])])["a"]
    monkeypatch.undo()
    assert got.error == (
        "request 'a': its decoder step (1 rows x 1 frames) failed with RuntimeError: injected failure in step 1; "
        "the stream was ended, frames left undecoded: 1; releasing its decoder slot failed with RuntimeError: "
        "injected release failure"
    )
    assert s.free_slots == 0
    assert s.decode([ChunkRequest("a", a[:, 2:], True)])["a"].error == got.error  # refused until it ends
    assert s.free_slots == 1 and s.live_requests == {}


def test_a_failing_release_of_a_preempted_stream_fails_it_and_another_is_preempted(ring_decoder, monkeypatch, caplog):
    """ "l2" is preempted for the waiting "w"'s terminal chunk; its state is saved but freeing its slot raises:
    "l2" fails (it cannot wait to resume a slot that is not free), so "l1" is preempted in its place, "w" decodes
    exactly in its call and "l1" resumes exactly once "w" ended. The next call releases l2's slot first: once
    "l1" ends every slot is free."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 2)
    l1, l2, w = (_codes(ring_decoder, n, seed) for n, seed in ((3, 1), (4, 2), (3, 3)))
    s.decode([ChunkRequest("l1", l1[:, :1]), ChunkRequest("l2", l2[:, :1])])
    assert s.decode([ChunkRequest("w", w[:, :1])])["w"].queued
    _failing_for(s, monkeypatch, "release", s.live_requests["l2"])
    batch = [ChunkRequest("l1", l1[:, 1:2]), ChunkRequest("l2", l2[:, 1:3]), ChunkRequest("w", w[:, 1:], True)]
    with caplog.at_level(logging.ERROR):
        got = s.decode(batch)
    monkeypatch.undo()
    error = _call_error("l2", "freeing its decoder slot to preempt it", "release", 2)
    assert (got["l2"].error, got["l2"].frames, got["l2"].queued) == (error, 0, False)
    assert _logged(caplog, error) == 1
    assert got["w"].error is None and got["l1"].error is None
    _close(got["w"].audio, ring_decoder.decode(w[:, None], [1, 2])[0], "w")
    _close(got["l1"].audio, ring_decoder.decode(l1[:, None, :2], [1, 1])[0][:, spf:], "l1")
    assert set(s.live_requests) == {"l1"} and s.waiting_requests == [] and s.free_slots == 0
    assert s.stats()["preemptions"] == 1 and s.stats()["request_errors"] == 1

    last = s.decode([ChunkRequest("l1", l1[:, 2:], True)])
    _close(last["l1"].audio, ring_decoder.decode(l1[:, None], [1, 1, 1])[0][:, 2 * spf :], "l1 after")
    assert s.live_requests == {} and s.waiting_requests == [] and s.free_slots == 2


def test_a_failing_release_as_requests_finish_does_not_raise_and_the_slot_frees_next_call(ring_decoder, monkeypatch):
    """on_requests_finished: releasing the finished streams' slots raises (a's alone too): the call returns, b's
    slot is free at once, a's as the next decode begins."""
    s = make_session(ring_decoder, 2)
    s.decode([ChunkRequest(rid, _codes(ring_decoder, 1, seed)) for seed, rid in enumerate("ab")])
    _failing_for(s, monkeypatch, "release", s.live_requests["a"])
    s.on_requests_finished(["a", "b"])
    monkeypatch.undo()
    assert s.live_requests == {} and s.free_slots == 1
    assert s.decode([]) == {} and s.free_slots == 2


def _broken_planner(session, monkeypatch) -> None:
    def broken(planner, round_pieces):
        raise RuntimeError("injected planner failure")

    monkeypatch.setattr(StepPlanner, "plan_round", broken)


def test_a_call_that_raises_past_its_checks_ends_the_streams_it_touched(ring_decoder, monkeypatch):
    """Something outside a pool step raises in a call (the step planner here): decode() raises it, as documented,
    and keeps it in ``last_call_error``; the call's streams ("a" live, "n" new) are ended (slots free) and stay
    refused until they end, the error naming the call; "k", live without a chunk in the call, decodes on
    exactly. A successful call clears ``last_call_error``; a refused one (a duplicate id) never sets it."""
    spf = ring_decoder.config.samples_per_frame
    s = make_session(ring_decoder, 3)
    a, k, n = (_codes(ring_decoder, 3, seed) for seed in (1, 2, 3))
    s.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("k", k[:, :1])])
    assert s.last_call_error is None

    _broken_planner(s, monkeypatch)
    with pytest.raises(RuntimeError, match="^injected planner failure$") as info:
        s.decode([ChunkRequest("a", a[:, 1:2]), ChunkRequest("n", n[:, :1])])
    monkeypatch.undo()
    assert s.last_call_error is info.value
    assert set(s.live_requests) == {"k"} and s.waiting_requests == [] and s.free_slots == 2

    last = s.decode(
        [ChunkRequest("a", a[:, 2:], True), ChunkRequest("n", n[:, 1:], True), ChunkRequest("k", k[:, 1:], True)]
    )
    assert s.last_call_error is None
    for rid in ("a", "n"):
        assert last[rid].error == (
            f"request {rid!r}: its decode call failed with RuntimeError: injected planner failure; the stream was ended"
        )
        assert last[rid].frames == 0
    _close(last["k"].audio, ring_decoder.decode(k[:, None], [1, 2])[0][:, spf:], "k")
    assert s.live_requests == {} and s.free_slots == 3
    with pytest.raises(ValueError, match="appears twice"):
        s.decode([ChunkRequest("a", a), ChunkRequest("a", a)])
    assert s.last_call_error is None


# ----------------------------------------------------------------------------- one caller


def _busy_message(called: str, running: str) -> str:
    return (
        f"CodecStreamSession.{called}() called while CodecStreamSession.{running}() of the same session runs "
        "(from another thread or from inside it); a session takes one caller at a time"
    )


def test_a_second_thread_is_refused_while_a_call_runs(ring_decoder, monkeypatch):
    """While one thread's decode() is inside a pool step, every mutating method called from another thread
    raises at once, changing nothing; the first call then finishes exactly and the session serves again."""
    s = make_session(ring_decoder, 2)
    real = s.step_runner.eager_step
    entered, release = threading.Event(), threading.Event()

    def blocking(codes, lengths, slot_ids, valid, frames):
        entered.set()
        assert release.wait(timeout=60)
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", blocking)
    a = _codes(ring_decoder, 3, 1)
    out = {}
    worker = threading.Thread(target=lambda: out.update(s.decode([ChunkRequest("a", a[:, :2])])))
    worker.start()
    try:
        assert entered.wait(timeout=60)
        calls = {
            "decode": lambda: s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 2))]),
            "on_requests_finished": lambda: s.on_requests_finished(["a"]),
            "close": s.close,
            "enable_call_traces": s.enable_call_traces,
            "disable_call_traces": s.disable_call_traces,
        }
        for name, call in calls.items():
            with pytest.raises(RuntimeError) as info:
                call()
            assert str(info.value) == _busy_message(name, "decode")
    finally:
        release.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    _close(out["a"].audio, ring_decoder.decode(a[:, None, :2], [2])[0], "a")
    assert set(s.live_requests) == {"a"} and s.free_slots == 1
    monkeypatch.undo()
    rest = s.decode([ChunkRequest("a", a[:, 2:], True)])["a"]
    spf = ring_decoder.config.samples_per_frame
    _close(rest.audio, ring_decoder.decode(a[:, None], [2, 1])[0][:, 2 * spf :], "a after")
    assert s.free_slots == 2


def test_a_call_from_inside_a_running_one_is_refused(ring_decoder, monkeypatch):
    """Re-entrant calls (a generator of requests or ids, a step) raise; the outer call is not disturbed."""
    s = make_session(ring_decoder, 2)
    a = _codes(ring_decoder, 2, 1)
    s.decode([ChunkRequest("a", a[:, :1])])

    def requests():
        s.decode([])
        yield ChunkRequest("a", a[:, 1:])

    with pytest.raises(RuntimeError) as info:
        s.decode(requests())
    assert str(info.value) == _busy_message("decode", "decode")

    def ids():
        yield "a"
        s.close()

    with pytest.raises(RuntimeError) as info:
        s.on_requests_finished(ids())
    assert str(info.value) == _busy_message("close", "on_requests_finished")
    assert s.live_requests == {} and s.free_slots == 2  # the id seen before the failure was released

    real, refused = s.step_runner.eager_step, []

    def step(codes, lengths, slot_ids, valid, frames):
        try:
            s.on_requests_finished(["b"])
        except RuntimeError as exc:
            refused.append(str(exc))
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", step)
    got = s.decode([ChunkRequest("b", a, True)])["b"]
    assert refused == [_busy_message("on_requests_finished", "decode")]
    _close(got.audio, ring_decoder.decode(a[:, None], [2])[0], "b")
    assert s.free_slots == 2


def test_a_waiting_stream_gets_the_slot_whose_release_failed_once_in_the_same_call(ring_decoder, monkeypatch):
    """One slot: "x" is live, "y" waits. x ends and y sends its terminal chunk in one call while releasing x's slot
    raises once: x gets the error beside its audio, the slot is released again before y's admission in that call,
    and y's terminal chunk decodes exactly in it."""
    s = make_session(ring_decoder, 1)
    x, y = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 3, 2)
    s.decode([ChunkRequest("x", x[:, :1])])
    assert s.decode([ChunkRequest("y", y[:, :1])])["y"].queued
    _failing_for(s, monkeypatch, "release", s.live_requests["x"], times=1)
    got = s.decode([ChunkRequest("x", x[:, 1:], True), ChunkRequest("y", y[:, 1:], True)])
    assert got["x"].error == _call_error("x", "releasing its decoder slot as it ended", "release", 0)
    assert got["y"].error is None and not got["y"].queued
    _close(got["y"].audio, ring_decoder.decode(y[:, None], [3])[0], "y")
    assert s.waiting_requests == [] and s.live_requests == {} and s.free_slots == 1


def test_a_terminal_chunk_left_without_a_slot_fails_its_stream_in_its_call(ring_decoder, monkeypatch):
    """As above, but releasing x's slot raises for the whole call: y's terminal chunk cannot be decoded in its call,
    so y fails there with an error (never left queued for a request the engine is finishing), and a later chunk
    under y starts afresh once the slot is back."""
    s = make_session(ring_decoder, 1)
    x, y = _codes(ring_decoder, 3, 1), _codes(ring_decoder, 3, 2)
    s.decode([ChunkRequest("x", x[:, :1])])
    s.decode([ChunkRequest("y", y[:, :1])])
    _failing_for(s, monkeypatch, "release", s.live_requests["x"])
    got = s.decode([ChunkRequest("x", x[:, 1:], True), ChunkRequest("y", y[:, 1:], True)])
    monkeypatch.undo()
    assert got["y"].error == (
        "request 'y': decoding its terminal chunk failed with RuntimeError: no decoder slot could be freed for it in "
        "this call; the stream was ended, frames left undecoded: 3"
    )
    assert not got["y"].queued and got["y"].frames == 0 and s.waiting_requests == []
    fresh = s.decode([ChunkRequest("y", y, True)])["y"]
    assert fresh.error is None
    _close(fresh.audio, ring_decoder.decode(y[:, None], [3])[0], "y afresh")
    assert s.free_slots == 1


def test_an_interrupt_in_a_step_ends_the_calls_streams(ring_decoder, monkeypatch):
    """A ``KeyboardInterrupt`` (not an ``Exception``) raised in a step propagates, and the streams of its call end
    as after any failure of the call: the stream whose frames were taken and never decoded does not go on with
    ``error=None``; its next chunk is refused naming the interrupt, and a new request decodes as one alone."""
    session = make_session(ring_decoder, 2)
    codes = _codes(ring_decoder, 12, seed=31)
    session.decode([ChunkRequest("a", codes[:, 0:4])])
    real_step = session.step_runner.eager_step

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(session.step_runner, "eager_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.decode([ChunkRequest("a", codes[:, 4:8])])
    assert isinstance(session.last_call_error, RuntimeError)
    assert str(session.last_call_error) == "interrupted by KeyboardInterrupt"
    monkeypatch.setattr(session.step_runner, "eager_step", real_step)
    after = session.decode([ChunkRequest("a", codes[:, 8:12], True), ChunkRequest("b", codes[:, 0:4], True)])
    assert after["a"].error is not None and "interrupted by KeyboardInterrupt" in after["a"].error
    assert after["a"].audio.numel() == 0
    alone = make_session(ring_decoder, 2).decode([ChunkRequest("b", codes[:, 0:4], True)])
    assert after["b"].error is None and torch.equal(after["b"].audio, alone["b"].audio)


def test_the_session_takes_its_records_only(ring_decoder):
    """``(decoder, spec, options, *, compile)``: a wrong type names the argument and what it must be."""
    from vllm_omni_moss.model_executor.models.moss_tts.serving import CodecStreamSession, SessionOptions
    from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec

    spec, options = StateSpec.from_options(ring_decoder), SessionOptions(2)
    with pytest.raises(TypeError, match=r"^CodecStreamSession: spec must be a StateSpec, got int$"):
        CodecStreamSession(ring_decoder, 4, options)
    with pytest.raises(TypeError, match=r"^CodecStreamSession: spec must be a StateSpec, got SessionOptions$"):
        CodecStreamSession(ring_decoder, options, spec)
    with pytest.raises(TypeError, match=r"^CodecStreamSession: options must be a SessionOptions, got dict$"):
        CodecStreamSession(ring_decoder, spec, {"state_capacity": 2})
    with pytest.raises(TypeError, match=r"^CodecStreamSession: compile must be a bool or a callable, got 'yes'$"):
        CodecStreamSession(ring_decoder, spec, options, compile="yes")
    with pytest.raises(TypeError):
        CodecStreamSession(ring_decoder, spec, options, pool_kind="compact")  # the loose keywords are gone
