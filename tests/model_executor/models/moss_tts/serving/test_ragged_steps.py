# SPDX-License-Identifier: Apache-2.0
"""Ragged steps (``ragged_steps=True``): one step per round of a call whatever its chunks' lengths, every op but
the attention on the packed real frames, and the packed lengths a GPU's graphs replay (docs/serving.md, "Ragged
steps"). Every stream's audio is compared with its solo decode, or with offline decode under exact semantics."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import ChunkDriver, assert_close_to_solo, count_steps, random_codes, solo_decode, stream_codes

from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import packed_total_for, packed_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest, CodecStreamSession, SessionOptions
from vllm_omni_moss.model_executor.models.moss_tts.state import make_state_pool
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

RAMP = (1, 2, 4, 6)
BUCKETS = (1, 2, 4, 8)


def test_packed_totals_are_the_bucket_times_each_smaller_frame_size_a_step_can_replay():
    assert packed_totals(8, [1, 2, 4, 6]) == [8, 16, 32]
    assert packed_totals(8, [1, 2, 4, 6], least_rows=5) == [16, 32]  # 5 rows, one of 6 frames: 10 at least
    assert packed_totals(1, [1, 2, 4, 6]) == [] and packed_totals(2, [1, 2, 4, 6], least_rows=2) == [8]
    assert packed_totals(8, [15]) == []
    assert [packed_total_for(8, [1, 2, 4, 6], n) for n in (1, 8, 9, 16, 17, 32, 33, 48)] == [
        8, 8, 16, 16, 32, 32, None, None,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["compact", "legacy", "paged"])
def test_a_ramp_decodes_in_one_step_per_call_and_every_stream_equals_its_solo_decode(kind, ring_decoder, monkeypatch):
    """Four streams start one call apart on the ramp 1, 2, 4, 6: every call holds chunks of up to four lengths
    and decodes them in one step of the largest frame size, packed to the length a GPU's graph of its bucket
    holds (dummy frames included, as a GPU runs them); each stream's audio is its solo decode."""
    s = CodecStreamSession(
        ring_decoder, 4, pool_kind=kind, graph_batch_sizes=BUCKETS, graph_frame_sizes=RAMP, ragged_steps=True
    )
    packed: list[int | None] = []
    steps = count_steps(s, monkeypatch, packed)
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
    assert steps == [(1, 1), (2, 2), (3, 4), (4, 6), (4, 6), (3, 6), (2, 6), (1, 6)]
    # Real frames 13 (bucket 4: 16), 18 (4 x 6 = 24: the grid), 16 (bucket 4: 16), 12 (bucket 2: the grid), 6.
    assert packed == [None, None, None, 16, None, 16, None, None]
    assert s.stats()["padded_frames"] == (1 + 5) + (16 - 13) + (24 - 18) + (16 - 16) + (12 - 12)
    assert s.stats()["decoded_frames"] == 4 * 19 and s.free_slots == 4


def test_ragged_steps_equal_per_size_steps_state_included(ring_decoder):
    """The same traffic through a ragged session and a per-size one leaves the same audio (1e-5) and the same
    frame counters in every slot; the ragged one takes one step a call."""
    sessions = [
        CodecStreamSession(ring_decoder, 4, graph_batch_sizes=BUCKETS, graph_frame_sizes=RAMP, ragged_steps=r)
        for r in (False, True)
    ]
    codes = {rid: stream_codes(ring_decoder, 13, i) for i, rid in enumerate("abc")}
    outs: list[dict[str, list[torch.Tensor]]] = [{r: [] for r in codes} for _ in sessions]
    plan = [[("a", 0, 1)], [("a", 1, 3), ("b", 0, 1)], [("a", 3, 9), ("b", 1, 3), ("c", 0, 2)]]
    for call in plan:
        for s, out in zip(sessions, outs):
            got = s.decode([ChunkRequest(r, codes[r][:, a:b]) for r, a, b in call])
            for r, res in got.items():
                out[r].append(res.audio)
    for r in codes:
        x, y = torch.cat(outs[0][r], -1), torch.cat(outs[1][r], -1)
        assert (x - y).abs().max().item() <= 1e-5 * x.abs().max().item(), r
    for slot in range(3):
        a, b = (s.pool.slot_state(slot) for s in sessions)
        assert torch.equal(a["layer_offsets"], b["layer_offsets"])
    per_size, ragged = (s.stats()["steps_by_path"]["eager"] for s in sessions)
    assert (per_size, ragged) == (1 + 2 + 2, 3)


