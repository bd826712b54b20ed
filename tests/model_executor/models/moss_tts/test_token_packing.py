# SPDX-License-Identifier: Apache-2.0
"""Packed tokens (``token_packing.py``, ``step.decode_tensors(..., total_frames=...)``): the GEMMs of a ragged step
on its real tokens alone give the audio and the state of the ``B x T`` grid step."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import needs_interpreter, random_codes

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.state import make_state_pool
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_tensors
from vllm_omni_moss.model_executor.models.moss_tts.token_packing import TokenPacking

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


@pytest.mark.parametrize("kind", ["compact", "legacy"])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_packed_steps_give_the_grid_steps_audio_and_state(kind, ring_semantics, ring_decoder):
    """Five ragged steps (empty rows, a padding row every other step, 2 dummy frames) through two pools: the
    packed steps' audio and every slot's rings and offsets equal the grid steps' bit for bit on a CPU."""
    grid, packed = (make_state_pool(ring_decoder, kind, ring_semantics=ring_semantics) for _ in range(2))
    for pool in (grid, packed):
        pool.initialize(4, 4)
    slots = torch.arange(4)
    for step, frames in enumerate(STEPS):
        valid_frames = torch.tensor(frames)
        valid = torch.tensor([True, True, True, step % 2 == 0])
        codes = random_codes(ring_decoder, 4, 6, seed=step)
        want, want_lengths = decode_tensors(grid, codes, valid_frames, slots, valid)
        real = int(valid_frames[valid].sum())
        got, got_lengths = decode_tensors(packed, codes, valid_frames, slots, valid, total_frames=real + 2)
        assert torch.equal(got_lengths, want_lengths) and torch.equal(got, want), step
    for slot in range(4):
        a, b = grid.slot_state(slot), packed.slot_state(slot)
        assert torch.equal(a["layer_offsets"], b["layer_offsets"])
        assert all(torch.equal(x, y) for x, y in zip(a["rings"], b["rings"])), slot


@needs_interpreter
@pytest.mark.parametrize("kind", ["compact", "paged"])
@pytest.mark.parametrize("ring_semantics", ["upstream", "exact"])
def test_the_triton_attention_reads_packed_tokens_with_the_grid_steps_audio_and_state(
    kind, ring_semantics, ring_decoder
):
    """The triton backend attends the packed tokens in place (``ring_attention_write_packed``, no copy into the
    grid and back): under the interpreter the packed steps' audio and state equal the grid steps' bit for bit,
    every layer's attention takes the packed path, and no layer copies its projections into the grid."""
    from vllm_omni_moss.model_executor.models.moss_tts.ops import ring_attention_packed

    grid, packed = (
        make_state_pool(ring_decoder, kind, ring_semantics=ring_semantics, attention_backend="triton") for _ in range(2)
    )
    for pool in (grid, packed):
        pool.initialize(4, 4)
        for _ in range(4):
            pool.acquire()
        if kind == "paged":
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
        want, _ = decode_tensors(grid, codes, valid_frames, slots, valid)
        real = int(valid_frames[valid].sum())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TokenPacking, "to_rows", lambda self, *a: to_rows.append(a[0]) or real_to_rows(self, *a))
            mp.setattr(
                "vllm_omni_moss.model_executor.models.moss_tts.attention.ring_attention_write_packed",
                lambda *a, **k: calls.append(1) or real_op(*a, **k),
            )
            got, _ = decode_tensors(packed, codes, valid_frames, slots, valid, total_frames=real + 2)
        assert torch.equal(got, want), step
    assert len(calls) == layers * len(STEPS)
    assert set(to_rows) == {len(ring_decoder.groups)}  # only the audio head's tokens go back to the grid
    for slot in range(4):
        a, b = grid.slot_state(slot), packed.slot_state(slot)
        assert torch.equal(a["layer_offsets"], b["layer_offsets"])
        assert all(torch.equal(x, y) for x, y in zip(a["rings"], b["rings"])), slot
