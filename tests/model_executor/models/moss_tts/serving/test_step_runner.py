# SPDX-License-Identifier: Apache-2.0
"""The step runner (``serving/step_runner.py``): one packed step per round of a call whatever its chunks'
lengths, shaped by the session's step ladder (``graph_ladder.StepLadder``) on every device (docs/serving.md,
"Steps"). Every stream's audio is compared with its solo decode, or with offline decode under exact semantics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moss_codecs import (
    ChunkDriver,
    assert_close_to_solo,
    count_steps,
    make_session,
    make_state_pool,
    random_codes,
    solo_decode,
    stream_codes,
)

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import StepLadder, StepShape, frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest, SessionOptions
from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import StepPlanner
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

RAMP = (1, 2, 4, 6)
TOTALS = (1, 2, 4, 8, 16, 24)


@pytest.mark.parametrize("kind", ["compact", "legacy", "paged"])
def test_a_ramp_decodes_in_one_step_per_call_and_every_stream_equals_its_solo_decode(kind, ring_decoder, monkeypatch):
    """Four streams start one call apart on the ramp 1, 2, 4, 6: every call holds chunks of up to four lengths
    and decodes them in one step of 6 frames a row, packed to the smallest ladder total holding its real frames
    (dummy frames included, as a GPU runs them); each stream's audio is its solo decode."""
    s = make_session(ring_decoder, 4, pool_kind=kind, graph_frame_totals=TOTALS, graph_frame_sizes=RAMP)
    steps = count_steps(s, monkeypatch)
    d = ChunkDriver(s, ring_decoder)
    for i, rid in enumerate("abcd"):
        d.add(rid, 19, i)
    calls = [
        [("a", 1, False)],
        [("a", 2, False), ("b", 1, False)],
        [("a", 4, False), ("b", 2, False), ("c", 1, False)],
        [("a", 6, False), ("b", 4, False), ("c", 2, False), ("d", 1, False)],
        [("a", 6, True), ("b", 6, False), ("c", 4, False), ("d", 2, False)],
        [("b", 6, True), ("c", 6, False), ("d", 4, False)],
        [("c", 6, True), ("d", 6, False)],
        [("d", 6, True)],
    ]
    for call in calls:
        d.step(call)
    for rid in "abcd":
        d.check(rid)
    # Real frames 1, 3, 7, 13, 18, 16, 12, 6 pad to the totals 1, 4, 8, 16, 24, 16, 16, 8 (eager steps carry
    # no padding rows: they would change nothing).
    assert steps == [(1, 6, 1), (2, 6, 4), (3, 6, 8), (4, 6, 16), (4, 6, 24), (3, 6, 16), (2, 6, 16), (1, 6, 8)]
    assert s.stats()["padded_frames"] == 0 + 1 + 1 + 3 + 6 + 0 + 4 + 2
    assert s.stats()["decoded_frames"] == 4 * 19 and s.free_slots == 4


def test_exact_ragged_steps_equal_offline_decode(ring_decoder):
    """Under exact ring semantics every stream equals its offline decode (1e-5): three streams of 17 frames start
    one call apart on the ramp 1, 2, 4, 6, 6, ..."""
    s = make_session(ring_decoder, 4, graph_frame_totals=TOTALS, graph_frame_sizes=RAMP, ring_semantics="exact")
    codes = {rid: stream_codes(ring_decoder, 17, 10 + i) for i, rid in enumerate("abc")}
    pos, audio = dict.fromkeys(codes, 0), {r: [] for r in codes}
    for call in range(8):
        reqs = []
        for i, r in enumerate(codes):
            if call >= i and pos[r] < 17:
                n = min(RAMP[min(call - i, len(RAMP) - 1)], 17 - pos[r])
                reqs.append(ChunkRequest(r, codes[r][:, pos[r] : pos[r] + n], pos[r] + n == 17))
                pos[r] += n
        for r, res in s.decode(reqs).items():
            audio[r].append(res.audio)
    assert pos == dict.fromkeys(codes, 17) and s.free_slots == 4
    for r, c in codes.items():
        offline = ring_decoder.decode(c[:, None])[0]
        got = torch.cat(audio[r], -1)
        assert (got - offline).abs().max().item() <= 1e-5 * offline.abs().max().item(), r


def test_plan_round_decides_each_step_shape_and_its_graph_once(ring_decoder):
    """A round is one ``StepBatch``, shortest rows first, whose shape is the ladder's for its real frames; it is a
    graph step when its shape is among the captured ones handed to the planner, else an eager step of the same
    shape."""
    ladder = SessionOptions(8, graph_frame_totals=TOTALS, graph_frame_sizes=RAMP).step_ladder
    planner = StepPlanner(ladder, frozenset({StepShape(8, 6, 16)}))
    pieces = {r: stream_codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 6), ("b", 1), ("c", 4), ("d", 2)])}
    (step,) = planner.plan_round({r: (slot, pieces[r]) for slot, r in enumerate(pieces)})
    assert (step.request_ids, step.slots, step.valid_frames) == (("b", "d", "c", "a"), (1, 3, 2, 0), (1, 2, 4, 6))
    assert (step.shape, step.graph, step.padding_rows) == (StepShape(8, 6, 16), True, 4)
    (wide,) = planner.plan_round({r: (i, stream_codes(ring_decoder, 6, i)) for i, r in enumerate("wxyz")})
    assert (wide.shape, wide.graph) == (StepShape(8, 6, 24), False)  # 24 real frames: no graph of that shape here


