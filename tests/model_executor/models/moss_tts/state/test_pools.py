# SPDX-License-Identifier: Apache-2.0
"""The three pool kinds (state/pools.py): the legacy and compact pools against each other, the paged pool against
the compact pool it must equal bit for bit, each kind's padding policy and bytes, and a paged pool whose pages
drive a session's admission and preemption."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moss_codecs import PAGED_TEST_CAPACITY as CAPACITY
from moss_codecs import (
    assert_slot_state_equal,
    build_decoder,
    make_session,
    make_state_pool,
    random_codes,
    ring_codec_raw,
)
from moss_codecs import compact_and_paged_pools as _pools
from moss_codecs import count_ring_metadata_builds as _count_builds
from moss_codecs import initialized_state_pool as _pool_for
from moss_codecs import step_valid_rows as _step

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder
from vllm_omni_moss.model_executor.models.moss_tts.graph_ladder import frame_totals
from vllm_omni_moss.model_executor.models.moss_tts.serving import ChunkRequest
from vllm_omni_moss.model_executor.models.moss_tts.state import (
    POOL_CLASSES,
    CompactDecoderStatePool,
    LegacyDecoderStatePool,
    PagedDecoderStatePool,
    PagesExhausted,
    StateSpec,
    build_pool,
    state_bytes_for,
)
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

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


def _cuda(fn):
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn)
    return pytest.mark.cuda(fn)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_ring_decoder(request, tmp_path):
    """The rings-of-5-and-10 codec on CUDA, in each ring dtype the Triton kernels serve."""
    return build_decoder(ring_codec_raw(), tmp_path, version="v2", device="cuda").to(request.param)


def _assert_same_state(compact, pool, slot, paged_slot=None):
    a, b = compact.slot_state(slot), pool.slot_state(slot if paged_slot is None else paged_slot)
    assert torch.equal(a["layer_offsets"], b["layer_offsets"])
    for layer, (x, y) in enumerate(zip(a["rings"], b["rings"])):
        assert torch.equal(x, y), f"slot {slot} layer {layer}"


def _held_pages(pool, slot):
    return [len(tables[slot]) for tables in pool.store.host_tables]


# ----------------------------------------------------------------------------------------- the table of kinds


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


# ----------------------------------------------------------------------------------- legacy and compact pools


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


SCRIPT_T = [1, 3, 3, 7, 1, 3, 7, 3]


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


@st.composite
def _scripts(draw):
    n_streams = draw(st.integers(2, 5))
    sizes = st.sampled_from([1, 2, 3, 7, 12])  # 7 and 12 frames overflow the 5- and 10-token rings
    streams = [draw(st.lists(sizes, min_size=1, max_size=4)) for _ in range(n_streams)]
    aborts = [draw(st.booleans()) for _ in range(n_streams)]
    pads = draw(st.lists(st.integers(0, 2), min_size=40, max_size=40))
    orders = draw(st.lists(st.randoms(use_true_random=False), min_size=1, max_size=1))
    return streams, aborts, pads, orders[0]


@pytest.mark.cpu
@pytest.mark.core_model
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


# ----------------------------------------------------------------------------------- padding policy and bytes


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
def test_padding_policy(ring_decoder):
    compact, legacy = _pool_for(ring_decoder, "compact"), _pool_for(ring_decoder, "legacy")
    assert compact.scratch_slots_for(8) == 0 and legacy.scratch_slots_for(8) == 8
    assert compact.padding_slot_ids(3).tolist() == [3, 3, 3] and compact.slots_dirtied_by_padding(3) == []
    assert legacy.padding_slot_ids(2).tolist() == [3, 4] and legacy.slots_dirtied_by_padding(2) == [3, 4]
    with pytest.raises(ValueError, match="3 padding rows need 3 scratch slots; this pool has 2"):
        legacy.padding_slot_ids(3)
    with pytest.raises(ValueError, match="padding row count must be an integer >= 0, got -1"):
        compact.padding_slot_ids(-1)


@pytest.mark.cpu
@pytest.mark.core_model
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


# ------------------------------------------------------------------------------------------------- paged pool


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
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
            want = [
                min(-(-frames[s] * g.tokens_per_frame // 5), g.ring_capacity // 5) for g in ring_decoder.config.groups
            ]
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
    assert pool.free_page_counts() == full == [CAPACITY * g.ring_capacity // 5 for g in ring_decoder.config.groups]
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
    pool = make_state_pool(ring_decoder, "paged", page_fraction=0.2)  # one slot's worth of pages per group
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


def test_paged_restore_and_page_calls_check_slots_in_use_and_pages_first(ring_decoder):
    pool = make_state_pool(ring_decoder, "paged", page_fraction=0.5)  # 1 and 3 pages: one full stream and a bit
    pool.initialize(2)
    x, y = pool.acquire(), pool.acquire()
    _step(pool, random_codes(ring_decoder, 1, 6, seed=1), [6], [x])  # x takes every page of group 0
    saved = pool.save_slot(x)
    _step(pool, random_codes(ring_decoder, 1, 1, seed=2), [0], [y])
    before = (pool.slot_state(y), pool.free_page_counts())
    with pytest.raises(PagesExhausted, match=r"restore_slot: the state's 6 frames need more pages than group 0"):
        pool.restore_slot(y, saved)
    after = pool.slot_state(y)
    assert torch.equal(after["layer_offsets"], before[0]["layer_offsets"]) and pool.free_page_counts() == before[1]
    pool.release([y])
    with pytest.raises(ValueError, match=r"restore_slot: slot 1 is not in use"):
        pool.restore_slot(y, saved)
    before = pool.free_page_counts()
    with pytest.raises(ValueError, match=rf"decode_batch: slot {y} is not in use"):
        _step(pool, random_codes(ring_decoder, 1, 1, seed=3), [1], [y])
    for bad in (2, -1, 99):
        with pytest.raises(ValueError, match=rf"slot id {bad} of a valid row is outside the live slots 0..1"):
            _step(pool, random_codes(ring_decoder, 1, 1, seed=3), [1], [bad])
    assert pool.acquire() == y
    with pytest.raises(PagesExhausted, match=rf"group 0 needs 1 more pages of \d+ tokens for slots \[{y}\]; 0 are"):
        pool.reserve({y: 1}, strict=True)
    assert not pool.reserve({y: 1})
    pool.release([y])
    assert pool.free_page_counts() == before  # nothing allocated by a refused step or reservation
    with pytest.raises(ValueError, match=r"reserve: slot 7 is not in use"):
        pool.reserve({7: 3})
    free = pool.free_page_counts()
    for bad in ("3", -5, 1.5, True, None):
        with pytest.raises(ValueError, match=rf"reserve: the frames of slot {x} must be an integer >= 0, got {bad!r}"):
            pool.reserve({x: bad})
    with pytest.raises(TypeError, match=r"reserve takes a dict of slot -> frames, got list"):
        pool.reserve([(x, 3)])
    assert pool.free_page_counts() == free  # nothing allocated by a refused reservation
    compact = make_state_pool(ring_decoder, kind="compact")
    compact.initialize(1)
    z = compact.acquire()
    assert compact.reserve({z: 40})
    with pytest.raises(ValueError, match=rf"reserve: the frames of slot {z} must be an integer >= 0, got -1"):
        compact.reserve({z: -1})


def _random_steps(decoder, pools, steps, seed, device="cpu"):
    """Random steps on every pool of ``pools`` (same slots acquired in each); yields each step's audio."""
    rng = random.Random(seed)
    for step in range(steps):
        B = rng.randint(1, CAPACITY)
        T = rng.randint(1, 7)
        slots = rng.sample(range(CAPACITY), B)
        lengths = [rng.randint(0, T) for _ in range(B)]
        codes = random_codes(decoder, B, T, seed=step).to(device)
        outs = [
            decode_batch(
                p,
                codes,
                torch.tensor(lengths, device=device),
                torch.tensor(slots, device=device),
                torch.ones(B, dtype=torch.bool, device=device),
            )[0]
            for p in pools
        ]
        yield step, outs


