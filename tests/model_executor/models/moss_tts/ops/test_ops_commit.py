# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.commit``: masked ring commit and offset commit.

How the Triton kernels are tested on CPU: Triton decides at ``@triton.jit`` time (i.e. when ``kernels``
is imported) whether a kernel is compiled or interpreted, from ``TRITON_INTERPRET``. Setting the variable
inside this process would also turn the CUDA tests' kernels into interpreted ones, so instead
``test_triton_interpreter_subprocess`` re-runs this file in a child with ``TRITON_INTERPRET=1``, selecting
the ``*interpreted*`` tests; those are skipped in the parent. To run them directly:

    TRITON_INTERPRET=1 python -m pytest tests/model_executor/models/moss_tts/ops/test_ops_commit.py -k interpreted

With triton 3.9 the interpreter runs the kernels on CPU tensors as they are (no CUDA needed).
"""

import pytest
import torch
from moss_codecs import cuda_kernel_test as cuda
from moss_codecs import interpreter_subprocess_test, needs_interpreter

from vllm_omni_moss.model_executor.models.moss_tts.ops import commit as kernels

cpu = pytest.mark.cpu


# ----------------------------------------------------------------------------------------------------
# Builders and an oracle independent of kernels.touched_ring_mask
# ----------------------------------------------------------------------------------------------------


def scatter_chunk(pool, slot_ids, offsets, num_tokens, generator):
    """Reference step: gather ``pool[:, slot_ids]`` and scatter T random K/V tokens at (offset + t) mod C.

    Returns rows ``(2, B, H, C, Dh)``. For T > C several tokens share a ring index (duplicate destinations).
    """
    rows = pool[:, slot_ids].clone()
    _, num_rows, num_heads, capacity, head_dim = rows.shape
    chunk = torch.randn(2, num_rows, num_heads, num_tokens, head_dim, generator=generator, device=pool.device).to(
        pool.dtype
    )
    ring = (offsets[:, None] + torch.arange(num_tokens, device=pool.device)[None, :]) % capacity  # (B, T)
    index = ring[None, :, None, :, None].expand(2, num_rows, num_heads, num_tokens, head_dim)
    rows.scatter_(3, index, chunk)
    return rows


def expected_pool(pool, rows, slot_ids, valid_rows, offsets, num_tokens):
    """Original pool with each valid row's ring replaced, token by token, at (offset + t) mod C."""
    expected = pool.clone()
    capacity = pool.shape[3]
    for b in range(rows.shape[1]):
        if not bool(valid_rows[b]):
            continue
        slot = int(slot_ids[b])
        for t in range(num_tokens):
            r = (int(offsets[b]) + t) % capacity
            expected[:, slot, :, r] = rows[:, b, :, r]
    return expected


def make_case(capacity, num_tokens, head_dim=16, num_heads=2, num_slots=7, seed=0, dtype=torch.float32):
    """A pool with a zero null slot (the last) and 6 rows: 3 valid with distinct slots, 3 invalid.

    Invalid rows point at the null slot (twice) and at an out-of-range id; offsets include 0, a value
    below C and 1234.
    """
    generator = torch.Generator().manual_seed(seed)
    null_slot = num_slots - 1
    pool = torch.randn(2, num_slots, num_heads, capacity, head_dim, generator=generator).to(dtype)
    pool[:, null_slot] = 0
    valid_slots = torch.randperm(null_slot, generator=generator)[:3]
    slot_ids = torch.tensor(
        [int(valid_slots[0]), null_slot, int(valid_slots[1]), null_slot, int(valid_slots[2]), null_slot]
    )
    valid_rows = torch.tensor([True, False, True, False, True, False])
    offsets = torch.tensor([1234, 3, 0, 1234, int(torch.randint(0, 50, (), generator=generator)), 7])
    # Gather through the normalised ids, then give one invalid row a garbage id: it must never be read.
    rows = scatter_chunk(pool, slot_ids, offsets, num_tokens, generator)
    slot_ids[5] = num_slots + 5
    return pool, rows, slot_ids, valid_rows, offsets, null_slot