def test_a_round_no_shape_holds_is_cut_into_steps_that_fit(ring_decoder, monkeypatch):
    """Ladder totals up to 8 frames: a round of 4 + 4 + 4 real frames is cut into a step of 8 and one of 4, each
    stream equal to its solo decode; no step pads beyond its ladder total."""
    s = make_session(ring_decoder, 4, graph_frame_totals=(2, 4, 8), graph_frame_sizes=(4,))
    steps = count_steps(s, monkeypatch)
    codes = {r: stream_codes(ring_decoder, 4, i) for i, r in enumerate("abc")}
    got = s.decode([ChunkRequest(r, c, True) for r, c in codes.items()])
    assert steps == [(2, 4, 8), (1, 4, 4)] and s.stats()["padded_frames"] == 0
    for r, c in codes.items():
        assert_close_to_solo(got[r].audio, solo_decode(ring_decoder, c, [4]), r)


def test_without_graph_sizes_a_step_is_shaped_exactly_by_its_rows(ring_decoder, monkeypatch):
    s = make_session(ring_decoder, 4, max_step_frames=8)
    steps = count_steps(s, monkeypatch)
    got = s.decode([ChunkRequest(r, stream_codes(ring_decoder, n, i)) for i, (r, n) in enumerate([("a", 7), ("b", 2)])])
    assert steps == [(2, 7, 9)] and s.stats()["padded_frames"] == 0
    assert s.step_ladder == StepLadder(4, 8, ())
    for i, (r, n) in enumerate([("a", 7), ("b", 2)]):
        ref = ring_decoder.decode(stream_codes(ring_decoder, n, i)[:, None], chunk_frames=[n])[0]
        assert (got[r].audio - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 40),
    frames=st.sampled_from([1, 4, 6, 15]),
    lengths=st.lists(st.integers(1, 15), min_size=1, max_size=60),
)
def test_every_step_the_planner_makes_is_a_shape_the_graph_runner_captures(slots, frames, lengths):
    """The CPU and the GPU plan with one function: every step :meth:`StepLadder.cut` and :meth:`StepLadder.shape`
    make of a round is one of the shapes a session's graph runner captures (``shape_of_total`` of each ladder
    total), holds its rows and their frames, and pads at most ``1/32`` of its frames above 64."""
    ladder = StepLadder(slots, frames, tuple(frame_totals(slots * frames)))
    captured = {ladder.shape_of_total(n) for n in ladder.totals}
    lengths = [min(n, frames) for n in lengths][: slots * 2]
    first = 0
    for size in ladder.cut(lengths):
        rows = lengths[first : first + size]
        first += size
        shape = ladder.shape(rows)
        assert shape in captured
        assert shape.rows >= len(rows) and shape.frames >= max(rows) and shape.total_frames >= sum(rows)
        real = sum(rows)
        assert shape.total_frames - real <= (0 if real <= 64 else real // 32)
    assert first == len(lengths)


def test_decode_batch_refuses_a_total_frames_short_of_the_real_frames(ring_decoder):
    pool = make_state_pool(ring_decoder, "compact")
    pool.initialize(2)
    codes = random_codes(ring_decoder, 2, 3, seed=1)
    args = (codes, torch.tensor([3, 2]), torch.tensor([0, 1]), torch.tensor([True, False]))
    for bad in (2, 0, 3.0, True):
        with pytest.raises(ValueError) as err:
            decode_batch(pool, *args, total_frames=bad)
        assert str(err.value) == f"total_frames must be an integer >= 3 (the valid rows' frames), got {bad!r}"
    assert int(pool.slot_state(0)["layer_offsets"].abs().sum()) == 0  # nothing ran
    audio, lengths = decode_batch(pool, *args, total_frames=5)
    exact, _ = decode_batch(make_fresh(ring_decoder), *args)
    assert lengths.tolist() == [3 * ring_decoder.config.samples_per_frame, 0] and not audio[1].any()
    assert (audio - exact).abs().max().item() <= 1e-6 * exact.abs().max().item()


def make_fresh(decoder):
    pool = make_state_pool(decoder, "compact")
    pool.initialize(2)
    return pool


def test_the_removed_ragged_steps_option_is_refused():
    with pytest.raises(TypeError, match="ragged_steps"):
        SessionOptions(4, ragged_steps=True)


@pytest.mark.parametrize("kind", ["compact", "paged"])
def test_a_valid_row_of_no_frames_in_a_packed_step_writes_nothing(kind, ring_decoder):
    """A valid row with 0 valid frames beside a real one in a packed step: its slot's rings and offsets stay as
    they were (zeros), its audio is zero, and the real row's audio is that of a step without it."""
    pool = make_state_pool(ring_decoder, kind)
    pool.initialize(3)
    alone = make_state_pool(ring_decoder, kind)
    alone.initialize(3)
    for p in (pool, alone):
        p.acquire(), p.acquire()
    codes = random_codes(ring_decoder, 2, 4, seed=2)
    audio, lengths = decode_batch(
        pool, codes, torch.tensor([4, 0]), torch.tensor([0, 1]), torch.tensor([True, True]), total_frames=6
    )
    ref, _ = decode_batch(alone, codes[:, :1], torch.tensor([4]), torch.tensor([0]), torch.tensor([True]))
    assert lengths.tolist() == [4 * ring_decoder.config.samples_per_frame, 0] and not audio[1].any()
    assert (audio[0] - ref[0]).abs().max().item() <= 1e-6 * ref.abs().max().item()
    state = pool.slot_state(1)
    assert not state["layer_offsets"].any() and not any(r.any() for r in state["rings"])


def test_a_failed_step_whose_streams_alone_had_later_pieces_ends_the_call_cleanly(ring_decoder, monkeypatch):
    """Ladder totals up to 4 frames, chunks cut at 4: round 0 is (a, b) then (c); c alone has a second piece. c's
    step raises: c alone gets the error, the next round has no piece left and takes no step, and a and b equal
    their solo decodes, in this call and the next."""
    s = make_session(ring_decoder, 4, graph_frame_totals=(1, 2, 4), graph_frame_sizes=(4,))
    codes = {r: stream_codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 3), ("b", 3), ("c", 6)])}
    real, tried = s.step_runner.eager_step, []

    def step(codes, lengths, slot_ids, valid, frames):
        tried.append(lengths.shape[0])
        if len(tried) == 2:
            raise RuntimeError("injected failure in step 2")
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(s.step_runner, "eager_step", step)
    got = s.decode(
        [ChunkRequest("a", codes["a"][:, :1]), ChunkRequest("b", codes["b"][:, :1]), ChunkRequest("c", codes["c"])]
    )
    assert tried == [2, 1]
    assert got["c"].error == (
        "request 'c': its decoder step (1 rows x 4 frames) failed with RuntimeError: injected failure in step 2; "
        "the stream was ended, frames left undecoded: 6"
    )
    monkeypatch.undo()
    later = s.decode([ChunkRequest(r, codes[r][:, 1:], True) for r in "ab"])
    for r in "ab":
        assert got[r].error is None and later[r].error is None
        audio = torch.cat([got[r].audio, later[r].audio], -1)
        assert_close_to_solo(audio, solo_decode(ring_decoder, codes[r], [1, 2]), r)
    assert got["c"].frames == 0 and s.free_slots == 4