@_cuda
def test_cuda_paged_pool_equals_the_compact_pool(cuda_ring_decoder):
    """On CUDA the Triton kernels read and write rings through page tables: audio, rings and offsets
    bitwise the compact pool's over random steps whose rings fill and wrap, in fp32 and bf16."""
    compact, pool = _pools(cuda_ring_decoder)
    for step, (a, b) in _random_steps(cuda_ring_decoder, (compact, pool), 14, seed=9, device="cuda"):
        assert torch.equal(a, b), step
    for s in range(CAPACITY):
        _assert_same_state(compact, pool, s)
    assert all(bool((ring[:, 0] == 0).all()) for ring in pool.rings), "the null page was written"


# ------------------------------------------- paged pool under a session: pages drive admission and preemption


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
def test_a_session_on_a_paged_pool_decodes_as_on_a_compact_pool(ring_decoder):
    sessions = [make_session(ring_decoder, 2, pool_kind=k, attention_backend="triton") for k in ("compact", "paged")]
    rng = random.Random(5)
    for call in range(6):
        batch = [
            ChunkRequest(r, random_codes(ring_decoder, 1, rng.randint(1, 6), seed=10 * call + i)[:, 0], call == 5)
            for i, r in enumerate("ab")
        ]
        a, b = (s.decode(batch) for s in sessions)
        for r in "ab":
            assert torch.equal(a[r].audio, b[r].audio), (call, r)
    assert sessions[1].pool.free_page_counts() == [2 * g.ring_capacity // 5 for g in ring_decoder.config.groups]


def _solo(decoder, codes, schedule):
    return decoder.decode(codes[:, None], chunk_frames=schedule)[0]


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
def test_streams_preempted_for_pages_resume_exactly(ring_decoder):
    """Three slots but pages for about two full streams: the youngest live stream is preempted
    (state saved to the host, pages freed) when the others need pages, waits ahead of new streams,
    and resumes exactly: every stream's audio equals its solo decode, nothing leaks."""
    session = make_session(ring_decoder, 3, pool_kind="paged", page_fraction=0.67)
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
    assert stats["preemptions"] > 0 and stats["preemption_seconds"] > 0
    # Each saved state holds its frame counter (8 bytes) and the cells in use of every layer (rings of 5 and 10
    # tokens, 2 heads of 64 dims, float32, keys and values): a whole number of (2 x 2 x 64 x 4)-byte cells.
    cells = stats["preempted_bytes"] - 8 * stats["preemptions"]
    assert cells > 0 and cells % (2 * 2 * 64 * 4) == 0
    for r in names:
        got, want = torch.cat(audio[r], -1), _solo(ring_decoder, codes[r], schedules[r])
        # Within GEMM rounding of other batch shapes (1e-5 of the peak, as the session's own tests).
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), r
    assert session.live_requests == {} and session.free_slots == 3
    assert pool.free_page_counts() == [3, 5]


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
@pytest.mark.parametrize("page_fraction", [1.0, 0.67])
def test_paged_session_against_the_compact_session(page_fraction, ring_decoder):
    """CPU form of the CUDA graph test below (no graphs): same trace, same assertions."""
    _paged_session_case(ring_decoder, page_fraction)


