# SPDX-License-Identifier: Apache-2.0
"""Packed tokens (``token_packing.py``, ``step.decode_tensors`` on ``(n_vq, F)`` packed codes): every step is
packed, its rows' valid frames one after another, then dummy frames up to its shape's packed total; the dummies
change neither the rows' audio nor any slot's state."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import make_state_pool, needs_interpreter, random_codes

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_tensors
from vllm_omni_moss.model_executor.models.moss_tts.token_packing import TokenPacking, pack_codes, unpack_audio

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

#: Valid frames of 4 rows in 5 steps of T = 6: empty rows, full rows, one frame, mixed.
STEPS = [[1, 6, 2, 0], [6, 6, 4, 1], [3, 1, 6, 6], [2, 0, 2, 2], [6, 5, 1, 4]]


def test_packing_places_each_real_token_of_each_level_and_sends_dummies_to_the_dump_row():
    config = preset_config("tiny-v2")
    packing = TokenPacking.of(config, torch.tensor([2, 0, 1]), frames=3, total_frames=5)
    rates = [g.tokens_per_frame for g in config.groups]
    assert packing.tokens_per_frame == (*rates, rates[-1] * config.groups[-1].upsample)
    # Frames: row 0 at grid frames 0 and 1, row 2 at grid frame 6 (= 2 x T), then two dummies.
    assert packing.grid[0].tolist() == [0, 1, 6, 9, 9] and packing.read[0].tolist() == [0, 1, 6, 0, 0]
    f = packing.tokens_per_frame[1]
    want = [t * f + k for t in (0, 1, 6) for k in range(f)] + [9 * f] * (2 * f)
    assert packing.grid[1].tolist() == want
    x = torch.arange(3 * 3 * f, dtype=torch.float32).view(3, 3 * f, 1)
    back = packing.to_rows(1, packing.to_tokens(1, x))
    keep = torch.zeros(3, 3 * f, 1, dtype=torch.bool)
    keep[0, : 2 * f], keep[2, :f] = True, True
    assert torch.equal(back, torch.where(keep, x, 0.0))  # real tokens round-trip, the rest is zero


def test_packing_refuses_fewer_frames_than_the_rows_hold():
    with pytest.raises(RuntimeError):
        TokenPacking.of(preset_config("tiny-v2"), torch.tensor([2, 3]), frames=3, total_frames=4)


def test_pack_codes_and_unpack_audio_place_each_rows_frames():
    """``pack_codes``: each row's valid frames in row order, then code 0 for the dummies; ``unpack_audio``: each
    row's samples back in its grid row, zero after its valid frames (and for a row of none)."""
    codes = (torch.arange(9) + 10).view(1, 3, 3)  # row b, frame t: 10 + 3 b + t
    valid_frames = torch.tensor([2, 0, 1])
    assert pack_codes(codes, valid_frames, 5).tolist() == [[10, 11, 16, 0, 0]]
    assert pack_codes(codes, valid_frames, 3).tolist() == [[10, 11, 16]]
    audio = torch.arange(10, dtype=torch.float32).view(1, 10) + 1  # 5 packed frames of 2 samples
    rows = unpack_audio(audio, valid_frames, 3, 2)
    assert rows.shape == (3, 1, 6)
    assert rows.tolist() == [[[1, 2, 3, 4, 0, 0]], [[0] * 6], [[5, 6, 0, 0, 0, 0]]]


def _step(pool, codes, valid_frames, slots, valid, total):
    """One packed step of ``pool`` on the ``(n_vq, R, T)`` grid ``codes`` packed into ``total`` frames; returns the
    rows' ``(R, channels, T x spf)`` audio."""
    masked = torch.where(valid, valid_frames, 0)
    T = codes.shape[-1]
    audio = decode_tensors(pool, pack_codes(codes, masked, total), valid_frames, slots, valid, T)
    assert audio.shape == (pool.config.number_channels, total * pool.config.samples_per_frame)
    return unpack_audio(audio, masked, T, pool.config.samples_per_frame)


