# SPDX-License-Identifier: Apache-2.0
"""What every pool does (state/pool.py): initialise and close, the slot lifecycle, reset, save and restore."""

from __future__ import annotations

import pytest
import torch
from moss_codecs import acquire_all as _acquire_all
from moss_codecs import compact_and_paged_pools as _pools
from moss_codecs import initialized_state_pool as _pool_for
from moss_codecs import make_state_pool, random_codes
from moss_codecs import slot_bits as _slot_bits
from moss_codecs import step_every_row as _decode
from moss_codecs import step_valid_rows as _run
from moss_codecs import step_valid_rows as _step

from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch

# --------------------------------------------------------------------------------------- initialise and close


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
def test_failed_allocation_leaves_the_pool_uninitialised(ring_decoder):
    pool = make_state_pool(ring_decoder)
    with pytest.raises(RuntimeError, match="cannot allocate decoder state for 1000000000000 live streams"):
        pool.initialize(10**12)
    assert not pool.initialized and pool.state_capacity == 0 and pool.num_slots == 0 and pool.state_bytes() == 0
    pool.initialize(2)
    assert pool.num_slots == 3


@pytest.mark.cpu
@pytest.mark.core_model
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


# --------------------------------------------------------------------------------------------- slot lifecycle


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


class _DeviceOnlyIds(torch.Tensor):
    """Ids as they sit on a CUDA device: reading them back would wait for every queued step."""

    def tolist(self):
        raise AssertionError("the pool read slot ids back from the device")


@pytest.mark.parametrize("paged", [True, False])
def test_release_never_reads_ids_back_from_the_device(paged, ring_decoder, monkeypatch):
    # A reset works from the host's copy of the ids (the session waits for the device once per call).
    compact, pool = _pools(ring_decoder)
    pool = pool if paged else compact
    _step(pool, random_codes(ring_decoder, 2, 7, seed=6), [7, 5], [0, 1])
    to_device = pool._ids_to_device
    monkeypatch.setattr(pool, "_ids_to_device", lambda ids: to_device(ids).as_subclass(_DeviceOnlyIds))
    pool.release([1, 0])
    assert all(not ring.any() for ring in pool.rings)


# ------------------------------------------------------------------------------------------------------ reset


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
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


# --------------------------------------------------------------------------------------------- save / restore


@pytest.mark.cpu
@pytest.mark.core_model
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


@pytest.mark.cpu
@pytest.mark.core_model
def test_save_of_a_fresh_slot_keeps_no_cells(ring_decoder):
    pool = make_state_pool(ring_decoder)
    pool.initialize(2)
    _acquire_all(pool)  # restore_slot writes slots in use only
    state = pool.save_slot(0)
    assert state.offsets.tolist() == [0] and all(c.shape[2] == 0 for c in state.cells)
    _decode(pool, [0], 3, seed=1)
    pool.restore_slot(0, state)
    assert all(not ring[:, 0].any() for ring in pool.rings) and int(pool.frames_decoded[0]) == 0


@pytest.mark.cpu
@pytest.mark.core_model
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
