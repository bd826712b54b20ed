# SPDX-License-Identifier: Apache-2.0
"""Legacy and V2 decoder state pools: parity, sharing, lifecycle, bad input, bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moss_codecs import assert_slot_state_equal, make_state_pool, random_codes
from moss_codecs import step_valid_rows as _run

from vllm_omni_moss.model_executor.models.moss_tts import step_metadata
from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder
from vllm_omni_moss.model_executor.models.moss_tts.state import (
    POOL_CLASSES,
    CompactDecoderStatePool,
    LegacyDecoderStatePool,
    PagedDecoderStatePool,
    StateSpec,
    build_pool,
    state_bytes_for,
)
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]

SLOT_BYTES_V2 = 88_678_400  # bf16 K+V rings of one v2 slot (docs/memory.md)


def _pair(decoder, live=4, scratch=4):
    legacy = make_state_pool(decoder, "legacy")
    legacy.initialize(live, scratch)
    v2 = make_state_pool(decoder)
    v2.initialize(live, scratch)
    return legacy, v2


def _assert_null_slot_zero(v2):
    null = v2.null_slot
    assert int(v2.frames_decoded[null]) == 0
    for ring in v2.rings:
        assert torch.count_nonzero(ring[:, null]) == 0


# ----------------------------------------------------------------------------- default and sharing


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_v2_pool_is_default_whatever_the_old_variable(env, monkeypatch, ring_decoder):
    if env is None:
        monkeypatch.delenv("VLLM_OMNI_MOSS_CODEC_SHARED_KV", raising=False)
    else:
        monkeypatch.setenv("VLLM_OMNI_MOSS_CODEC_SHARED_KV", env)
    pool = make_state_pool(ring_decoder)
    assert isinstance(pool, CompactDecoderStatePool)
    pool.initialize(4, 128)
    assert pool.num_slots == 5 and pool.null_slot == 4
    assert tuple(pool.frames_decoded.shape) == (5,)
    assert [tuple(r.shape) for r in pool.rings[:1]] == [(2, 5, 2, 5, 64)]
    pool.close()


def test_v1_codec_keeps_the_legacy_pool(ring_decoder_v1):
    assert isinstance(make_state_pool(ring_decoder_v1), LegacyDecoderStatePool)
    with pytest.raises(ValueError, match="compact pool serves v2 codecs; this codec is v1"):
        make_state_pool(ring_decoder_v1, "compact")
    with pytest.raises(ValueError, match="unknown state pool kind 'shared'"):
        make_state_pool(ring_decoder_v1, "shared")


def _count_builds(monkeypatch):
    calls = []
    real = step_metadata.build_ring_metadata

    def spy(*args, **kwargs):
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(step_metadata, "build_ring_metadata", spy)
    return calls


def test_metadata_built_once_per_group_per_step(monkeypatch, ring_decoder):
    calls = _count_builds(monkeypatch)
    legacy, v2 = _pair(ring_decoder)
    codes = random_codes(ring_decoder, 2, 3, seed=1)
    args = (torch.tensor([3, 3]), torch.tensor([0, 1]), torch.tensor([True, True]))
    decode_batch(v2, codes, *args)
    assert calls == [3, 6]  # one build per group, with its token count
    calls.clear()
    decode_batch(legacy, codes, *args)
    assert calls == [3, 3, 3, 6, 6, 6]  # the legacy pool rebuilds per layer, as upstream


def test_fixed_width_streaming_keeps_independent_per_layer_state(monkeypatch, ring_decoder):
    calls = _count_builds(monkeypatch)
    with ring_decoder.streaming(1) as stream:
        stream.decode(random_codes(ring_decoder, 1, 2, seed=2))
        state = stream.state
        assert len(state.offsets) == 6 and len({id(t) for t in state.offsets}) == 6
        assert [int(t) for t in state.offsets] == [2, 2, 2, 4, 4, 4]
    assert calls == [2, 2, 2, 4, 4, 4]


def test_close_and_reinitialise_with_another_capacity(ring_decoder):
    pool = make_state_pool(ring_decoder)
    pool.initialize(4, 128)
    with pytest.raises(RuntimeError, match="already initialised; close"):
        pool.initialize(2, 0)
    pool.close()
    assert pool.state_bytes() == 0
    with pytest.raises(RuntimeError, match="not initialised"):
        pool.reset([0])
    pool.initialize(2, 128)
    assert pool.num_slots == 3 and pool.null_slot == 2


def test_legacy_lifecycle_and_offset_bank(ring_decoder):
    legacy = make_state_pool(ring_decoder, "legacy")
    legacy.initialize(4, 4)
    assert legacy.num_slots == 8
    assert tuple(legacy.offset_table.shape) == (14, 8)  # 2 groups x (3 layers x 2 + 1)
    codes = random_codes(ring_decoder, 2, 2, seed=3)
    decode_batch(legacy, codes, torch.tensor([2, 2]), torch.tensor([1, 5]), torch.tensor([True, False]))
    assert legacy.offset_table[:, 1].tolist() == [2] * 7 + [4] * 7
    assert legacy.offset_table[:, 5].tolist() == [0] * 14
    legacy.reset(torch.tensor([1]))
    assert int(legacy.offset_table.abs().sum()) == 0
    legacy.close()
    legacy.initialize(2, 1)
    assert legacy.num_slots == 3 and tuple(legacy.offset_table.shape) == (14, 3)


# ----------------------------------------------------------------------------- full script

SCRIPT_T = [1, 3, 3, 7, 1, 3, 7, 3]


def test_full_codec_script_bit_identical_to_legacy(ring_decoder):
    """Wraparound (rings 5 and 10), oversized chunks (T=7 -> 7 and 14 tokens), padding,
    reordering, an all-padding step and a midway reset: V2 audio and live state equal
    the legacy pool bit for bit; the null slot stays zero."""
    legacy, v2 = _pair(ring_decoder)
    for step, T in enumerate(SCRIPT_T):
        codes = random_codes(ring_decoder, 4, T, seed=100 + step)
        live = [1, 0] if step % 2 else [0, 1]
        if step == 4:
            valid = torch.tensor([False] * 4)
            legacy_ids = torch.tensor([4, 5, 6, 7])
            v2_ids = torch.tensor([4, 5, 6, 7])
        else:
            valid = torch.tensor([True, True, False, False])
            legacy_ids = torch.tensor(live + [6, 7])
            v2_ids = torch.tensor(live + [6, 7])  # out of range for V2: redirected to the null slot
        lengths = torch.where(valid, T, 0)
        a_audio, a_len = decode_batch(legacy, codes, lengths, legacy_ids, valid)
        b_audio, b_len = decode_batch(v2, codes, lengths, v2_ids, valid)
        assert torch.equal(a_audio, b_audio), f"step {step}: audio differs"
        assert torch.equal(a_len, b_len)
        assert a_len.tolist() == [T * 8 if v else 0 for v in valid.tolist()]
        if step != 4:
            assert torch.isfinite(a_audio[:2]).all() and a_audio[:2].abs().sum() > 0
        assert torch.count_nonzero(b_audio[~valid]) == 0
        assert_slot_state_equal(legacy, v2, range(4))
        _assert_null_slot_zero(v2)
        if step == 2:
            legacy.reset(torch.tensor([0]))
            v2.reset(torch.tensor([0]))
            assert_slot_state_equal(legacy, v2, range(4))
    expected_frames = sum(SCRIPT_T[3:]) - SCRIPT_T[4]  # slot 0: reset after step 2, idle at step 4
    assert int(v2.frames_decoded[0]) == expected_frames
    assert int(v2.frames_decoded[1]) == sum(SCRIPT_T) - SCRIPT_T[4]


def test_v1_legacy_pool_matches_fixed_width_reference(ring_decoder_v1):
    pool = make_state_pool(ring_decoder_v1)
    pool.initialize(3, 2)
    codes = random_codes(ring_decoder_v1, 1, sum(SCRIPT_T), seed=5)
    ref = ring_decoder_v1.decode(codes, chunk_frames=SCRIPT_T)
    out, start = [], 0
    for T in SCRIPT_T:
        chunk = codes[:, :, start : start + T].expand(-1, 2, -1).contiguous()
        audio, _ = decode_batch(pool, chunk, torch.tensor([T, 0]), torch.tensor([2, 4]), torch.tensor([True, False]))
        out.append(audio[:1])
        start += T
    got = torch.cat(out, dim=-1)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


# ----------------------------------------------------------------------------- reuse and bad input


@pytest.mark.parametrize("kind", ["legacy", "compact"])
def test_released_slot_with_nan_garbage_decodes_like_a_fresh_pool(kind, ring_decoder):
    used, fresh = make_state_pool(ring_decoder, kind), make_state_pool(ring_decoder, kind)
    used.initialize(3, 2)
    fresh.initialize(3, 2)
    pad = used.padding_slot_ids(1)
    decode_batch(
        used,
        random_codes(ring_decoder, 2, 7, seed=9),
        torch.tensor([7, 0]),
        torch.cat([torch.tensor([1]), pad]),
        torch.tensor([True, False]),
    )
    for ring in used.rings:
        ring[:, 1] = float("nan")
        ring[0, 1, 0, 0, 0] = 1e30
    used.reset(torch.tensor([1]))
    for T, seed in ((1, 10), (3, 11), (7, 12)):
        codes = random_codes(ring_decoder, 2, T, seed=seed)
        args = (torch.tensor([T, 0]), torch.cat([torch.tensor([1]), pad]), torch.tensor([True, False]))
        a, _ = decode_batch(used, codes, *args)
        b, _ = decode_batch(fresh, codes, *args)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


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


def test_legacy_padding_rows_must_use_distinct_scratch_slots(ring_decoder):
    pool = make_state_pool(ring_decoder, "legacy")
    pool.initialize(3, 2)
    codes = random_codes(ring_decoder, 2, 1, seed=1)
    with pytest.raises(ValueError, match=r"padding row slot id 1 is not a scratch slot \(3..4\)"):
        decode_batch(pool, codes, torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([True, False]))
    codes = random_codes(ring_decoder, 3, 1, seed=1)
    with pytest.raises(ValueError, match=r"duplicate scratch slot ids among padding rows: \[3\]"):
        decode_batch(pool, codes, torch.tensor([1, 0, 0]), torch.tensor([0, 3, 3]), torch.tensor([True, False, False]))
    with pytest.raises(ValueError, match="3 padding rows need 3 scratch slots; this pool has 2"):
        pool.padding_slot_ids(3)


def test_reset_rejects_unknown_slots_and_the_null_slot(ring_decoder):
    pool = make_state_pool(ring_decoder)
    pool.initialize(3, 8)
    with pytest.raises(ValueError, match="slot id 3 cannot be reset; resettable slot ids are 0..2"):
        pool.reset([3])
    with pytest.raises(ValueError, match="slot id -2 cannot be reset"):
        pool.reset(torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match="slot_ids must be a 1-D integer tensor"):
        pool.reset(torch.tensor([[0]]))
    with pytest.raises(ValueError, match="state_capacity must be an integer >= 1, got 0"):
        make_state_pool(ring_decoder).initialize(0)


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("live", [64, 128])
def test_state_bytes_real_v2_geometry(live):
    config = preset_config("v2")
    assert config.state_bytes_per_slot(2) == SLOT_BYTES_V2
    with torch.device("meta"):
        decoder = CodecDecoder(config)
    legacy = make_state_pool(decoder, "legacy", torch.bfloat16)
    legacy.initialize(live, live)
    v2 = make_state_pool(decoder, "compact", torch.bfloat16)
    v2.initialize(live, live)
    legacy_expected = 2 * live * SLOT_BYTES_V2 + 190 * 2 * live * 8
    v2_expected = (live + 1) * SLOT_BYTES_V2 + (live + 1) * 8
    assert legacy.state_bytes() == legacy_expected == state_bytes_for(config, 2 * live, "legacy")
    assert v2.state_bytes() == v2_expected == state_bytes_for(config, live + 1, "compact")
    # 21.14 GiB vs 10.65 GiB of rings at 128 live streams (docs/memory.md).
    if live == 128:
        assert round(256 * SLOT_BYTES_V2 / 2**30, 2) == 21.14
        assert round(129 * SLOT_BYTES_V2 / 2**30, 2) == 10.65


# ----------------------------------------------------------------------------- property


@st.composite
def _scripts(draw):
    n_streams = draw(st.integers(2, 5))
    sizes = st.sampled_from([1, 2, 3, 7, 12])  # 7 and 12 frames overflow the 5- and 10-token rings
    streams = [draw(st.lists(sizes, min_size=1, max_size=4)) for _ in range(n_streams)]
    aborts = [draw(st.booleans()) for _ in range(n_streams)]
    pads = draw(st.lists(st.integers(0, 2), min_size=40, max_size=40))
    orders = draw(st.lists(st.randoms(use_true_random=False), min_size=1, max_size=1))
    return streams, aborts, pads, orders[0]


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=_scripts())
def test_random_scripts_v2_equals_legacy_and_solo_reference(script, ring_decoder):
    streams, aborts, pads, rng = script
    capacity, scratch = 3, 2
    legacy, v2 = _pair(ring_decoder, capacity, scratch)
    free = list(range(capacity))
    pending = list(range(len(streams)))
    active: dict[int, dict] = {}
    outputs: dict[int, list] = {i: [] for i in range(len(streams))}
    fed: dict[int, list] = {i: [] for i in range(len(streams))}
    step = 0
    while pending or active:
        while pending and free:  # arrivals take the most recently freed slot
            sid = pending.pop(0)
            active[sid] = {"slot": free.pop(), "next": 0}
        sizes = sorted({streams[s][st_["next"]] for s, st_ in active.items()})
        T = sizes[rng.randrange(len(sizes))]
        rows = [s for s, st_ in active.items() if streams[s][st_["next"]] == T]
        rng.shuffle(rows)
        n_pad = min(pads[step % len(pads)], scratch)
        B = len(rows) + n_pad
        codes = random_codes(ring_decoder, B, T, seed=1000 + step)
        valid = torch.tensor([True] * len(rows) + [False] * n_pad)
        live = [active[s]["slot"] for s in rows]
        legacy_ids = torch.tensor(live + legacy.padding_slot_ids(n_pad).tolist(), dtype=torch.long)
        v2_ids = torch.tensor(live + [-1] * n_pad, dtype=torch.long)
        lengths = torch.where(valid, T, 0)
        a, _ = decode_batch(legacy, codes, lengths, legacy_ids, valid)
        b, _ = decode_batch(v2, codes, lengths, v2_ids, valid)
        assert torch.equal(a, b)
        _assert_null_slot_zero(v2)
        for r, s in enumerate(rows):
            outputs[s].append(a[r : r + 1])
            fed[s].append(codes[:, r : r + 1])
            active[s]["next"] += 1
            done = active[s]["next"] == len(streams[s])
            if done or (aborts[s] and active[s]["next"] == 1 and len(streams[s]) > 1):
                slot = active.pop(s)["slot"]
                legacy.reset([slot])
                v2.reset([slot])
                free.append(slot)
        assert_slot_state_equal(legacy, v2, range(capacity))
        step += 1
    for s in range(len(streams)):
        codes = torch.cat(fed[s], dim=-1)
        ref = ring_decoder.decode(codes, chunk_frames=[c.shape[-1] for c in fed[s]])
        got = torch.cat(outputs[s], dim=-1)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err <= 1e-5, f"stream {s}: relative max error {err:.2e}"


def test_int32_slot_ids_and_bad_helper_arguments(ring_decoder):
    for kind in ("legacy", "compact"):
        pool = make_state_pool(ring_decoder, kind)
        pool.initialize(3, 2)
        codes = random_codes(ring_decoder, 2, 2, seed=1)
        ids32 = torch.tensor([0, 1], dtype=torch.int32)
        a, _ = decode_batch(pool, codes, torch.tensor([2, 2]), ids32, torch.tensor([True, True]))
        ref = make_state_pool(ring_decoder, kind)
        ref.initialize(3, 2)
        b, _ = decode_batch(ref, codes, torch.tensor([2, 2]), ids32.long(), torch.tensor([True, True]))
        assert torch.equal(a, b)
        with pytest.raises(ValueError, match="padding row count must be an integer >= 0, got -1"):
            pool.padding_slot_ids(-1)
        with pytest.raises(ValueError, match="slot_ids must be a 1-D integer tensor or list of ints, got None"):
            pool.reset(None)
    with pytest.raises(ValueError, match="ring dtype must be a floating-point dtype, got torch.int64"):
        make_state_pool(ring_decoder, dtype=torch.int64)


def test_failed_allocation_leaves_the_pool_uninitialised(ring_decoder):
    pool = make_state_pool(ring_decoder)
    with pytest.raises(RuntimeError, match="cannot allocate decoder state for 1000000000000 live streams"):
        pool.initialize(10**12)
    assert not pool.initialized and pool.state_capacity == 0 and pool.num_slots == 0 and pool.state_bytes() == 0
    pool.initialize(2)
    assert pool.num_slots == 3


# ----------------------------------------------------------------------------- per-frame validity

STEP_FRAMES = 15


def _pool_for(decoder, kind):
    pool = make_state_pool(decoder, kind)
    pool.initialize(3, 2)
    return pool


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


def test_compact_and_legacy_stay_bit_identical_with_padding(ring_decoder):
    legacy, compact = _pair(ring_decoder)
    for i, lengths in enumerate(([1, 1, 0], [3, 2, 1], [0, 3, 3], [2, 0, 3])):
        codes = random_codes(ring_decoder, 3, 3, seed=20 + i)
        args = (codes, torch.tensor(lengths), torch.tensor([0, 1, 2]), torch.ones(3, dtype=torch.bool))
        a, _ = decode_batch(legacy, *args)
        b, _ = decode_batch(compact, *args)
        assert torch.equal(a, b)
        assert_slot_state_equal(legacy, compact, range(3))
    _assert_null_slot_zero(compact)


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


# ----------------------------------------------------------------------------- slot lifecycle


@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_acquire_is_lifo_and_release_resets(kind, ring_decoder):
    pool = _pool_for(ring_decoder, kind)
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2] and pool.free_slot_count == 0
    with pytest.raises(RuntimeError, match="no free decoder state slot: all 3 live slots are in use"):
        pool.acquire()
    _run(pool, random_codes(ring_decoder, 1, 2, seed=3), [2], [1])
    pool.release([1])
    state = pool.slot_state(1)
    assert int(state["layer_offsets"].abs().sum()) == 0 and all(not r.any() for r in state["rings"])
    pool.release([0])
    assert pool.acquire() == 0 and pool.acquire() == 1  # the slot released last is acquired first
    assert pool.slots_in_use == {0, 1, 2}


@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_release_clears_only_the_reslots_in_use_in_every_layer(kind, ring_decoder):
    # Each layer's ring is a view of its resolution group's tensor and release fills slots group by group:
    # the released slots read zero in every layer, the others keep their bytes, and each ring still lives
    # at its own address (the graphs and the attention ops read rings by address).
    pool = _pool_for(ring_decoder, kind)
    slots = [pool.acquire() for _ in range(3)]
    _run(pool, random_codes(ring_decoder, 3, 4, seed=5), [4, 2, 3], slots)
    before = [ring.clone() for ring in pool.rings]
    assert all(bool(ring[:, s].any()) for ring in pool.rings for s in slots)
    pool.release([2, 0])
    for layer, (ring, old) in enumerate(zip(pool.rings, before)):
        assert not ring[:, [0, 2]].any(), layer
        assert torch.equal(ring[:, 1], old[:, 1]) and torch.equal(ring[:, 3:], old[:, 3:]), layer
    ptrs = [ring.data_ptr() for ring in pool.rings]
    assert len(set(ptrs)) == len(ptrs) == sum(g.num_layers for g in ring_decoder.config.groups)
    assert pool.state_bytes() == sum(r.numel() * r.element_size() for r in pool.rings + pool.offset_tensors())


@pytest.mark.parametrize(
    "ids,message",
    [
        ([3], r"slot id 3 is not a live slot id \(0..2\)"),
        ([-1], r"slot id -1 is not a live slot id \(0..2\)"),
        ([1], r"slot 1 is not in use \(released twice\?\)"),
        ([0, 0], r"slot ids released twice in one call: \[0\]"),
    ],
)
def test_release_refuses_unknown_and_double_releases(ids, message, ring_decoder):
    pool = _pool_for(ring_decoder, "compact")
    pool.acquire()
    with pytest.raises(ValueError, match=message):
        pool.release(ids)
    assert pool.slots_in_use == {0}


def test_padding_policy(ring_decoder):
    compact, legacy = _pool_for(ring_decoder, "compact"), _pool_for(ring_decoder, "legacy")
    assert compact.scratch_slots_for(8) == 0 and legacy.scratch_slots_for(8) == 8
    assert compact.padding_slot_ids(3).tolist() == [3, 3, 3] and compact.slots_dirtied_by_padding(3) == []
    assert legacy.padding_slot_ids(2).tolist() == [3, 4] and legacy.slots_dirtied_by_padding(2) == [3, 4]
    with pytest.raises(ValueError, match="3 padding rows need 3 scratch slots; this pool has 2"):
        legacy.padding_slot_ids(3)
    with pytest.raises(ValueError, match="padding row count must be an integer >= 0, got -1"):
        compact.padding_slot_ids(-1)


# ----------------------------------------------------------------------------- save / restore


def _decode(pool, slots, T, seed):
    """One step of ``T`` frames for live ``slots``; returns the audio."""
    codes = random_codes(pool.decoder, len(slots), T, seed=seed)
    B = len(slots)
    audio, _ = decode_batch(pool, codes, torch.full((B,), T), torch.tensor(slots), torch.ones(B, dtype=torch.bool))
    return audio


def _slot_bits(pool, slot):
    return [ring[:, slot].clone() for ring in pool.rings], [t.clone() for t in pool.offset_tensors()]


def _acquire_all(pool):
    for _ in range(pool.state_capacity):
        pool.acquire()


@pytest.mark.parametrize("codec", ["v2", "v1"])
@pytest.mark.parametrize("history", [[1], [3, 7], [7, 7, 7]])
def test_save_restore_round_trip_is_bitwise_and_decoding_continues_exactly(
    codec, history, ring_decoder, ring_decoder_v1
):
    """Rings of 5 and 10 tokens (2 tokens per frame in the second group): not yet full, full and wrapped.
    Save slot 1, restore it into slot 2 of another pool; the next steps decode bit for bit as in the
    original pool, and restoring into the original slot after a reset gives back its bytes."""
    decoder = ring_decoder if codec == "v2" else ring_decoder_v1
    source = make_state_pool(decoder)
    source.initialize(3)
    _acquire_all(source)  # restore_slot writes slots in use only
    for step, T in enumerate(history):
        _decode(source, [0, 1], T, seed=10 + step)
    state = source.save_slot(1)
    used = [min(int(o), ring.shape[3]) for o, ring in zip(source.slot_state(1)["layer_offsets"], source.rings)]
    assert [c.shape[2] for c in state.cells] == used
    assert all(c.device.type == "cpu" for c in state.cells)
    assert state.nbytes == sum(c.numel() * c.element_size() for c in state.cells) + state.offsets.numel() * 8

    target = make_state_pool(decoder)
    target.initialize(3)
    _acquire_all(target)  # restore_slot writes slots in use only
    _decode(target, [2, 0], 3, seed=99)  # slot 2 holds another stream first: restore must replace it
    target.restore_slot(2, state)
    expected = source.slot_state(1)
    got = target.slot_state(2)
    assert torch.equal(got["layer_offsets"], expected["layer_offsets"])
    assert all(torch.equal(a, b) for a, b in zip(got["rings"], expected["rings"]))
    for step in range(2):
        a = _decode(source, [1], 4, seed=50 + step)
        b = _decode(target, [2], 4, seed=50 + step)
        assert torch.equal(a, b), f"step {step} after the restore differs"

    before = _slot_bits(source, 1)
    state = source.save_slot(1)
    source.reset([1])
    source.restore_slot(1, state)
    after = _slot_bits(source, 1)
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0]))
    assert all(torch.equal(x, y) for x, y in zip(before[1], after[1]))


def test_save_of_a_fresh_slot_keeps_no_cells(ring_decoder):
    pool = make_state_pool(ring_decoder)
    pool.initialize(2)
    _acquire_all(pool)  # restore_slot writes slots in use only
    state = pool.save_slot(0)
    assert state.offsets.tolist() == [0] and all(c.shape[2] == 0 for c in state.cells)
    _decode(pool, [0], 3, seed=1)
    pool.restore_slot(0, state)
    assert all(not ring[:, 0].any() for ring in pool.rings) and int(pool.frames_decoded[0]) == 0


@pytest.mark.parametrize(
    "make_target,message",
    [
        (lambda d: make_state_pool(d, "legacy"), r"the state's pool kind is 'compact'; this pool's is 'legacy'"),
        (
            lambda d: make_state_pool(d, dtype=torch.float64),
            r"the state's ring dtype is torch.float32; this pool's is torch.float64",
        ),
        (
            lambda d: make_state_pool(d, ring_semantics="exact"),
            r"the state's ring semantics is 'upstream'; this pool's is 'exact'",
        ),
    ],
)
def test_restore_refuses_a_state_of_another_pool_and_changes_nothing(make_target, message, ring_decoder):
    source = make_state_pool(ring_decoder)
    source.initialize(2)
    _acquire_all(source)  # restore_slot writes slots in use only
    _decode(source, [0], 3, seed=2)
    state = source.save_slot(0)
    target = make_target(ring_decoder)
    target.initialize(2)
    _acquire_all(target)  # restore_slot writes slots in use only
    for layer, ring in enumerate(target.rings):  # a slot holding something: the refusal must leave it
        ring[:, 1].fill_(0.5 + layer)
    target.offset_tensors()[0][..., 1] = 7
    before = _slot_bits(target, 1)
    with pytest.raises(ValueError, match=f"restore_slot: {message}"):
        target.restore_slot(1, state)
    after = _slot_bits(target, 1)
    assert all(torch.equal(x, y) for x, y in zip(before[0] + before[1], after[0] + after[1]))


def test_restore_refuses_another_geometry_and_tampered_states(ring_decoder):
    import dataclasses

    source = make_state_pool(ring_decoder)
    source.initialize(2)
    _acquire_all(source)  # restore_slot writes slots in use only
    _decode(source, [0], 3, seed=4)
    state = source.save_slot(0)
    tiny = make_state_pool(CodecDecoder(preset_config("tiny-v2")))
    tiny.initialize(1)
    _acquire_all(tiny)  # restore_slot writes slots in use only
    with pytest.raises(
        ValueError, match=r"restore_slot: the state's codec geometry .* is \(\(3, 2, 5, 64, 1\), \(3, 2, 10, 64, 2\)\)"
    ):
        tiny.restore_slot(0, state)
    pool = make_state_pool(ring_decoder)
    pool.initialize(2)
    _acquire_all(pool)  # restore_slot writes slots in use only
    cases = [
        (dataclasses.replace(state, offsets=torch.tensor([-1])), r"state offsets must be >= 0, got \[-1\]"),
        (
            dataclasses.replace(state, offsets=torch.tensor([2])),
            r"layer 0 cells must be \(2, 2, 2, 64\) torch.float32 for offset 2",
        ),
        (dataclasses.replace(state, offsets=torch.tensor([3.0])), r"state offsets must be int64 of shape \(1,\)"),
        (dataclasses.replace(state, cells=state.cells[:-1]), r"the state has 5 layers of cells; the codec has 6"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=f"restore_slot: {message}"):
            pool.restore_slot(0, bad)
        assert all(not ring[:, 0].any() for ring in pool.rings) and int(pool.frames_decoded[0]) == 0
    with pytest.raises(TypeError, match="restore_slot: state must be a SlotState"):
        pool.restore_slot(0, {"cells": []})
    for op in (pool.save_slot, lambda s: pool.restore_slot(s, state)):
        with pytest.raises(ValueError, match=r"slot 2 is not a live slot id \(0..1\)"):
            op(2)


@pytest.mark.parametrize("kind", ["compact", "legacy"])
def test_restore_into_a_free_slot_is_refused_and_the_next_acquire_gets_zeros(kind, ring_decoder):
    # A free slot restored into would be handed to the next stream holding another stream's context.
    pool = make_state_pool(ring_decoder, kind)
    pool.initialize(2)
    slot = pool.acquire()
    _decode(pool, [slot], 3, seed=5)
    state = pool.save_slot(slot)
    pool.release([slot])
    with pytest.raises(ValueError, match=rf"restore_slot: slot {slot} is not in use"):
        pool.restore_slot(slot, state)
    again = pool.acquire()
    assert all(not ring[:, again].any() for ring in pool.rings)
    assert all(not t[..., again].any() for t in pool.offset_tensors())
    with pytest.raises(
        ValueError, match=r"reserve: the frames of slot \d must be at most 1099511627776, got 9223372036854775808"
    ):
        pool.reserve({again: 2**63})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_ring_dtype_other_than_the_weights_decodes(dtype, ring_decoder):
    # Attention hands the layer its output in the projections' dtype, whatever the rings hold.
    reference = make_state_pool(ring_decoder, attention_backend="sdpa")
    other = make_state_pool(ring_decoder, dtype=dtype, attention_backend="sdpa")
    for pool in (reference, other):
        pool.initialize(2)
    for step, T in enumerate((3, 7, 2)):
        expected, got = _decode(reference, [0, 1], T, seed=20 + step), _decode(other, [0, 1], T, seed=20 + step)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        tolerance = 1e-5 if dtype == torch.float64 else 5e-2
        assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item(), f"step {step}"
    assert other.rings[0].dtype == dtype


@pytest.mark.parametrize("start_frames", [10**3, 10**6, 5 * 10**8])
def test_a_stream_decodes_the_same_whatever_its_age(start_frames, ring_decoder):
    """RoPE attention depends on position differences only: a stream whose position counters start at
    ``start_frames`` (up to 1e9 tokens in the second group) decodes as one that starts at 0, once the
    window of every layer holds only its own tokens (30 frames for this codec: 3 layers of 5 frames per
    group, two groups), within 1e-5 in float32; its rings have wrapped many times by then."""
    codes = random_codes(ring_decoder, 1, 60, seed=9)
    audio = []
    for start in (0, start_frames):
        pool = make_state_pool(ring_decoder)
        pool.initialize(1)
        pool.frames_decoded[0] = start
        parts = []
        for a in range(0, 60, 15):
            chunk = codes[:, :, a : a + 15]
            out, _ = decode_batch(pool, chunk, torch.tensor([15]), torch.tensor([0]), torch.tensor([True]))
            parts.append(out)
        audio.append(torch.cat(parts, dim=-1))
    spf = ring_decoder.config.samples_per_frame
    young, old = audio[0][..., 40 * spf :], audio[1][..., 40 * spf :]
    assert (old - young).abs().max().item() <= 1e-5 * young.abs().max().item()


def test_build_pool_constructs_each_kind_from_its_spec_and_refuses_another_kinds_spec(ring_decoder):
    """build_pool makes the class of the spec's kind through its constructor ``(decoder, spec)``, holding that very
    spec; a spec of another kind is refused with the class named (the paged pool before it reads the paging)."""
    for kind, cls in POOL_CLASSES.items():
        spec = StateSpec.from_options(ring_decoder, kind, torch.float32)
        pool = build_pool(ring_decoder, spec)
        assert type(pool) is cls and pool.spec is spec and cls(ring_decoder, spec).spec is spec
    compact = StateSpec.from_options(ring_decoder, "compact")
    with pytest.raises(ValueError, match=r"LegacyDecoderStatePool holds 'legacy' pools, the spec is for 'compact'"):
        LegacyDecoderStatePool(ring_decoder, compact)
    with pytest.raises(ValueError, match=r"PagedDecoderStatePool holds 'paged' pools, the spec is for 'compact'"):
        PagedDecoderStatePool(ring_decoder, compact)
    paged = StateSpec.from_options(ring_decoder, "paged", page_fraction=0.5)
    with pytest.raises(ValueError, match=r"CompactDecoderStatePool holds 'compact' pools, the spec is for 'paged'"):
        CompactDecoderStatePool(ring_decoder, paged)
    assert PagedDecoderStatePool(ring_decoder, paged).page_fraction == 0.5