def _assert_same_state(a_pool, b_pool, slots: int) -> None:
    for slot in range(slots):
        a, b = a_pool.slot_state(slot), b_pool.slot_state(slot)
        assert torch.equal(a["layer_offsets"], b["layer_offsets"])
        assert all(torch.equal(x, y) for x, y in zip(a["rings"], b["rings"])), slot


@pytest.mark.parametrize("kind", ["compact", "legacy"])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_dummy_frames_change_neither_audio_nor_state(kind, ring_semantics, ring_decoder):
    """Five packed steps (empty rows, a padding row every other step) through two pools, one packed to exactly
    its real frames, the other with 2 dummy frames more (as a step padded to its ladder total): the audio and
    every slot's rings and offsets are equal bit for bit on a CPU."""
    exact, padded = (make_state_pool(ring_decoder, kind, ring_semantics=ring_semantics) for _ in range(2))
    for pool in (exact, padded):
        pool.initialize(4, 4)
    slots = torch.arange(4)
    for step, frames in enumerate(STEPS):
        valid_frames = torch.tensor(frames)
        valid = torch.tensor([True, True, True, step % 2 == 0])
        codes = random_codes(ring_decoder, 4, 6, seed=step)
        real = int(valid_frames[valid].sum())
        want = _step(exact, codes, valid_frames, slots, valid, real)
        got = _step(padded, codes, valid_frames, slots, valid, real + 2)
        assert torch.equal(got, want), step
        assert want.abs().amax(dim=(1, 2)).gt(0).tolist() == (valid_frames.gt(0) & valid).tolist(), step
    _assert_same_state(exact, padded, 4)


@needs_interpreter
@pytest.mark.parametrize("kind", ["compact", "paged"])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_the_triton_attention_reads_packed_tokens_in_place(kind, ring_semantics, ring_decoder):
    """The triton backend attends the packed tokens in place (``ring_attention_write_packed``, no copy into the
    grid and back): under the interpreter every layer's attention takes the packed path and nothing goes through
    the grid (``TokenPacking.to_rows``); steps with 2 dummy frames equal those packed to exactly their real
    frames bit for bit, audio and state, and equal the compact pool's sdpa reference (attention in the grid)."""
    from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention_packed

    exact, padded = (
        make_state_pool(ring_decoder, kind, ring_semantics=ring_semantics, attention_backend="triton") for _ in range(2)
    )
    grid = make_state_pool(ring_decoder, "compact", ring_semantics=ring_semantics, attention_backend="sdpa")
    for pool in (exact, padded, grid):
        pool.initialize(4, 4)
        for _ in range(4):
            pool.acquire()
        if pool.kind == "paged":
            pool.reserve(dict.fromkeys(range(4), 64), strict=True)
            pool.commit_page_tables()
    calls, to_rows = [], []
    real_op, real_to_rows = ring_attention_packed.ring_attention_write_packed, TokenPacking.to_rows
    slots = torch.arange(4)
    layers = sum(len(g.layers) for g in ring_decoder.groups)
    for step, frames in enumerate(STEPS):
        valid_frames = torch.tensor(frames)
        valid = torch.tensor([True, True, True, step % 2 == 0])
        codes = random_codes(ring_decoder, 4, 6, seed=step)
        real = int(valid_frames[valid].sum())
        reference = _step(grid, codes, valid_frames, slots, valid, real)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TokenPacking, "to_rows", lambda self, *a: to_rows.append(a[0]) or real_to_rows(self, *a))
            mp.setattr(
                "vllm_omni_moss.model_executor.models.moss_tts.attention.ring_attention_write_packed",
                lambda *a, **k: calls.append(1) or real_op(*a, **k),
            )
            want = _step(exact, codes, valid_frames, slots, valid, real)
            got = _step(padded, codes, valid_frames, slots, valid, real + 2)
        assert torch.equal(got, want), step
        err = (got - reference).abs().max().item()
        assert err <= 1e-5 * reference.abs().max().item(), (step, err)
    assert len(calls) == 2 * layers * len(STEPS)
    assert to_rows == []  # no level's tokens go back to the grid
    _assert_same_state(exact, padded, 4)