@_cuda
@pytest.mark.parametrize("page_fraction", [1.0, 0.67])
def test_cuda_graph_session_on_a_paged_pool(page_fraction, cuda_ring_decoder):
    """CUDA graphs captured over a paged pool replay with the page tables the scheduler reserves and the step
    runner commits before each replay: with pages for every slot the audio is bitwise the compact session's (graphs too);
    short of pages, preempted streams resume and every stream equals the compact session within
    rounding of other batch shapes. No step runs eagerly."""
    _paged_session_case(cuda_ring_decoder, page_fraction)


def _paged_session_case(dec, page_fraction):
    on_cuda = next(dec.parameters()).is_cuda
    graphs = dict(graph_frame_totals=frame_totals(3 * 4), graph_frame_sizes=(1, 4))  # the stage's ladder
    compact = make_session(dec, 3, pool_kind="compact", attention_backend="triton", **graphs)
    paged = make_session(dec, 3, pool_kind="paged", page_fraction=page_fraction, **graphs)
    assert (compact.runner is not None and paged.runner is not None) == on_cuda
    full = paged.pool.free_page_counts()
    rng = random.Random(4)
    names = ["a", "b", "c", "d"]
    schedules = {r: [rng.randint(1, 4) for _ in range(6)] for r in names}
    codes = {r: random_codes(dec, 1, sum(s), seed=i)[:, 0] for i, (r, s) in enumerate(schedules.items())}
    audio = {k: {r: [] for r in names} for k in ("compact", "paged")}
    for call in range(6):
        batch = []
        for r in names:
            start = sum(schedules[r][:call])
            batch.append(ChunkRequest(r, codes[r][:, start : start + schedules[r][call]], call == 5))
        for key, session in (("compact", compact), ("paged", paged)):
            for r, res in session.decode(batch).items():
                assert res.error is None, res.error
                audio[key][r].append(res.audio)
    for key, session in (("compact", compact), ("paged", paged)):
        while session.waiting_requests:
            for r, res in session.decode([]).items():
                audio[key][r].append(res.audio)
        if on_cuda:
            assert session.stats()["steps_by_path"]["eager"] == 0, key
    preempted = paged.stats()["preemptions"]
    assert (preempted == 0) == (page_fraction == 1.0)
    for r in names:
        want, got = torch.cat(audio["compact"][r], -1), torch.cat(audio["paged"][r], -1)
        assert got.shape == want.shape == (1, sum(schedules[r]) * dec.config.samples_per_frame), r
        if page_fraction == 1.0:
            assert torch.equal(got, want), r
        else:
            tol = 1e-5 if dec.state_dtype == torch.float32 else 3e-2
            assert (got - want).abs().max() <= tol * want.abs().max(), r
    assert paged.free_slots == 3 and paged.pool.free_page_counts() == full
    for session in (compact, paged):
        session.close()


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
def test_a_preempted_stream_keeps_its_chunks_whatever_the_queue_bounds(ring_decoder):
    """A preempted stream was live: its later chunks are buffered even when they exceed the admission
    queue's frame bound, and it resumes exactly (its audio equals its solo decode)."""
    session = make_session(ring_decoder, 2, pool_kind="paged", page_fraction=0.75, max_waiting_frames=3)
    codes = {r: random_codes(ring_decoder, 1, 9, seed=i)[:, 0] for i, r in enumerate("ab")}
    schedule, start = [1, 2, 2, 2, 2], 0
    audio = {r: [] for r in "ab"}
    for call, n in enumerate(schedule):
        batch = [ChunkRequest(r, codes[r][:, start : start + n], call == len(schedule) - 1) for r in "ab"]
        start += n
        for r, res in session.decode(batch).items():
            assert res.error is None, (call, r, res.error)
            audio[r].append(res.audio)
    assert session.stats()["preemptions"] >= 1
    assert session.live_requests == {} and session.waiting_requests == []
    for r in "ab":
        want = _solo(ring_decoder, codes[r], schedule)
        got = torch.cat(audio[r], -1)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), r