def test_exact_ragged_steps_equal_offline_decode(ring_decoder):
    """Under exact ring semantics every stream of a ragged session equals its offline decode (1e-5): three
    streams of 17 frames start one call apart on the ramp 1, 2, 4, 6, 6, ..."""
    s = CodecStreamSession(
        ring_decoder, 4, graph_batch_sizes=BUCKETS, graph_frame_sizes=RAMP, ragged_steps=True, ring_semantics="exact"
    )
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


def test_plan_round_makes_one_packed_step_and_asks_the_graph_runner_with_the_real_frames(ring_decoder):
    """A ragged round is one ``StepBatch`` of the largest frame size; the graph runner is asked once with the
    rows' real frames and its key decides the packed length (a stand-in runner on CPU)."""
    s = CodecStreamSession(ring_decoder, 8, graph_batch_sizes=BUCKETS, graph_frame_sizes=RAMP, ragged_steps=True)
    asked = []

    class Graphs:
        n_vq = s.n_vq

        def select(self, rows, frames, total=None):
            asked.append((rows, frames, total))
            return (8, 6, 16) if total is not None and total <= 16 else (8, 6)

    s._steps.graphs = Graphs()
    pieces = {r: stream_codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 6), ("b", 1), ("c", 4), ("d", 2)])}
    steps = s._steps.plan_round({r: (slot, pieces[r]) for slot, r in enumerate(pieces)})
    assert len(steps) == 1 and asked == [(4, 6, 13)]
    (step,) = steps
    assert (step.request_ids, step.valid_frames, step.frames) == (("b", "d", "c", "a"), (1, 2, 4, 6), 6)
    assert (step.graph_key, step.packed_frames, step.padding_rows) == ((8, 6, 16), 16, 4)
    wide = s._steps.plan_round({r: (i, stream_codes(ring_decoder, 6, i)) for i, r in enumerate("wxyz")})
    assert wide[0].graph_key == (8, 6) and wide[0].packed_frames is None  # 24 real frames: the grid graph
    s._steps.graphs = None
    s.close()


