# SPDX-License-Identifier: Apache-2.0
"""CodecStreamSession: grouping, slots, terminal/abort lifecycle, late chunks, coalescing, clamping.

Every request's audio is compared with its solo fixed-width reference decode
``decoder.decode(codes[:, None], chunk_frames=<the chunk sizes it was fed>)``.
"""

from __future__ import annotations

import pytest
import torch
from moss_codecs import random_codes

from vllm_omni_moss.model_executor.models.moss_tts.session import ChunkRequest, ChunkResult, CodecStreamSession

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def _codes(decoder, frames: int, seed: int) -> torch.Tensor:
    return random_codes(decoder, 1, frames, seed)[:, 0]  # (n_vq, T)


def _solo(decoder, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Reference: ``(channels, T * spf)`` of one stream fed in chunks of ``schedule`` frames."""
    assert sum(schedule) == codes.shape[1]
    return decoder.decode(codes[:, None], chunk_frames=schedule)[0]


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"{what}: max error {err}"


def _count_steps(session, monkeypatch) -> list[tuple[int, int]]:
    """Record ``(B, T)`` of every pool step."""
    steps = []
    real = session.pool.decode_streaming_batch

    def spy(codes, lengths, slot_ids, valid):
        steps.append((codes.shape[1], codes.shape[2]))
        return real(codes, lengths, slot_ids, valid)

    monkeypatch.setattr(session.pool, "decode_streaming_batch", spy)
    return steps


class _Driver:
    """Feeds whole code sequences to a session in scripted chunks and keeps the audio."""

    def __init__(self, session, decoder):
        self.session, self.decoder = session, decoder
        self.codes: dict[str, torch.Tensor] = {}
        self.pos: dict[str, int] = {}
        self.schedule: dict[str, list[int]] = {}
        self.audio: dict[str, list[torch.Tensor]] = {}

    def add(self, rid: str, frames: int, seed: int) -> None:
        self.codes[rid] = _codes(self.decoder, frames, seed)
        self.pos[rid], self.schedule[rid], self.audio[rid] = 0, [], []

    def step(self, chunks: list[tuple[str, int, bool]]) -> dict[str, ChunkResult]:
        reqs = []
        for rid, T, finished in chunks:
            p = self.pos[rid]
            reqs.append(ChunkRequest(rid, self.codes[rid][:, p : p + T], finished))
            self.pos[rid] = p + T
            step = self.session.max_step_frames
            self.schedule[rid] += [min(step, T - k) for k in range(0, T, step)]  # the session splits long chunks
        out = self.session.decode(reqs)
        assert set(out) == {rid for rid, _, _ in chunks}
        for rid, T, _ in chunks:
            res = out[rid]
            assert res.frames == T and res.sample_rate == self.decoder.config.sampling_rate
            assert res.audio.shape == (self.decoder.config.number_channels, T * self.decoder.config.samples_per_frame)
            self.audio[rid].append(res.audio)
        return out

    def check(self, rid: str) -> None:
        assert self.pos[rid] == self.codes[rid].shape[1], f"{rid} not fully fed"
        got = torch.cat(self.audio[rid], dim=-1)
        _close(got, _solo(self.decoder, self.codes[rid], self.schedule[rid]), rid)


# ----------------------------------------------------------------------------- parity and grouping


@pytest.mark.parametrize("kind", ["v2", "legacy"])
def test_mixed_batches_equal_solo_decodes(kind, ring_decoder, monkeypatch):
    """Staggered starts, distinct T per step (one pool step per T), a long chunk split
    into steps, terminals mid-script: each request gets exactly its solo decode."""
    s = CodecStreamSession(ring_decoder, 4, pool_kind=kind, max_step_frames=3)
    steps = _count_steps(s, monkeypatch)
    d = _Driver(s, ring_decoder)
    for rid, frames, seed in (("a", 14, 1), ("b", 9, 2), ("c", 6, 3), ("d", 4, 4)):
        d.add(rid, frames, seed)
    d.step([("a", 1, False)])
    d.step([("a", 3, False), ("b", 1, False), ("c", 1, False)])
    assert steps[-2:] == [(2, 1), (1, 3)]  # grouped by T, ascending
    d.step([("a", 3, False), ("b", 3, False), ("c", 2, False), ("d", 1, False)])
    d.step([("a", 5, False), ("b", 2, False), ("c", 3, True), ("d", 3, True)])  # a: split 3 + 2
    assert s.free_slots == 2 and set(s.live_requests) == {"a", "b"}
    d.step([("b", 3, True), ("a", 0, False)])
    d.step([("a", 2, True)])
    assert s.free_slots == 4 and not s.live_requests
    for rid in "abcd":
        d.check(rid)
    assert d.schedule["a"] == [1, 3, 3, 3, 2, 2]
    assert (1, 3) in steps and (1, 2) in steps


def test_long_chunk_split_matches_split_reference(ring_decoder, monkeypatch):
    s = CodecStreamSession(ring_decoder, 2, max_step_frames=2)
    steps = _count_steps(s, monkeypatch)
    codes = _codes(ring_decoder, 7, seed=9)
    out = s.decode([ChunkRequest("x", codes, True)])["x"]
    assert steps == [(1, 2), (1, 2), (1, 2), (1, 1)]
    _close(out.audio, _solo(ring_decoder, codes, [2, 2, 2, 1]), "x")
    assert out.frames == 7 and s.free_slots == 2


def test_v1_codec_legacy_pool_equals_solo(ring_decoder_v1):
    s = CodecStreamSession(ring_decoder_v1, 3)
    assert s.pool.kind == "legacy"
    d = _Driver(s, ring_decoder_v1)
    d.add("a", 9, 5)
    d.add("b", 5, 6)
    d.step([("a", 1, False), ("b", 1, False)])
    d.step([("a", 4, False), ("b", 4, True)])
    d.step([("a", 4, True)])
    d.check("a")
    d.check("b")


def test_tiny_presets_equal_solo(tiny_decoder):
    s = CodecStreamSession(tiny_decoder, 2)
    d = _Driver(s, tiny_decoder)
    d.add("a", 4, 1)
    d.add("b", 3, 2)
    d.step([("a", 1, False), ("b", 1, False)])
    d.step([("a", 3, True), ("b", 2, True)])
    d.check("a")
    d.check("b")


# ----------------------------------------------------------------------------- slots and lifecycle


def test_slots_are_lifo(ring_decoder):
    s = CodecStreamSession(ring_decoder, 4)
    one = {rid: ChunkRequest(rid, _codes(ring_decoder, 1, i)) for i, rid in enumerate("abc")}
    s.decode(list(one.values()))
    assert s.live_requests == {"a": 0, "b": 1, "c": 2}
    s.decode([ChunkRequest("b", _codes(ring_decoder, 1, 7), True)])
    s.decode([ChunkRequest("d", _codes(ring_decoder, 1, 8))])
    assert s.live_requests["d"] == 1  # the slot released last is leased first
    s.on_requests_finished(["a"])
    s.on_requests_finished(["c"])
    s.decode([ChunkRequest("e", _codes(ring_decoder, 1, 9)), ChunkRequest("f", _codes(ring_decoder, 1, 10))])
    assert s.live_requests["e"] == 2 and s.live_requests["f"] == 0


def _assert_slot_clear(session, slot):
    state = session.pool.slot_state(slot)
    assert int(state["layer_offsets"].abs().sum()) == 0
    assert all(torch.count_nonzero(r) == 0 for r in state["rings"])


@pytest.mark.parametrize("meta_only", [False, True])
def test_terminal_chunk_resets_and_releases(meta_only, ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 1))])
    slot = s.live_requests["a"]
    last = _codes(ring_decoder, 0 if meta_only else 2, 2)
    out = s.decode([ChunkRequest("a", last, True)])["a"]
    assert out.frames == last.shape[1]
    assert s.free_slots == 2 and "a" not in s.live_requests
    assert s.ended_state("a") == "finished"
    _assert_slot_clear(s, slot)


def test_abort_releases_and_late_chunks_are_dropped(ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 1)), ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    slot = s.live_requests["a"]
    s.on_requests_finished({"a", "never-seen"})
    assert s.free_slots == 1 and s.live_requests == {"b": 1}
    _assert_slot_clear(s, slot)
    assert s.ended_state("a") == "aborted" and s.ended_state("never-seen") == "aborted"

    late = s.decode(
        [ChunkRequest("a", _codes(ring_decoder, 3, 3)), ChunkRequest("never-seen", _codes(ring_decoder, 1, 4))]
    )
    assert all(r.frames == 0 and r.audio.shape == (1, 0) for r in late.values())
    assert s.free_slots == 1 and "a" not in s.live_requests
    _assert_slot_clear(s, slot)
    # The aborted stream's terminal payload drains it; after that the id may be reused.
    assert s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 5), True)])["a"].frames == 0
    assert s.ended_state("a") is None and s.free_slots == 1
    fresh = _codes(ring_decoder, 3, 6)
    out = s.decode([ChunkRequest("a", fresh, True)])["a"]
    _close(out.audio, _solo(ring_decoder, fresh, [3]), "reused after abort")
    s.on_requests_finished(["b", "b"])
    assert s.free_slots == 2


def test_reused_id_after_finish_starts_fresh(ring_decoder):
    s = CodecStreamSession(ring_decoder, 1)
    s.decode(
        [
            ChunkRequest("a", _codes(ring_decoder, 3, 1)),
        ]
    )
    s.decode([ChunkRequest("a", _codes(ring_decoder, 2, 2), True)])
    s.on_requests_finished(["a"])  # the runner reports normal completions too
    assert s.ended_state("a") == "finished"
    # A duplicate meta-only terminal is late: no slot, nothing decoded.
    assert s.decode([ChunkRequest("a", _codes(ring_decoder, 0, 3), True)])["a"].frames == 0
    assert s.free_slots == 1
    # New codes under a finished id can only be a new stream.
    fresh = _codes(ring_decoder, 4, 4)
    d1 = s.decode([ChunkRequest("a", fresh[:, :1])])["a"]
    d2 = s.decode([ChunkRequest("a", fresh[:, 1:], True)])["a"]
    _close(torch.cat([d1.audio, d2.audio], -1), _solo(ring_decoder, fresh, [1, 3]), "reused id")


def test_ended_memory_is_bounded(ring_decoder):
    s = CodecStreamSession(ring_decoder, 1, ended_memory=2)
    s.on_requests_finished(["x", "y", "z"])
    assert s.ended_state("x") is None and s.ended_state("y") == s.ended_state("z") == "aborted"


def test_capacity_exhaustion_is_atomic_and_explains_admission(ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 1)), ChunkRequest("b", _codes(ring_decoder, 1, 2))])
    before = [t.clone() for t in s.pool.rings]
    with pytest.raises(RuntimeError, match=r"admission must count idle live streams against max_num_seqs=2"):
        s.decode([ChunkRequest("a", _codes(ring_decoder, 1, 3)), ChunkRequest("c", _codes(ring_decoder, 1, 4))])
    assert s.live_requests == {"a": 0, "b": 1}
    assert all(torch.equal(x, y) for x, y in zip(before, s.pool.rings))


def test_bad_batches_raise(ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    c = _codes(ring_decoder, 1, 1)
    with pytest.raises(ValueError, match="appears twice"):
        s.decode([ChunkRequest("a", c), ChunkRequest("a", c)])
    with pytest.raises(ValueError, match=r"codes must be \(2, T\)"):
        s.decode([ChunkRequest("a", c[:1])])
    with pytest.raises(ValueError, match=r"codes must be signed integers \(or uint8\), got torch.float32"):
        s.decode([ChunkRequest("a", c.float())])
    assert not s.live_requests
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.decode([ChunkRequest("a", c)])


# ----------------------------------------------------------------------------- coalescing and clamping


def _coalescing_script(session, decoder, monkeypatch):
    steps = _count_steps(session, monkeypatch)
    d = _Driver(session, decoder)
    d.add("a", 4, 1)
    d.add("b", 3, 2)
    d.step([("a", 1, False), ("b", 1, False)])
    steps.clear()
    d.step([("a", 3, True), ("b", 2, True)])
    # b ends at 1 + 3 padded frames <= the 5-token ring of the first group: padding
    # evicts nothing b's queries read, so b still equals its solo decode.
    d.check("a")
    d.check("b")
    return steps


def test_terminal_tails_coalesce_onto_graph_frames(ring_decoder, monkeypatch):
    s = CodecStreamSession(ring_decoder, 4, graph_batch_sizes=(1, 2, 4), graph_frames=(1, 3), coalesce_tails=True)
    assert s.coalesce_tails and s.runner is None  # CPU: graphs never captured, steps still merged
    assert _coalescing_script(s, ring_decoder, monkeypatch) == [(2, 3)]
    assert s.free_slots == 4
    _assert_slot_clear(s, 0)
    _assert_slot_clear(s, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"graph_batch_sizes": (1, 2), "graph_frames": (1, 3), "coalesce_tails": True},  # largest bucket < capacity
        {"graph_batch_sizes": (1, 2, 4), "graph_frames": (1, 3)},  # off by default: padding changes tail audio
        {},
    ],
)
def test_tails_stay_apart_when_coalescing_is_not_allowed(kwargs, ring_decoder, monkeypatch):
    s = CodecStreamSession(ring_decoder, 4, **kwargs)
    assert not s.coalesce_tails
    assert sorted(_coalescing_script(s, ring_decoder, monkeypatch)) == [(1, 2), (1, 3)]


def test_out_of_range_codes_are_clamped_and_counted(ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    K = ring_decoder.config.codebook_size
    codes = _codes(ring_decoder, 3, 1)
    raw = codes.clone()
    raw[0, 0], raw[1, 2], raw[0, 1] = K, -1, K + 7
    out = s.decode([ChunkRequest("a", raw, True)])["a"]
    assert s.clamped_codes == 3
    _close(out.audio, _solo(ring_decoder, raw.clamp(0, K - 1), [3]), "clamped")
    assert torch.equal(raw[0, 0], torch.tensor(K))  # the caller's tensor is not modified


def test_request_ids_must_be_strings_and_generators_are_consumed_once(ring_decoder):
    s = CodecStreamSession(ring_decoder, 2)
    codes = random_codes(ring_decoder, 1, 2, seed=1)[:, 0]
    for bad in (7, None, ""):
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            s.decode([ChunkRequest(bad, codes)])
    assert s.free_slots == 2 and not s.live_requests
    with pytest.raises(TypeError, match="requests must be a sequence of ChunkRequest, got ChunkRequest"):
        s.decode(ChunkRequest("a", codes))
    got = s.decode(r for r in [ChunkRequest("a", codes), ChunkRequest("b", codes, finished=True)])
    assert sorted(got) == ["a", "b"] and got["a"].frames == 2 and got["b"].frames == 2
    assert set(s.live_requests) == {"a"}


def test_default_tails_keep_their_own_length(ring_decoder, monkeypatch):
    """Buckets cover the capacity and graph frames are (1, 3): upstream would pad the
    2-frame tail to 3 frames. By default it is decoded at T=2 and equals its solo decode."""
    s = CodecStreamSession(ring_decoder, 2, graph_batch_sizes=(1, 2), graph_frames=(1, 3))
    assert not s.coalesce_tails
    steps = _count_steps(s, monkeypatch)
    d = _Driver(s, ring_decoder)
    d.add("a", 6, 5)
    d.step([("a", 1, False)])
    d.step([("a", 3, False)])
    d.step([("a", 2, True)])
    assert steps[-1] == (1, 2)
    d.check("a")
