# SPDX-License-Identifier: Apache-2.0
"""The paged pool (state_pool.PagedDecoderStatePool) against the compact pool it must equal bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from moss_codecs import random_codes

from vllm_omni_moss.model_executor.models.moss_tts.session import ChunkRequest, CodecStreamSession
from vllm_omni_moss.model_executor.models.moss_tts.state_pool import (
    PagedDecoderStatePool,
    PagesExhausted,
    make_state_pool,
)

CAPACITY = 3


def _pools(decoder, **paged):
    compact = make_state_pool(decoder, "compact", attention_backend="triton")
    compact.initialize(CAPACITY)
    pool = PagedDecoderStatePool(decoder, **paged)
    pool.initialize(CAPACITY)
    for p in (compact, pool):
        assert [p.acquire() for _ in range(CAPACITY)] == [0, 1, 2]
    return compact, pool


def _step(pool, codes, lengths, slots):
    B = codes.shape[1]
    return pool.decode_streaming_batch(
        codes, torch.tensor(lengths), torch.tensor(slots), torch.ones(B, dtype=torch.bool)
    )


def _assert_same_state(compact, pool, slot, paged_slot=None):
    a, b = compact.slot_state(slot), pool.slot_state(slot if paged_slot is None else paged_slot)
    assert torch.equal(a["layer_offsets"], b["layer_offsets"])
    for layer, (x, y) in enumerate(zip(a["rings"], b["rings"])):
        assert torch.equal(x, y), f"slot {slot} layer {layer}"


def _held_pages(pool, slot):
    return [len(tables[slot]) for tables in pool._host_tables]


def test_paged_pool_equals_the_compact_pool_step_by_step(ring_decoder):
    """Random steps (mixed lengths, rows of length 0, rings filling and wrapping, a release and a new
    stream): audio, ring contents and offsets bitwise the compact pool's; pages follow each context."""
    compact, pool = _pools(ring_decoder)
    assert pool.page_size == 5  # gcd of the windows 5 and 10
    rng = random.Random(3)
    frames = [0] * CAPACITY
    for step in range(12):
        B = rng.randint(1, CAPACITY)
        T = rng.randint(1, 7)
        slots = rng.sample(range(CAPACITY), B)
        lengths = [rng.randint(0, T) for _ in range(B)]
        codes = random_codes(ring_decoder, B, T, seed=step)
        assert torch.equal(_step(compact, codes, lengths, slots)[0], _step(pool, codes, lengths, slots)[0]), step
        for s, n in zip(slots, lengths):
            frames[s] += n
        if step == 6:
            for p in (compact, pool):
                p.release([1])
                assert p.acquire() == 1
            frames[1] = 0
        for s in range(CAPACITY):
            _assert_same_state(compact, pool, s)
            want = [min(-(-frames[s] * g.tokens_per_frame // 5), g.context // 5) for g in ring_decoder.config.groups]
            assert _held_pages(pool, s) == want, (step, s)
    for table in pool.page_tables:
        assert table.shape[0] == pool.num_slots
    assert all(bool((ring[:, 0] == 0).all()) for ring in pool.rings), "the null page was written"


def test_release_zeroes_and_frees_pages_and_save_restore_is_exact(ring_decoder):
    compact, pool = _pools(ring_decoder)
    full = pool.free_page_counts()
    codes = random_codes(ring_decoder, 2, 7, seed=1)
    for p in (compact, pool):
        _step(p, codes, [7, 3], [0, 2])
    saved = pool.save_slot(0)
    pool.release([0, 2])
    assert pool.free_page_counts() == full == [CAPACITY * g.context // 5 for g in ring_decoder.config.groups]
    assert all(bool((ring == 0).all()) for ring in pool.rings)
    slot = pool.acquire()
    assert slot == 2  # LIFO
    pool.restore_slot(slot, saved)
    _assert_same_state(compact, pool, 0, slot)
    more = random_codes(ring_decoder, 1, 4, seed=2)
    assert torch.equal(_step(compact, more, [4], [0])[0], _step(pool, more, [4], [slot])[0])
    with pytest.raises(ValueError, match="the state's pool kind is 'paged'; this pool's is 'compact'"):
        compact.restore_slot(1, saved)


def test_a_step_short_of_pages_fails_before_anything_changes(ring_decoder):
    pool = PagedDecoderStatePool(ring_decoder, page_fraction=0.2)  # one slot's worth of pages per group
    pool.initialize(CAPACITY)
    for _ in range(CAPACITY):
        pool.acquire()
    assert pool.free_page_counts() == [1, 2]
    _step(pool, random_codes(ring_decoder, 1, 7, seed=1), [7], [0])  # slot 0 takes every page
    before = ([t.clone() for t in pool.page_tables], [r.clone() for r in pool.rings], pool.free_page_counts())
    with pytest.raises(PagesExhausted, match=r"group 0 needs 1 more pages of 5 tokens for slots \[1\]; 0 are free"):
        _step(pool, random_codes(ring_decoder, 2, 1, seed=2), [1, 1], [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(before[0], pool.page_tables))
    assert all(torch.equal(a, b) for a, b in zip(before[1], pool.rings))
    assert pool.free_page_counts() == before[2]
    assert pool.slot_state(1)["layer_offsets"].eq(0).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(attention_backend="sdpa"), "the paged pool needs attention_backend 'triton'"),
        (dict(page_size=4), r"page_size 4 must divide every group's window; it does not divide \[5, 10\]"),
        (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
        (dict(page_fraction=0.0), r"page_fraction must be in \(0, 1\], got 0.0"),
    ],
)
def test_bad_paged_pools_are_refused(kwargs, message, ring_decoder):
    with pytest.raises(ValueError, match=message):
        PagedDecoderStatePool(ring_decoder, **kwargs)


def test_a_session_on_a_paged_pool_decodes_as_on_a_compact_pool(ring_decoder):
    sessions = [
        CodecStreamSession(ring_decoder, 2, pool_kind=k, attention_backend="triton") for k in ("compact", "paged")
    ]
    rng = random.Random(5)
    for call in range(6):
        batch = [
            ChunkRequest(r, random_codes(ring_decoder, 1, rng.randint(1, 6), seed=10 * call + i)[:, 0], call == 5)
            for i, r in enumerate("ab")
        ]
        a, b = (s.decode(batch) for s in sessions)
        for r in "ab":
            assert torch.equal(a[r].audio, b[r].audio), (call, r)
    assert sessions[1].pool.free_page_counts() == [2 * g.context // 5 for g in ring_decoder.config.groups]


def _solo(decoder, codes, schedule):
    return decoder.decode(codes[:, None], chunk_frames=schedule)[0]


def test_streams_preempted_for_pages_resume_exactly(ring_decoder):
    """Three slots but pages for about two full streams: the youngest live stream is preempted
    (state saved to the host, pages freed) when the others need pages, waits ahead of new streams,
    and resumes exactly: every stream's audio equals its solo decode, nothing leaks."""
    session = CodecStreamSession(ring_decoder, 3, pool_kind="paged", page_fraction=0.67)
    pool = session.pool
    assert pool.free_page_counts() == [3, 5]  # 2 and 4 pages per full stream
    rng = random.Random(7)
    names = ["a", "b", "c", "d"]
    schedules = {r: [rng.randint(1, 4) for _ in range(5)] for r in names}
    codes = {r: random_codes(ring_decoder, 1, sum(s), seed=i)[:, 0] for i, (r, s) in enumerate(schedules.items())}
    audio = {r: [] for r in names}
    for call in range(5):
        batch = []
        for r in names:
            start = sum(schedules[r][:call])
            batch.append(ChunkRequest(r, codes[r][:, start : start + schedules[r][call]], call == 4))
        for r, res in session.decode(batch).items():
            assert res.error is None, res.error
            audio[r].append(res.audio)
    while session.waiting_requests:  # drain what is still queued
        for r, res in session.decode([]).items():
            audio[r].append(res.audio)
    stats = session.stats()
    assert stats["preemptions"] > 0
    for r in names:
        got, want = torch.cat(audio[r], -1), _solo(ring_decoder, codes[r], schedules[r])
        # Within GEMM rounding of other batch shapes (1e-5 of the peak, as the session's own tests).
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), r
    assert session.live_requests == {} and session.free_slots == 3
    assert pool.free_page_counts() == [3, 5]