def test_a_stream_ending_in_the_call_is_never_the_one_preempted(ring_decoder):
    """Both streams bring chunks that together need more pages than the pool holds; the youngest ("b") sends its
    terminal chunk. "a" is preempted instead, "b" is decoded and ends, and "a" is restored and decoded in the
    same call: every chunk of the call comes back, exactly."""
    session = make_session(ring_decoder, 2, pool_kind="paged", page_fraction=0.75)
    assert session.pool.free_page_counts() == [2, 3]
    codes = random_codes(ring_decoder, 2, 5, seed=1)
    a, b = codes[:, 0], codes[:, 1]
    first = session.decode([ChunkRequest("a", a[:, :1]), ChunkRequest("b", b[:, :1])])
    got = session.decode([ChunkRequest("a", a[:, 1:]), ChunkRequest("b", b[:, 1:], True)])
    assert {r: (got[r].frames, got[r].error, got[r].queued) for r in "ab"} == {
        "a": (4, None, False),
        "b": (4, None, False),
    }
    assert session.stats()["preemptions"] == 1 and set(session.live_requests) == {"a"}
    for r, c in (("a", a), ("b", b)):
        want = _solo(ring_decoder, c, [1, 4])
        audio = torch.cat([first[r].audio, got[r].audio], -1)
        assert audio.shape == want.shape and (audio - want).abs().max() <= 1e-5 * want.abs().max(), r