_NO_CYCLES = """
import gc, pathlib, sys, tempfile
sys.path.insert(0, sys.argv[1])
from moss_codecs import build_decoder, make_session, ring_codec_raw, stream_codes
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest

decoder = build_decoder(ring_codec_raw(), pathlib.Path(tempfile.mkdtemp()), version="v2")
s = make_session(decoder, 2, graph_frame_totals=(1, 2, 4, 8, 16, 24), graph_frame_sizes=(1, 2, 4, 6),
                 max_waiting_streams=1)
seen, real = [], s.step_runner.eager_step
s.step_runner.eager_step = lambda *args: seen.append(gc.isenabled()) or real(*args)
codes = {r: stream_codes(decoder, 9, i) for i, r in enumerate("abcd")}
s.decode([ChunkRequest("a", codes["a"][:, :1])])  # warm: first-call caches are not per-call garbage
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
for a, b in ((1, 3), (3, 7)):  # a, b live; c queued (2 slots), then refused with d's empty id
    s.decode([ChunkRequest(r, codes[r][:, a:b]) for r in "abc"] + [ChunkRequest("", codes["d"][:, :1])])
s.decode([ChunkRequest(r, codes[r][:, 7:], True) for r in "abc"])
s.decode([])
gc.collect()
print(len(gc.garbage), sorted({type(o).__name__ for o in gc.garbage}), seen, gc.isenabled(), s.free_slots)
"""


def test_no_collection_runs_inside_a_call_and_a_call_makes_no_cyclic_garbage():
    """Python's collector is paused for the whole call (every step sees it off) and on again once the call
    returns; calls that start, queue, refuse and end streams leave no cyclic garbage (what a collection would
    have to find), so the pause leaves nothing to pile up. Run in a process of its own without the Triton
    interpreter, whose launches leave cycles of their own (a GPU runs no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _NO_CYCLES, str(Path(__file__).resolve().parents[1])],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    assert out == f"0 [] {[False] * 7} True 2"  # 7 steps, none with the collector on
