# SPDX-License-Identifier: Apache-2.0
"""A step over a pool (step.py): input validation, and per-frame validity (a padded step equals a step of its
own length)."""

from __future__ import annotations

import copy

import pytest
import torch
from moss_codecs import initialized_state_pool as _pool_for
from moss_codecs import make_state_pool, random_codes
from moss_codecs import step_valid_rows as _run

from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


# -------------------------------------------------------------------------------------------------- bad input


def _snapshot(pool):
    return [t.clone() for t in pool.rings + pool.offset_tensors()]


@pytest.mark.parametrize("kind", ["legacy", "compact"])
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c, l, s, v: (c.float(), l, s, v),
            r"codes must be a signed integer \(or uint8\) tensor, got dtype torch.float32",
        ),
        (lambda c, l, s, v: (c[0], l, s, v), r"codes must have shape \(n_vq, B, T\), got shape \(2, 3\)"),
        (lambda c, l, s, v: (c.clone().fill_(16), l, s, v), r"code 16 is outside the codebook range \[0, 15\]"),
        (lambda c, l, s, v: (c.clone().fill_(-1), l, s, v), r"code -1 is outside the codebook range \[0, 15\]"),
        (lambda c, l, s, v: (c, l, torch.tensor([0, 0]), v), r"duplicate slot ids among valid rows: \[0\]"),
        (
            lambda c, l, s, v: (c, l, torch.tensor([3, 1]), v),
            r"slot id 3 of a valid row is outside the live slots 0..2",
        ),
        (
            lambda c, l, s, v: (c, l, torch.tensor([-1, 1]), v),
            r"slot id -1 of a valid row is outside the live slots 0..2",
        ),
        (lambda c, l, s, v: (c, l[:1], s, v), r"valid_frames must be a tensor of shape \(2,\), got \(1,\)"),
        (lambda c, l, s, v: (c, torch.tensor([4, 0]), s, v), r"valid_frames\[0\] = 4 is outside 0..3"),
        (lambda c, l, s, v: (c, l, s.float(), v), "state_slot_ids must be int32/int64, got torch.float32"),
        (lambda c, l, s, v: (c, l, s, v.long()), "valid_rows must be bool, got torch.int64"),
        (lambda c, l, s, v: (torch.cat([c, c[:1]]), l, s, v), "codes have n_vq=3 codebooks; this codec has 1..2"),
    ],
)
def test_bad_input_raises_and_changes_no_slot(kind, mutate, message, ring_decoder):
    pool = make_state_pool(ring_decoder, kind)
    pool.initialize(3, 2)
    ok = (
        random_codes(ring_decoder, 2, 3, seed=1),
        torch.tensor([3, 3]),
        torch.tensor([0, 1]),
        torch.tensor([True, True]),
    )
    decode_batch(pool, *ok)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=message):
        decode_batch(pool, *mutate(*ok))
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))


@pytest.mark.parametrize("length", [-1, 4])
def test_a_valid_rows_length_outside_the_step_is_refused(length, ring_decoder):
    pool = _pool_for(ring_decoder, "compact")
    before = [t.clone() for t in pool.rings + pool.offset_tensors()]
    codes = random_codes(ring_decoder, 2, 3, seed=1)
    with pytest.raises(ValueError, match=rf"valid_frames\[1\] = {length} is outside 0..3 \(T = frames in this step\)"):
        _run(pool, codes, [3, length], [0, 1])
    assert all(torch.equal(x, y) for x, y in zip(before, pool.rings + pool.offset_tensors()))
    # An invalid (padding) row's length is ignored.
    decode_batch(pool, codes, torch.tensor([3, 99]), torch.tensor([0, 5]), torch.tensor([True, False]))


# ----------------------------------------------------------------------------------------- per-frame validity


STEP_FRAMES = 15


def _assert_rel_close(got, ref, what):
    scale = max(ref.abs().max().item(), 1e-12)
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-5 * scale, f"{what}: relative error {err / scale:.2e}"


def _assert_states_close(a, b, slot, what):
    x, y = a.slot_state(slot), b.slot_state(slot)
    assert torch.equal(x["layer_offsets"], y["layer_offsets"]), f"{what}: offsets differ"
    for li, (p, q) in enumerate(zip(x["rings"], y["rings"])):
        _assert_rel_close(p, q, f"{what}: layer {li} ring")


POOL_CASES = [("v2", "compact"), ("v2", "legacy"), ("v1", "legacy")]