def test_a_finished_stream_gives_its_pages_back_before_anyone_is_preempted(ring_decoder):
    """A stream whose terminal chunk is empty only waits to end: when a live stream needs pages, it is
    released, not preempted (no state is saved for it, nothing waits behind it)."""
    session = make_session(ring_decoder, 4, pool_kind="paged", page_fraction=0.375)
    q = ring_decoder.config.num_quantizers
    assert session.pool.free_page_counts() == [2, 3]
    session.decode([ChunkRequest("a", random_codes(ring_decoder, 1, 1, seed=1)[:, 0])])
    session.decode([ChunkRequest("b", random_codes(ring_decoder, 1, 6, seed=2)[:, 0])])
    assert session.pool.free_page_counts() == [0, 0]
    got = session.decode(
        [
            ChunkRequest("a", random_codes(ring_decoder, 1, 5, seed=3)[:, 0]),
            ChunkRequest("b", torch.zeros(q, 0, dtype=torch.long), True),
        ]
    )
    assert got["a"].frames == 5 and not got["b"].queued
    assert session.stats()["preemptions"] == 0 and session.waiting_requests == []
    assert set(session.live_requests) == {"a"}
    got = session.decode([ChunkRequest("d", random_codes(ring_decoder, 1, 1, seed=4)[:, 0])])
    assert got["d"].frames == 1 and set(session.live_requests) == {"a", "d"}


def test_new_streams_wait_while_live_streams_need_the_pages(ring_decoder, caplog):
    """Admission counts the pages the live streams' chunks of the same batch need: a new stream that
    would leave them short waits (rather than being admitted and preempted at once). A waiting stream
    that the engine ends with frames still buffered loses them, and the log says so."""
    session = make_session(ring_decoder, 3, pool_kind="paged", page_fraction=0.34)
    assert session.pool.free_page_counts() == [2, 3]  # rings of 1 and 2 pages
    session.decode([ChunkRequest("a", random_codes(ring_decoder, 1, 1, seed=1)[:, 0])])
    # a's next 5 frames take the last group-1 page but one; b's 3 frames (6 tokens) would need two.
    got = session.decode(
        [
            ChunkRequest("b", random_codes(ring_decoder, 1, 3, seed=2)[:, 0]),  # before a's chunk in the batch
            ChunkRequest("a", random_codes(ring_decoder, 1, 5, seed=3)[:, 0]),
        ]
    )
    assert got["a"].frames == 5 and got["b"].queued and got["b"].frames == 0
    assert session.stats()["preemptions"] == 0 and session.waiting_requests == ["b"]
    with caplog.at_level(logging.ERROR):
        session.on_requests_finished(["b"])
    assert "request 'b' ended while waiting for a slot; its 3 buffered frames are dropped undecoded" in caplog.text


def test_a_stream_is_admitted_for_all_it_brings_not_just_one_piece(ring_decoder):
    """A new stream whose first chunk needs more pages than are free waits (it used to be admitted for
    its first piece, then preempted in the same call and again on every call after)."""
    session = make_session(ring_decoder, 3, pool_kind="paged", page_fraction=0.5, max_step_frames=1)
    assert session.pool.free_page_counts() == [2, 3]
    session.decode([ChunkRequest("a", random_codes(ring_decoder, 1, 3, seed=1)[:, 0])])
    assert session.pool.free_page_counts() == [1, 1]
    got = session.decode([ChunkRequest("b", random_codes(ring_decoder, 1, 12, seed=2)[:, 0])])
    assert got["b"].queued and session.waiting_requests == ["b"]
    for i in range(3):
        got = session.decode([ChunkRequest("a", random_codes(ring_decoder, 1, 1, seed=10 + i)[:, 0])])
        assert got["a"].frames == 1
    assert session.stats()["preemptions"] == 0