def written(valid_rows, num_tokens):
    """Tokens each row writes: ``num_tokens`` for valid rows, 0 for padding rows."""
    return torch.where(valid_rows, num_tokens, 0)


CAPACITIES = (5, 10)
CHUNKS = (1, 3, 5, 7, 12)


# ----------------------------------------------------------------------------------------------------
# CPU: reference semantics
# ----------------------------------------------------------------------------------------------------


@cpu
@pytest.mark.parametrize("impl", ["reference", "public_op"])
@pytest.mark.parametrize("num_tokens", CHUNKS)
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_commit_ring_matches_independent_construction(capacity, num_tokens, impl):
    pool, rows, slot_ids, valid_rows, offsets, null_slot = make_case(capacity, num_tokens)
    expected = expected_pool(pool, rows, slot_ids, valid_rows, offsets, num_tokens)
    cache = pool.clone()
    commit = kernels.commit_ring_reference if impl == "reference" else kernels.commit_ring
    commit(rows, cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    assert torch.equal(cache, expected)
    assert not cache[:, null_slot].any(), "invalid rows wrote into the null slot"


#: Tokens written per row of make_case's 6 rows in a 12-token step: a full row, a partial row, one
#: token, and padding rows (0) - per-frame validity inside one step.
MIXED_COUNTS = (12, 0, 4, 0, 1, 0)


def expected_mixed(pool, rows, slot_ids, offsets, counts):
    expected = pool.clone()
    capacity = pool.shape[3]
    for b, n in enumerate(counts):
        for t in range(n):
            r = (int(offsets[b]) + t) % capacity
            expected[:, int(slot_ids[b]), :, r] = rows[:, b, :, r]
    return expected


@cpu
@pytest.mark.parametrize("impl", ["reference", "public_op"])
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_commit_ring_writes_each_rows_own_count(capacity, impl):
    pool, rows, slot_ids, _, offsets, null_slot = make_case(capacity, 12, seed=5)
    counts = torch.tensor(MIXED_COUNTS)
    cache = pool.clone()
    commit = kernels.commit_ring_reference if impl == "reference" else kernels.commit_ring
    commit(rows, cache, slot_ids, offsets, counts, 12)
    assert torch.equal(cache, expected_mixed(pool, rows, slot_ids, offsets, MIXED_COUNTS))
    assert not cache[:, null_slot].any()


@cpu
@pytest.mark.parametrize("capacity,num_tokens", [(5, 5), (5, 7), (5, 12), (10, 12)])
def test_commit_ring_replaces_whole_ring_when_chunk_covers_capacity(capacity, num_tokens):
    pool, rows, slot_ids, valid_rows, offsets, null_slot = make_case(capacity, num_tokens, seed=1)
    cache = pool.clone()
    kernels.commit_ring_reference(rows, cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    untouched = torch.ones(pool.shape[1], dtype=torch.bool)
    for b in valid_rows.nonzero().flatten().tolist():
        slot = int(slot_ids[b])
        assert torch.equal(cache[:, slot], rows[:, b])
        untouched[slot] = False
    assert torch.equal(cache[:, untouched], pool[:, untouched])


@cpu
def test_touched_ring_mask_wraps_and_saturates():
    offsets = torch.tensor([0, 3, 1234])
    mask = kernels.touched_ring_mask(offsets, torch.tensor([3, 3, 3]), 5)
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, False, False, True, True],  # 3, 4, 0
        [True, True, False, False, True],  # 1234 % 5 = 4: 4, 0, 1
    ]
    assert kernels.touched_ring_mask(offsets, torch.tensor([5, 9, 5]), 5).all()
    assert not kernels.touched_ring_mask(offsets, torch.tensor([0, 0, 0]), 5).any()
    # Each row its own count: 2 cells, none, 1 cell.
    assert kernels.touched_ring_mask(offsets, torch.tensor([2, 0, 1]), 5).sum(dim=1).tolist() == [2, 0, 1]