@pytest.mark.parametrize("history", [0, 2, 9], ids=["empty", "partly-full", "wrapped"])
@pytest.mark.parametrize("codec,kind", POOL_CASES)
def test_padded_step_equals_step_of_its_own_length(codec, kind, history, ring_decoder, ring_decoder_v1):
    """Every length 0..15 in a 15-frame step leaves audio, rings and offsets as a step of
    exactly that many frames would (rings of 5 and 10 tokens: a step wraps them)."""
    decoder = ring_decoder if codec == "v2" else ring_decoder_v1
    spf = decoder.config.samples_per_frame
    past = random_codes(decoder, 1, max(history, 1), seed=11)
    step = random_codes(decoder, 1, STEP_FRAMES, seed=12)
    for length in range(STEP_FRAMES + 1):
        padded, exact = _pool_for(decoder, kind), _pool_for(decoder, kind)
        if history:
            for pool in (padded, exact):
                _run(pool, past[:, :, :history], [history], [1])
        before = padded.slot_state(1)
        audio, audio_len = _run(padded, step, [length], [1])
        assert audio.shape == (1, 1, STEP_FRAMES * spf) and int(audio_len[0]) == length * spf
        assert not audio[..., length * spf :].any(), "padding frames must decode to silence"
        if length == 0:  # a valid row with nothing to decode leaves its state untouched
            after = padded.slot_state(1)
            assert torch.equal(before["layer_offsets"], after["layer_offsets"])
            assert all(torch.equal(p, q) for p, q in zip(before["rings"], after["rings"]))
            continue
        ref, _ = _run(exact, step[:, :, :length], [length], [1])
        _assert_rel_close(audio[..., : length * spf], ref, f"length {length}: audio")
        _assert_states_close(padded, exact, 1, f"length {length}")


#: float32 on CPU: a padded step's audio and rings against the unpadded step's, relative to their peak. Not bitwise:
#: PyTorch's float32 CPU matmul (the decoder's linear layers) gives a row other bits when the matrix has more rows
#: (1 to 15 frames of one chunk), under either ring semantics. Measured at most 6.9e-7 (audio) and 1.3e-6 (rings)
#: over this test's cases; docs/ring_semantics.md states it.
FLOAT32_PADDING_TOLERANCE = 5e-6


@pytest.mark.parametrize("history", [0, 9], ids=["empty", "wrapped"])
@pytest.mark.parametrize("semantics", ["exact", "upstream"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("codec,kind", [("v2", "compact"), ("v1", "legacy")])
def test_padding_frames_change_nothing_on_cpu(codec, kind, dtype, semantics, history, ring_decoder, ring_decoder_v1):
    """The same chunk of every length 1..14 decoded padded to a 15-frame step and unpadded, on CPU: bf16 audio
    and rings are bitwise equal (under ``exact`` semantics a query attends over ``C`` keys however many padding
    tokens the step carries); float32 ones within :data:`FLOAT32_PADDING_TOLERANCE` of their peak."""
    decoder = ring_decoder if codec == "v2" else ring_decoder_v1
    if dtype == torch.bfloat16:
        decoder = copy.deepcopy(decoder).to(torch.bfloat16)
    spf = decoder.config.samples_per_frame
    past = random_codes(decoder, 1, max(history, 1), seed=11)
    step = random_codes(decoder, 1, STEP_FRAMES, seed=12)
    for length in range(1, STEP_FRAMES):
        pools = []
        for codes in (step, step[:, :, :length]):
            pool = make_state_pool(decoder, kind, dtype=dtype, ring_semantics=semantics, attention_backend="sdpa")
            pool.initialize(3, 2)
            if history:
                _run(pool, past[:, :, :history], [history], [1])
            audio, _ = _run(pool, codes, [length], [1])
            pools.append((pool, audio[..., : length * spf]))
        (padded, got), (alone, ref) = pools
        x, y = padded.slot_state(1), alone.slot_state(1)
        assert torch.equal(x["layer_offsets"], y["layer_offsets"]), f"length {length}: offsets"
        if dtype == torch.bfloat16:
            assert torch.equal(got, ref), f"length {length}: audio"
            for li, (p, q) in enumerate(zip(x["rings"], y["rings"])):
                assert torch.equal(p, q), f"length {length}: layer {li} ring"
            continue
        for what, a, b in [
            ("audio", got, ref),
            *((f"layer {li} ring", p, q) for li, (p, q) in enumerate(zip(x["rings"], y["rings"]))),
        ]:
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= FLOAT32_PADDING_TOLERANCE * scale, (
                f"length {length}: {what}: relative error {err / scale:.2e}"
            )


@pytest.mark.parametrize("codec,kind", POOL_CASES)
def test_rows_of_mixed_lengths_in_one_step(codec, kind, ring_decoder, ring_decoder_v1):
    decoder = ring_decoder if codec == "v2" else ring_decoder_v1
    spf = decoder.config.samples_per_frame
    lengths = [15, 7, 1]
    codes = random_codes(decoder, 3, STEP_FRAMES, seed=13)
    past = random_codes(decoder, 3, 4, seed=14)
    mixed = _pool_for(decoder, kind)
    _run(mixed, past, [4, 4, 4], [0, 1, 2])
    audio, _ = _run(mixed, codes, lengths, [2, 0, 1])
    for b, (length, slot) in enumerate(zip(lengths, [2, 0, 1])):
        solo = _pool_for(decoder, kind)
        _run(solo, past[:, slot : slot + 1], [4], [slot])  # slot s decoded past row s
        ref, _ = _run(solo, codes[:, b : b + 1, :length], [length], [slot])
        _assert_rel_close(audio[b : b + 1, :, : length * spf], ref, f"row {b}")
        _assert_states_close(mixed, solo, slot, f"row {b}")