def test_a_session_call_writes_the_page_tables_once_however_many_streams_it_admits(ring_decoder):
    """Admitting many new streams in one call costs one page-table write per resolution group on the device
    (it was one copy and one write per group for each stream), and the audio equals the compact pool's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountWrites(TorchDispatchMode):
        writes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index_put_.default:
                CountWrites.writes += 1
            return func(*args, **(kwargs or {}))

    streams = 6
    compact = make_session(ring_decoder, streams, pool_kind="compact", attention_backend="triton", max_step_frames=4)
    paged = make_session(ring_decoder, streams, pool_kind="paged", attention_backend="triton", max_step_frames=4)
    batch = [ChunkRequest(f"r{i}", random_codes(ring_decoder, 1, 4, seed=30 + i)[:, 0]) for i in range(streams)]
    want = compact.decode(batch)
    with CountWrites():
        got = paged.decode(batch)
    groups = len(ring_decoder.config.groups)
    assert CountWrites.writes == groups, "one page-table write per group for the whole call"
    for rid in want:
        assert torch.equal(got[rid].audio, want[rid].audio), rid


def _terminal_waiters_beside_two_live_streams(decoder, caplog):
    """Pages for two full streams in four slots: "a" and "b" fill their rings, "h" arrives and waits, then three
    later streams "x", "y", "z" arrive one after the other, each waiting a call and sending its terminal chunk in
    the next, beside a chunk of "a" and of "b". Everything then ends and drains. Returns (the result of every
    call, the streams preempted, in order, the session's stats); every stream's audio equals its solo decode."""
    session = make_session(decoder, 4, pool_kind="paged", page_fraction=0.6)
    assert session.pool.free_page_counts() == [3, 5]
    plan = {"a": [5, 1, 1, 1, 1], "b": [5, 1, 1, 1, 1], "h": [3, 1], "x": [2, 2], "y": [2, 2], "z": [2, 2]}
    codes = {r: random_codes(decoder, 1, sum(n), seed=i)[:, 0] for i, (r, n) in enumerate(plan.items())}
    sent = dict.fromkeys(plan, 0)
    audio = {r: [] for r in plan}

    def chunk(r):
        k = sent[r]
        start = sum(plan[r][:k])
        sent[r] += 1
        return ChunkRequest(r, codes[r][:, start : start + plan[r][k]], sent[r] == len(plan[r]))

    calls = [["a", "b"], ["h"]]
    for r in "xyz":
        calls += [[r], [r, "a", "b"]]
    calls.append(["a", "b", "h"])
    results = []
    with caplog.at_level(logging.INFO, logger="vllm_omni_moss.model_executor.models.moss_tts.serving.scheduler"):
        for names in calls:
            results.append(session.decode([chunk(r) for r in names]))
            for r, res in results[-1].items():
                assert res.error is None, (r, res.error)
                audio[r].append(res.audio)
        while session.waiting_requests:
            for r, res in session.decode([]).items():
                audio[r].append(res.audio)
    assert session.live_requests == {} and session.free_slots == 4
    for r in plan:
        got, want = torch.cat(audio[r], -1), _solo(decoder, codes[r], plan[r])
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), r
    preempted = [m.split("'")[1] for m in caplog.messages if m.endswith("preempted to free decoder state pages")]
    assert session.stats()["preemptions"] == len(preempted)
    return results, preempted, session.stats()


def test_no_stream_is_preempted_again_before_the_others_were(ring_decoder, caplog):
    """Each terminal chunk of a waiting stream needs a live stream's pages for one call. The victim is the live
    stream preempted the fewest times (then the youngest), and a preempted stream resumes behind those preempted
    before it: "b", "a" and "h" take turns (before, "b", re-admitted last, was preempted for every one of them
    while "a" never was)."""
    _, preempted, stats = _terminal_waiters_beside_two_live_streams(ring_decoder, caplog)
    assert preempted == ["b", "a", "h", "a"]
    assert stats["streams_by_preemptions"] == {0: 3, 1: 2, 2: 1}  # x, y, z; b, h; a


def test_a_waiting_new_stream_is_admitted_no_later_than_later_arrivals(ring_decoder, caplog):
    """A new stream, "h", waits at the head of the queue when "x", which arrived after it, sends its terminal
    chunk: "h" is admitted and decoded in that call too (before, "h" waited while "x", "y" and "z" were admitted,
    decoded and ended)."""
    results, _, _ = _terminal_waiters_beside_two_live_streams(ring_decoder, caplog)
    assert results[1]["h"].queued and results[1]["h"].frames == 0
    got = [(results[3][r].frames, results[3][r].queued) if r in results[3] else None for r in ("x", "h")]
    assert got == [(4, False), (3, False)]