def test_without_graph_sizes_a_ragged_step_packs_exactly_its_real_frames(ring_decoder, monkeypatch):
    s = CodecStreamSession(ring_decoder, 4, max_step_frames=8, ragged_steps=True)
    packed: list[int | None] = []
    steps = count_steps(s, monkeypatch, packed)
    got = s.decode([ChunkRequest(r, stream_codes(ring_decoder, n, i)) for i, (r, n) in enumerate([("a", 7), ("b", 2)])])
    assert steps == [(2, 7)] and packed == [9] and s.stats()["padded_frames"] == 0
    for i, (r, n) in enumerate([("a", 7), ("b", 2)]):
        ref = ring_decoder.decode(stream_codes(ring_decoder, n, i)[:, None], chunk_frames=[n])[0]
        assert (got[r].audio - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


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
    audio, lengths = decode_batch(pool, *args, total_frames=3)
    grid, _ = decode_batch(make_fresh(ring_decoder), *args)
    assert lengths.tolist() == [3 * ring_decoder.config.samples_per_frame, 0]
    assert (audio - grid).abs().max().item() <= 1e-6 * grid.abs().max().item()


def make_fresh(decoder):
    pool = make_state_pool(decoder, "compact")
    pool.initialize(2)
    return pool


def test_session_options_refuse_a_ragged_steps_that_is_not_a_bool():
    with pytest.raises(ValueError) as err:
        SessionOptions(4, ragged_steps="yes")
    assert str(err.value) == "ragged_steps must be True or False, got 'yes'"
    assert SessionOptions(4, ragged_steps=True).ragged_steps is True


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


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
def test_ragged_streams_preempted_for_pages_resume_exactly(ring_decoder):
    """A paged pool with pages for about two full streams of three: ragged steps preempt and restore streams as
    per-size steps do, and every stream's audio equals its solo decode."""
    s = CodecStreamSession(
        ring_decoder, 3, pool_kind="paged", page_fraction=0.67, graph_batch_sizes=(1, 2, 4), graph_frame_sizes=RAMP,
        ragged_steps=True,
    )  # fmt: skip
    names, schedule = "abcd", [1, 2, 4, 6, 6]
    codes = {r: stream_codes(ring_decoder, sum(schedule), i) for i, r in enumerate(names)}
    audio: dict[str, list[torch.Tensor]] = {r: [] for r in names}
    for call, n in enumerate(schedule):
        start = sum(schedule[:call])
        batch = [ChunkRequest(r, codes[r][:, start : start + n], call == len(schedule) - 1) for r in names]
        for r, res in s.decode(batch).items():
            assert res.error is None, res.error
            audio[r].append(res.audio)
    while s.waiting_requests:  # drain what is still queued
        for r, res in s.decode([]).items():
            audio[r].append(res.audio)
    assert s.stats()["preemptions"] > 0 and s.free_slots == 3
    for r in names:
        assert_close_to_solo(torch.cat(audio[r], -1), solo_decode(ring_decoder, codes[r], schedule), r)


def test_a_failed_step_whose_streams_alone_had_later_pieces_ends_the_call_cleanly(ring_decoder, monkeypatch):
    """Steps of two rows (buckets 1, 2): round 0 is (a, b) then (c); c alone has a second piece. c's step raises:
    c alone gets the error, the next round has no piece left and takes no step, and a and b equal their solo
    decodes, in this call and the next."""
    s = CodecStreamSession(ring_decoder, 4, graph_batch_sizes=(1, 2), max_step_frames=4, ragged_steps=True)
    codes = {r: stream_codes(ring_decoder, n, i) for i, (r, n) in enumerate([("a", 3), ("b", 3), ("c", 6)])}
    real, tried = s._steps.eager_step, []

    def step(codes, lengths, slot_ids, valid, **kwargs):
        tried.append(codes.shape[1])
        if len(tried) == 2:
            raise RuntimeError("injected failure in step 2")
        return real(codes, lengths, slot_ids, valid, **kwargs)

    monkeypatch.setattr(s._steps, "eager_step", step)
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


def test_full_rows_short_of_their_bucket_pack_to_the_packed_graph_a_gpu_replays(ring_decoder, monkeypatch):
    """Five streams of 6 frames (bucket 8, ramp 1, 2, 4, 6): 30 real frames, which the packed graph of 32 frames
    holds (the grid graph is 48): a GPU's runner selects it (``StreamingGraphRunner.select``, its capture stood in
    by its keys), and a CPU step packs to the same 32 frames; each stream's audio is its solo decode."""
    from types import SimpleNamespace

    from vllm_omni_moss.model_executor.models.moss_tts.cuda_graph import StreamingGraphRunner

    keys = [(b, t) for b in BUCKETS for t in RAMP] + [(b, 6, n) for b in BUCKETS for n in packed_totals(b, [*RAMP])]
    gpu = SimpleNamespace(batch_sizes=[*BUCKETS], frame_sizes=[*RAMP], graphs=dict.fromkeys(keys))
    assert StreamingGraphRunner.select(gpu, 5, 6, 30) == (8, 6, 32)
    s = CodecStreamSession(ring_decoder, 8, graph_batch_sizes=BUCKETS, graph_frame_sizes=RAMP, ragged_steps=True)
    codes = {r: stream_codes(ring_decoder, 6, i) for i, r in enumerate("abcde")}
    packed: list[int | None] = []
    steps = count_steps(s, monkeypatch, packed)
    got = s.decode([ChunkRequest(r, c) for r, c in codes.items()])
    assert steps == [(5, 6)] and packed == [32] and s.stats()["padded_frames"] == 2
    for r, c in codes.items():
        assert_close_to_solo(got[r].audio, solo_decode(ring_decoder, c, [6]), r)


def test_the_graph_runner_takes_a_packed_graph_by_the_rows_real_frames_even_without_its_grid_graph():
    """``StreamingGraphRunner.select`` on the keys a runner of buckets (2, 4) and frame sizes (1, 2, 4) captures:
    a step at the largest frame size takes the smallest packed graph holding its real frames, else the grid
    graph; a packed graph still serves when its bucket's grid graph failed to capture."""
    import functools
    from types import SimpleNamespace

    from vllm_omni_moss.model_executor.models.moss_tts.cuda_graph import StreamingGraphRunner

    keys = [(4, 4), (4, 4, 8), (4, 2), (4, 1), (2, 4), (2, 4, 4), (2, 2), (2, 1)]
    runner = SimpleNamespace(batch_sizes=[2, 4], frame_sizes=[1, 2, 4], graphs=dict.fromkeys(keys))
    select = functools.partial(StreamingGraphRunner.select, runner)
    assert [select(3, 4, 7), select(3, 4, 8), select(3, 4, 9), select(3, 4)] == [(4, 4, 8), (4, 4, 8), (4, 4), (4, 4)]
    assert [select(3, 2, 5), select(2, 3, 4), select(1, 4, 5), select(5, 1, 5)] == [(4, 2), (2, 4, 4), (2, 4), None]
    del runner.graphs[(4, 4)]
    assert [select(3, 4, 7), select(3, 4, 9)] == [(4, 4, 8), None]