@cpu
@pytest.mark.parametrize("impl", ["reference", "public_op"])
def test_commit_offsets_writes_valid_rows_only(impl):
    bank = torch.tensor([10, 11, 12, 13, 0])
    null_slot = 4
    values = torch.tensor([100, 101, 102, 103, 104])
    slot_ids = torch.tensor([2, null_slot, 0, null_slot, 99])  # duplicate and out-of-range invalid ids
    valid_rows = torch.tensor([True, False, True, False, False])
    commit = kernels.commit_offsets_reference if impl == "reference" else kernels.commit_offsets
    commit(values, bank, slot_ids, valid_rows)
    assert bank.tolist() == [102, 11, 100, 13, 0]


def _decode_step(rows, cache, slot_ids, valid_rows, offsets, bank, num_tokens: int):
    kernels.commit_ring(rows, cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    next_offsets = torch.where(valid_rows, offsets + num_tokens, offsets)
    kernels.commit_offsets(next_offsets, bank, slot_ids, valid_rows)
    return cache.sum(dim=(0, 2, 3, 4))


@cpu
def test_compile_fullgraph_matches_eager():
    # aot_eager traces through Dynamo, the fake impls and functionalization of the mutated arguments, which
    # is what the ops contribute; Inductor's CPU codegen would add ~30 s and is covered on CUDA.
    compiled = torch.compile(_decode_step, fullgraph=True, dynamic=True, backend="aot_eager")
    for capacity, num_tokens, keep in [(5, 3, 6), (10, 12, 4)]:
        pool, rows, slot_ids, valid_rows, offsets, null_slot = make_case(capacity, num_tokens)
        rows, slot_ids, valid_rows, offsets = rows[:, :keep], slot_ids[:keep], valid_rows[:keep], offsets[:keep]
        bank = torch.arange(pool.shape[1]) * 1000
        eager_cache, eager_bank = pool.clone(), bank.clone()
        eager_sums = _decode_step(rows, eager_cache, slot_ids, valid_rows, offsets, eager_bank, num_tokens)
        compiled_cache, compiled_bank = pool.clone(), bank.clone()
        compiled_sums = compiled(rows, compiled_cache, slot_ids, valid_rows, offsets, compiled_bank, num_tokens)
        assert torch.equal(compiled_cache, eager_cache)
        assert torch.equal(compiled_bank, eager_bank)
        assert torch.equal(compiled_sums, eager_sums)
        assert not compiled_cache[:, null_slot].any() and compiled_bank[null_slot] == bank[null_slot]


def _good_ring_args():
    rows = torch.zeros(2, 3, 2, 5, 16)
    cache = torch.zeros(2, 4, 2, 5, 16)
    return dict(
        rows=rows,
        ring=cache,
        slot_ids=torch.zeros(3, dtype=torch.long),
        offsets=torch.zeros(3, dtype=torch.long),
        valid_tokens=torch.full((3,), 2, dtype=torch.long),
        max_written=2,
    )


def _good_offset_args():
    return dict(
        values=torch.zeros(3, dtype=torch.long),
        table=torch.zeros(4, dtype=torch.long),
        slot_ids=torch.zeros(3, dtype=torch.long),
        valid_rows=torch.ones(3, dtype=torch.bool),
    )


@cpu
@pytest.mark.parametrize(
    "name,bad",
    [
        ("rows", torch.zeros(3, 2, 5, 16)),  # rank
        ("rows", torch.zeros(3, 3, 2, 5, 16)),  # planes
        ("rows", torch.zeros(2, 3, 2, 6, 16)),  # capacity differs from cache
        ("rows", torch.zeros(2, 3, 2, 5, 16, dtype=torch.bfloat16)),  # dtype differs from cache
        ("ring", torch.zeros(2, 4, 2, 5)),  # rank
        ("slot_ids", torch.zeros(3, dtype=torch.int32)),
        ("slot_ids", torch.zeros(4, dtype=torch.long)),
        ("valid_tokens", torch.ones(3, dtype=torch.int32)),
        ("valid_tokens", torch.ones(2, dtype=torch.long)),
        ("offsets", torch.zeros(3, 1, dtype=torch.long)),
        ("max_written", -1),
    ],
)
def test_commit_ring_rejects_bad_inputs(name, bad):
    args = _good_ring_args()
    kernels.commit_ring(**args)  # the unmodified arguments are accepted
    args[name] = bad
    with pytest.raises(ValueError, match=f"`{name}`"):
        kernels.commit_ring(**args)


@cpu
@pytest.mark.parametrize(
    "name,bad",
    [
        ("table", torch.zeros(2, 4, dtype=torch.long)),
        ("table", torch.zeros(4, dtype=torch.int32)),
        ("values", torch.zeros(3, dtype=torch.float32)),
        ("slot_ids", torch.zeros(2, dtype=torch.long)),
        ("valid_rows", torch.ones(3, 1, dtype=torch.bool)),
    ],
)
def test_commit_offsets_rejects_bad_inputs(name, bad):
    args = _good_offset_args()
    kernels.commit_offsets(**args)
    args[name] = bad
    with pytest.raises(ValueError, match=f"`{name}`"):
        kernels.commit_offsets(**args)


# ----------------------------------------------------------------------------------------------------
# CPU: the Triton kernels themselves, in Triton's interpreter
# ----------------------------------------------------------------------------------------------------


test_triton_interpreter_subprocess = interpreter_subprocess_test(__file__, timeout=300)


@cpu
@needs_interpreter
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_commit_ring_interpreted_writes_each_rows_own_count(capacity):
    pool, rows, slot_ids, _, offsets, null_slot = make_case(capacity, 12, seed=6)
    cache = pool.clone()
    kernels._launch_commit_ring_triton(rows, cache, slot_ids, offsets, torch.tensor(MIXED_COUNTS), 12)
    assert torch.equal(cache, expected_mixed(pool, rows, slot_ids, offsets, MIXED_COUNTS))


@cpu
@needs_interpreter
@pytest.mark.parametrize("num_tokens", CHUNKS)
@pytest.mark.parametrize("capacity,head_dim", [(5, 16), (10, 32)])
def test_commit_ring_interpreted_matches_reference(capacity, head_dim, num_tokens):
    pool, rows, slot_ids, valid_rows, offsets, null_slot = make_case(capacity, num_tokens, head_dim=head_dim)
    reference = pool.clone()
    kernels.commit_ring_reference(rows, reference, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    triton_cache = pool.clone()
    kernels._launch_commit_ring_triton(
        rows, triton_cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens
    )
    assert torch.equal(triton_cache, reference)
    assert not triton_cache[:, null_slot].any()
    # The public op routes CPU tensors to the interpreted kernel in this process.
    op_cache = pool.clone()
    kernels.commit_ring(rows, op_cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    assert torch.equal(op_cache, reference)


@cpu
@needs_interpreter
def test_commit_ring_interpreted_follows_strides():
    capacity, num_tokens = 10, 7
    pool, rows, slot_ids, valid_rows, offsets, _ = make_case(capacity, num_tokens, head_dim=16)
    reference = pool.clone()
    kernels.commit_ring_reference(rows, reference, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    # Same logical tensors, stored with heads innermost but one and planes last.
    rows_view = rows.permute(1, 3, 2, 4, 0).contiguous().permute(4, 0, 2, 1, 3)
    cache_view = pool.permute(1, 3, 2, 4, 0).contiguous().permute(4, 0, 2, 1, 3)
    assert not rows_view.is_contiguous() and not cache_view.is_contiguous()
    kernels._launch_commit_ring_triton(
        rows_view, cache_view, slot_ids[::1], offsets, written(valid_rows, num_tokens), num_tokens
    )
    assert torch.equal(cache_view, reference)


@cpu
@needs_interpreter
@pytest.mark.parametrize("num_rows", [5, 300])  # 300 spans several programs of 128 rows
def test_commit_offsets_interpreted_matches_reference(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    num_slots = num_rows + 1
    null_slot = num_rows
    bank = torch.randint(0, 10_000, (num_slots,), generator=generator)
    valid_rows = torch.rand(num_rows, generator=generator) < 0.6
    # Valid rows get distinct slots; invalid ones all share the null slot.
    slot_ids = torch.where(valid_rows, torch.randperm(num_rows, generator=generator), null_slot)
    values = torch.randint(0, 1 << 40, (num_rows,), generator=generator)
    reference = bank.clone()
    kernels.commit_offsets_reference(values, reference, slot_ids, valid_rows)
    triton_bank = bank.clone()
    kernels._launch_commit_offsets_triton(values, triton_bank, slot_ids, valid_rows)
    assert torch.equal(triton_bank, reference)
    assert triton_bank[null_slot] == bank[null_slot]
    op_bank = bank.clone()
    kernels.commit_offsets(values, op_bank, slot_ids, valid_rows)
    assert torch.equal(op_bank, reference)


# ----------------------------------------------------------------------------------------------------
# CUDA: compiled kernels
# ----------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("num_tokens", [1, 15, 240, 480])
def test_masked_commit_preserves_reference_scatter(num_tokens):
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    capacity = 400
    pool = torch.randn(2, 5, 2, capacity, 64, generator=generator, device=device).to(torch.bfloat16)
    slot_ids = torch.tensor([2, 0, 4, 4], device=device)
    valid_rows = torch.tensor([True, True, False, False], device=device)
    offsets = torch.tensor([397, 1234, 0, 0], device=device)
    # For T = 480 the scatter has 80 duplicate destinations per row; CUDA picks a winner arbitrarily and
    # the commit must keep exactly that winner, so the expectation is built from the same rows.
    rows = scatter_chunk(pool, slot_ids, offsets, num_tokens, generator)
    expected = pool.clone()
    for b in range(2):
        ring = torch.unique((offsets[b] + torch.arange(num_tokens, device=device)) % capacity)
        expected[:, slot_ids[b], :, ring] = rows[:, b, :, ring]
    if num_tokens >= capacity:
        assert torch.equal(expected[:, 2], rows[:, 0]) and torch.equal(expected[:, 0], rows[:, 1])
    cache = pool.clone()
    kernels.commit_ring(rows, cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[:, 4], pool[:, 4]), "invalid rows wrote into the null slot"

    bank = torch.tensor([5, 6, 7, 8, 9], device=device)
    next_offsets = torch.where(valid_rows, offsets + num_tokens, offsets)
    kernels.commit_offsets(next_offsets, bank, slot_ids, valid_rows)
    assert bank.tolist() == [1234 + num_tokens, 6, 397 + num_tokens, 8, 9]


@cuda
@pytest.mark.parametrize("capacity,head_dim,num_tokens", [(125, 64, 15), (250, 64, 240), (125, 48, 130), (5, 16, 3)])
def test_cuda_kernels_match_reference(capacity, head_dim, num_tokens):
    device = torch.device("cuda")
    case = make_case(capacity, num_tokens, head_dim=head_dim, num_heads=3, dtype=torch.bfloat16)
    pool, rows, slot_ids, valid_rows, offsets = (t.to(device) for t in case[:5])
    null_slot = case[5]
    reference = pool.clone()
    kernels.commit_ring_reference(rows, reference, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    cache = pool.clone()
    kernels.commit_ring(rows, cache, slot_ids, offsets, written(valid_rows, num_tokens), num_tokens)
    assert torch.equal(cache, reference)
    assert not cache[:, null_slot].any()


@cuda
def test_ops_capture_in_cuda_graph():
    device = torch.device("cuda")
    capacity, num_tokens = 125, 15
    pool, rows, slot_ids, valid_rows, offsets, null_slot = make_case(
        capacity, num_tokens, head_dim=64, dtype=torch.bfloat16
    )
    static = [t.to(device) for t in (rows, slot_ids, valid_rows, offsets)]
    s_rows, s_slots, s_valid, s_offsets = static
    cache = pool.to(device)
    bank = torch.zeros(pool.shape[1], dtype=torch.long, device=device)
    s_next = torch.zeros_like(s_offsets)
    # Warm up (compiles the Triton kernels) on a side stream before capture, as CUDA graphs require.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.commit_ring(s_rows, cache.clone(), s_slots, s_offsets, written(s_valid, num_tokens), num_tokens)
        kernels.commit_offsets(s_next, bank.clone(), s_slots, s_valid)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.commit_ring(s_rows, cache, s_slots, s_offsets, written(s_valid, num_tokens), num_tokens)
        kernels.commit_offsets(s_next, bank, s_slots, s_valid)
    for seed in range(3):
        new_pool, new_rows, new_slots, new_valid, new_offsets, _ = make_case(
            capacity, num_tokens, head_dim=64, seed=seed + 10, dtype=torch.bfloat16
        )
        new_slots[5] = null_slot  # the graph is replayed with fresh data, including different slots
        for dst, src in zip((s_rows, s_slots, s_valid, s_offsets), (new_rows, new_slots, new_valid, new_offsets)):
            dst.copy_(src)
        s_next.copy_(torch.where(s_valid, s_offsets + num_tokens, s_offsets))
        cache.copy_(new_pool)
        bank.zero_()
        graph.replay()
        expected = expected_pool(new_pool, new_rows, new_slots, new_valid, new_offsets, num_tokens)
        assert torch.equal(cache.cpu(), expected)
        expected_bank = torch.zeros(pool.shape[1], dtype=torch.long)
        kernels.commit_offsets_reference(s_next.cpu(), expected_bank, new_slots, new_valid)
        assert torch.equal(bank.cpu(), expected_bank)


@cuda
@pytest.mark.slow
def test_ops_under_inductor_dynamic():
    device = torch.device("cuda")
    compiled = torch.compile(_decode_step, fullgraph=True, dynamic=True)
    for capacity, num_tokens, keep in [(125, 15, 6), (125, 130, 4)]:
        pool, rows, slot_ids, valid_rows, offsets, null_slot = (
            t.to(device) if isinstance(t, torch.Tensor) else t
            for t in make_case(capacity, num_tokens, head_dim=64, dtype=torch.bfloat16)
        )
        rows, slot_ids, valid_rows, offsets = rows[:, :keep], slot_ids[:keep], valid_rows[:keep], offsets[:keep]
        bank = torch.arange(pool.shape[1], device=device) * 1000
        eager_cache, eager_bank = pool.clone(), bank.clone()
        _decode_step(rows, eager_cache, slot_ids, valid_rows, offsets, eager_bank, num_tokens)
        compiled_cache, compiled_bank = pool.clone(), bank.clone()
        compiled(rows, compiled_cache, slot_ids, valid_rows, offsets, compiled_bank, num_tokens)
        assert torch.equal(compiled_cache, eager_cache)
        assert torch.equal(compiled_bank, eager_bank)
        assert not compiled_cache[:, null_slot].any()


@cuda
def test_commit_ring_addresses_beyond_int32():
    device = torch.device("cuda")
    num_slots, num_heads, capacity, head_dim = 1100, 16, 1024, 64
    assert 2 * num_slots * num_heads * capacity * head_dim > 2**31  # 2.3e9 elements, 4.6 GB in bf16
    cache = torch.zeros(2, num_slots, num_heads, capacity, head_dim, dtype=torch.bfloat16, device=device)
    rows = torch.randn(2, 2, num_heads, capacity, head_dim, device=device).to(torch.bfloat16)
    slot_ids = torch.tensor([num_slots - 1, num_slots - 2], device=device)
    valid_rows = torch.tensor([True, False], device=device)
    offsets = torch.tensor([17, 0], device=device)
    kernels.commit_ring(rows, cache, slot_ids, offsets, written(valid_rows, capacity), capacity)
    assert torch.equal(cache[:, num_slots - 1], rows[:, 0])
    assert not cache[:, num_slots - 2].any()
    assert not cache[:, : num_slots - 1].any()
